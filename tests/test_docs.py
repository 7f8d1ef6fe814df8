"""The documentation keeps its promises: the README stays short (at most 250 lines) and reaches every page of
docs/ through its links; every relative link and every repository path the pages name exists; and every command in
their shell blocks that starts a run (`launch/tpu_run.py`, directly or through `launch/tpu_vm.sh`) parses with the
launcher's own flags, config file, preset, mode and override fields, and gives a config `validate` accepts.

Nothing runs: the launcher is imported as a module and only its parser is called."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LAUNCHER = ROOT / "launch" / "tpu_run.py"
TPU_VM = ROOT / "launch" / "tpu_vm.sh"
MAX_README_LINES = 250
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
# The repository paths a page names, as tests/test_references.py finds them in code (plus images).
REFERENCE = re.compile(r"(?<![\w./$-])((?:[\w.][\w.-]*/)+[\w.-]+\.(?:py|md|ipynb|sh|toml|png))\b")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
OPERATORS = re.compile(r"^[;&|()<>]+$")
SHELL_KEYWORDS = {"do", "then", "else", "elif", "{", "time", "nohup", "exec"}
VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


# ---- markdown: fenced blocks, prose, headings, links ----


def split_fences(text: str) -> tuple[list[tuple[str, int, list[str]]], list[tuple[int, str]]]:
    """(the fenced blocks as (language, first line number, lines without the fence's indentation), the numbered
    lines outside them)."""
    blocks, prose, open_block = [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if open_block is None and match:
            open_block = (match["lang"].lower(), number + 1, [], match["indent"], match["fence"])
        elif open_block is not None and re.fullmatch(f"{re.escape(open_block[4][0])}{{{len(open_block[4])},}}",
                                                     line.strip()):
            blocks.append(open_block[:3])
            open_block = None
        elif open_block is not None:
            indent = open_block[3]
            open_block[2].append(line[len(indent):] if line.startswith(indent) else line.lstrip())
        else:
            prose.append((number, line))
    assert open_block is None, f"a code fence opened on line {open_block[1] - 1} is never closed"
    return blocks, prose


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation (backticks, colons, ...) dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading's get -1, -2, ... as on GitHub."""
    found: set[str] = set()
    for _, line in split_fences(page.read_text())[1]:
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base, count = slug(match.group(1)), 0
            while (anchor := base if count == 0 else f"{base}-{count}") in found:
                count += 1
            found.add(anchor)
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every markdown link and image outside code, inline code spans left out."""
    found = []
    for number, line in split_fences(page.read_text())[1]:
        for match in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            found.append((number, match.group(1)))
    return found


def local_target(page: Path, target: str) -> tuple[Path, str] | None:
    """A relative link's file and anchor, or None for a URL."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
        return None
    path, _, anchor = target.partition("#")
    return (page.parent / path).resolve() if path else page.resolve(), anchor


def test_the_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move text to docs/ (at most {MAX_README_LINES})"


def test_every_relative_link_points_to_an_existing_file_and_heading():
    broken = []
    for page in pages():
        for number, target in links(page):
            local = local_target(page, target)
            if local is None:
                continue
            path, anchor = local
            if not path.exists():
                broken.append(f"{name(page)}:{number}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{name(page)}:{number}: {target} (no heading #{anchor} in {path.name})")
    assert broken == []


def test_every_docs_page_is_reachable_from_the_readme():
    docs = {page.resolve() for page in DOCS.glob("*.md")}
    assert docs, "docs/ holds no pages"
    reached, queue = {README.resolve()}, deque([README])
    while queue:
        page = queue.popleft()
        for _, target in links(page):
            local = local_target(page, target)
            if local and local[0].suffix == ".md" and local[0].exists() and local[0] not in reached:
                reached.add(local[0])
                queue.append(local[0])
    assert sorted(name(p) for p in docs - reached) == []
    direct = {local_target(README, t)[0] for _, t in links(README) if local_target(README, t)}
    assert direct & docs, "README.md links to no page of docs/"


def test_every_path_a_page_names_exists():
    missing = []
    for page in pages():
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in REFERENCE.finditer(line):
                ref = match.group(1)
                if not any((base / ref).exists() for base in (ROOT, ROOT / "mgrpo_jax", page.parent)):
                    missing.append(f"{name(page)}:{number}: {ref}")
    assert missing == []


def test_every_module_a_page_runs_exists():
    """`python -m NAME` in a block or in the text: NAME is a module (or package with __main__) of this repository,
    for the package and the experiments (an upper-case part, as in `mgrpo_jax.bench.NAME`, is a placeholder)."""
    missing = []
    for page in pages():
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for module in re.findall(r"python3? -m ([\w.]*\w)", line):
                if module.split(".")[0] not in ("mgrpo_jax", "experiments") or not module.islower():
                    continue
                path = ROOT / module.replace(".", "/")
                if not (path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()):
                    missing.append(f"{name(page)}:{number}: python -m {module}")
    assert missing == []


# ---- shell blocks: the commands that start a run ----


def command_lines(language: str, lines: list[str]) -> list[tuple[int, str]]:
    """(offset in the block, logical line): backslash continuations joined; in a console block only the lines
    after a `$ ` prompt."""
    logical, current, start = [], None, 0
    for offset, line in enumerate(lines):
        if current is None:
            if language == "console":
                if not line.lstrip().startswith("$ "):
                    continue
                line = line.lstrip()[2:]
            current, start = "", offset
        if current:
            line = line.lstrip()
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1].rstrip() + " "
            continue
        logical.append((start, current + line))
        current = None
    if current is not None:
        logical.append((start, current))
    return logical


