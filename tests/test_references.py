"""Every file the package, the experiments and the launchers point a reader at exists in the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# `a/b/c.py`-style paths and bare `NAME.md` documents named in code, comments or docstrings.
REFERENCE = re.compile(r"(?<![\w./-])((?:[\w.][\w.-]*/)+[\w.-]+\.(?:py|md|ipynb|sh|toml)|[\w-]+\.md)\b")


def dangling(text: str, here: Path) -> list[str]:
    bases = (ROOT, ROOT / "mgrpo_jax", here.parent)
    return [m.group(1) for m in REFERENCE.finditer(text) if not any((b / m.group(1)).exists() for b in bases)]


def test_the_pattern_finds_paths_and_documents():
    here = ROOT / "mgrpo_jax" / "config.py"
    assert dangling("see mgrpo_jax/rl/trainer.py and core/losses.py", here) == []
    assert dangling("see DESIGN.md section 2 and shared/reference/notes.md", here) == [
        "DESIGN.md", "shared/reference/notes.md"]


def test_no_reference_points_outside_the_repository():
    sources = [*ROOT.glob("mgrpo_jax/**/*.py"), *ROOT.glob("experiments/**/*.py"), *ROOT.glob("launch/*")]
    found = {str(p.relative_to(ROOT)): dangling(p.read_text(), p) for p in sources}
    assert {p: refs for p, refs in found.items() if refs} == {}
