"""Environment benchmark: `python -m mgrpo_jax.bench.env` (world generation, search/visit latency, expert
success rates; `--judge=http`: judged answers per second of the HTTP reward judge against a loopback server). The
measurement lives beside the environment in `mgrpo_jax.env.bench`.

`--quick`: a 2,000-entity world (about the smallest that holds the default question sets) and 10 questions per
split, both grammars (seconds); further flags still apply."""

import sys

from mgrpo_jax.env.bench import main as env_main

QUICK = ["--entities", "2000", "--per_split", "10"]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--quick" in argv:
        argv = [*QUICK, *(a for a in argv if a != "--quick")]
    env_main(argv)


if __name__ == "__main__":
    main()