def words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def simple_commands(line: str) -> list[list[str]]:
    """The line's simple commands: its words split at `;`, `&&`, `|`, `&`, ..., each without a leading shell
    keyword (`do`, `then`, ...)."""
    commands, current = [], []
    for word in words(line):
        if OPERATORS.match(word):
            commands.append(current)
            current = []
        elif current or word not in SHELL_KEYWORDS:
            current.append(word)
    commands.append(current)
    return [c for c in commands if c]


def expand(word: str, env: dict[str, str], unset: bool = True) -> str:
    """`$NAME` / `${NAME}` replaced by the value the page's blocks gave NAME, or (`unset`) one the reader would:
    for a variable they leave to the reader (`$BUCKET`), its name in lower case (`bucket`), which a URL or path
    takes and a number flag rejects."""
    def value(match):
        variable = match.group(1) or match.group(2)
        if variable in env:
            return env[variable]
        return variable.lower().replace("_", "-") if unset else match.group(0)

    return VARIABLE.sub(value, word)


def tpu_vm_flags() -> tuple[str, str]:
    """launch/tpu_vm.sh's default CONFIG and the flags template its run commands pass to tpu_run.py."""
    script = TPU_VM.read_text()
    default = re.search(r"CONFIG=\$\{CONFIG:-([^}]+)\}", script)
    template = re.search(r'local flags="([^"]*)"', script)
    assert default and template, "launch/tpu_vm.sh no longer sets CONFIG and flags as this test reads them"
    return default.group(1), template.group(1)


