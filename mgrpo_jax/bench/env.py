"""Environment benchmark: `python -m mgrpo_jax.bench.env` (world generation, search/visit latency, expert
success rates; `--judge=http`: judged answers per second of the HTTP reward judge against a loopback server). The
measurement lives beside the environment in `mgrpo_jax.env.bench`."""

from mgrpo_jax.env.bench import main

if __name__ == "__main__":
    main()
