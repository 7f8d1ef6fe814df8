"""BUILD stays honest: every module and test file has a target, and every path a target names exists."""

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
COVERED_TREES = ("mgrpo_jax", "launch", "experiments", "tests")


def _targets() -> list[dict]:
    targets = []

    def rule(kind):
        def record(**kwargs):
            targets.append({"kind": kind, **kwargs})

        return record

    namespace = {
        "load": lambda *args, **kwargs: None,
        "py_library": rule("py_library"),
        "py_test": rule("py_test"),
        "py_binary": rule("py_binary"),
        "glob": lambda *args, **kwargs: pytest.fail("BUILD must list files explicitly, not glob()"),
    }
    exec(compile((ROOT / "BUILD").read_text(), "BUILD", "exec"), namespace)  # Starlark subset is Python
    return targets


def test_target_names_are_unique_and_deps_resolve():
    targets = _targets()
    names = [t["name"] for t in targets]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for target in targets:
        for dep in target.get("deps", []):
            if dep.startswith(":"):
                assert dep[1:] in names, f"{target['name']} depends on unknown target {dep}"


def test_every_named_path_exists():
    for target in _targets():
        for path in target.get("srcs", []) + target.get("data", []) + [target.get("main", "")]:
            if path:
                assert (ROOT / path).is_file(), f"target {target['name']} names missing file {path}"


def test_every_python_file_is_covered_and_each_test_file_has_a_py_test():
    targets = _targets()
    covered = {src for t in targets for src in t.get("srcs", [])}
    tested = {src for t in targets if t["kind"] == "py_test" for src in t["srcs"]}
    files = sorted(
        str(p.relative_to(ROOT)) for tree in COVERED_TREES for p in (ROOT / tree).rglob("*.py")
    )
    assert files, "no Python files found"
    assert [f for f in files if f not in covered] == []
    test_files = [f for f in files if pathlib.Path(f).name.startswith("test_")]
    assert [f for f in test_files if f not in tested] == []


def test_launch_entry_point_is_a_binary():
    binaries = {src for t in _targets() if t["kind"] == "py_binary" for src in t["srcs"]}
    if (ROOT / "launch" / "tpu_run.py").exists():
        assert "launch/tpu_run.py" in binaries