def launcher_commands() -> list[tuple[str, list[str]]]:
    """(where, tpu_run.py's arguments) of every command in a shell block of README.md and docs/*.md that starts a
    run: `[ENV=...] python launch/tpu_run.py ARGS` or `launch/tpu_vm.sh colocated|main|sub NAME [FLAGS]` (the
    flags that script passes, with the block's CONFIG or the script's default)."""
    found = []
    for page in pages():
        blocks, _ = split_fences(page.read_text())
        env: dict[str, str] = {}  # a page's blocks run in one shell, in order
        for language, first, lines in blocks:
            if language not in SHELL_LANGUAGES:
                continue
            for offset, line in command_lines(language, lines):
                where = f"{name(page)}:{first + offset}"
                for command in simple_commands(line):
                    command = [expand(w, env) for w in command]
                    if command[0] == "for" and len(command) > 3 and command[2] == "in":
                        env[command[1]] = command[3]  # the loop's first value
                        continue
                    if command[0] == "export":
                        command = command[1:]
                    assignments = [w for w in command if re.match(r"^\w+=", w)]
                    if len(assignments) == len(command):
                        env.update(w.split("=", 1) for w in assignments)
                        continue
                    program = next(i for i, w in enumerate(command) if not re.match(r"^\w+=", w))
                    args = command[program:]
                    at = next((i for i, w in enumerate(args) if w.endswith("tpu_run.py")), None)
                    if at is not None and all(Path(w).name.startswith("python") for w in args[:at]):
                        if not any(re.match(r"^--?(help|h$)", a) for a in args[at + 1:]):  # --help only prints
                            found.append((where, args[at + 1:]))
                    elif args[0].endswith("tpu_vm.sh") and len(args) > 2 and args[1] in ("colocated", "main", "sub"):
                        default, template = tpu_vm_flags()
                        workdir = "$BUCKET/$RUN" + ("" if args[1] == "colocated" else f"/{args[1]}")
                        values = {"CONFIG": env.get("CONFIG", default), "workdir": workdir, "role": args[1]}
                        flags = expand(expand(template.replace("$*", ""), values, unset=False), env)
                        found.append((where, [*shlex.split(flags), *args[3:]]))
    return found


COMMANDS = launcher_commands()


def names_a_preset(args: list[str]) -> bool:
    return any(re.match(r"^--?config=[^:]+:\w", a) for a in args)


def test_the_docs_have_launcher_commands_that_name_a_preset():
    assert any(names_a_preset(args) for _, args in COMMANDS), "no shell block runs launch/tpu_run.py with a preset"


def test_the_command_finder_reads_shell_as_written():
    assert simple_commands("for i in 0 1; do JAX_PLATFORMS=cpu python launch/tpu_run.py --a=$i & done; wait") == [
        ["for", "i", "in", "0", "1"], ["JAX_PLATFORMS=cpu", "python", "launch/tpu_run.py", "--a=$i"], ["done"],
        ["wait"]]
    assert simple_commands("launch/tpu_vm.sh main x   # --role=main --config.store=$B") == [
        ["launch/tpu_vm.sh", "main", "x"]]
    assert command_lines("console", ["$ python a.py \\", "  --b=1", "output line"]) == [(0, "python a.py --b=1")]
    assert expand("--workdir=$BUCKET/${RUN}/x", {"RUN": "r"}) == "--workdir=bucket/r/x"


@pytest.fixture(scope="module")
def launcher():
    """launch/tpu_run.py as a module (its absl flags defined once per process)."""
    module = sys.modules.get("mgrpo_docs_tpu_run")
    if module is None:
        spec = importlib.util.spec_from_file_location("mgrpo_docs_tpu_run", LAUNCHER)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args", [args for _, args in COMMANDS], ids=[where for where, _ in COMMANDS])
def test_launcher_command_parses(launcher, args):
    """The launcher's own parsing (flags, config file, preset, mode, override fields and their types) and the
    config's validation, as the command would meet them before anything is built. A loss that a `--loss_module`
    file of the reader's would register is left to that file."""
    from mgrpo_jax.config import validate

    argv, saved = [str(LAUNCHER), *args], sys.argv[:]
    try:
        launcher.parse_flags(argv)
        config, role = launcher._CONFIG.value, launcher._ROLE.value
        try:
            validate(config, role)
        except ValueError as e:
            problems = str(e).splitlines()[1:]
            if launcher._LOSS_MODULES.value:
                problems = [p for p in problems if not re.match(r"^\s*\w+\.loss=", p)]
            assert problems == [], f"{shlex.join(args)}\n" + "\n".join(problems)
    except launcher.UsageError as e:
        pytest.fail(f"{shlex.join(args)}\nerror: {e}")
    finally:
        sys.argv[:] = saved
        launcher.flags.FLAGS.unparse_flags()
        for flag in [f for f in launcher.flags.FLAGS if f.startswith("config.")]:  # config_flags defines one per
            delattr(launcher.flags.FLAGS, flag)  # override it parses; the next command's would be defined twice
