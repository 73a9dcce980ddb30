"""The README's commands as make runs them: what `make demo` and `make test` install, in which order."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_make_installs_torch_first_for_the_demo_and_the_tests():
    """`make demo` and `make test` (CI) install the pinned torch before anything that depends on it (an unpinned
    torch pulls a multi-GB CUDA build), and the test extra only for the tests."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for target, wants_test_extra in (("demo", False), ("test", True)):
        out = subprocess.run(["make", "-n", target, "PY=python"], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0 and "Circular" not in out.stderr, out.stderr
        pips = [line for line in out.stdout.splitlines() if "pip install" in line]
        assert "torch==" in pips[0]
        assert any('".[test]"' in line for line in pips) == wants_test_extra


def test_ci_walks_the_readme_path_in_one_checkout():
    """CI runs what a user runs, in the README's order and in the same checkout: the demo (short) first, so that what
    it leaves behind (runs/demo/) is there when the tests run, then `make test`, then `make lint`."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    steps = [next((i for i, line in enumerate(lines) if line.startswith(cmd)), None)
             for cmd in ("make demo", "make test", "make lint")]
    assert None not in steps and steps == sorted(steps), lines
    readme = (ROOT / "README.md").read_text()
    assert readme.index("make demo") < readme.index("make test")  # the order CI walks is the README's


def test_make_test_runs_behaviour_and_make_lint_the_project_s_rules():
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    test = subprocess.run(["make", "-n", "test", "PY=python"], cwd=ROOT, capture_output=True, text=True).stdout
    lint = subprocess.run(["make", "-n", "lint", "PY=python"], cwd=ROOT, capture_output=True, text=True).stdout
    assert '-m "not codebase and not vllm"' in test and "ruff" not in test
    assert "ruff check" in lint and "-m codebase" in lint
