"""The shape of the code base: no import cycle (lazy imports included), short functions, a lint that a user's runs
cannot change, and docs that exist and match the code they describe. These are the project's own rules, not what a
user's machine can break: `make lint` runs them (with ruff itself), `make test` leaves them out (the ``codebase``
marker)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.codebase

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "grpokit"
MAX_FUNCTION_LINES = 80
MAX_TOP_LEVEL_MODULES = 12
"""Modules directly under grpokit/ (``__init__`` included): the rest live in the wings' folders (forward/, run/,
bounds/, machine/, training/, pipeline/, rollout/, ...). Lower it as modules find their wing; never raise it."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every grpokit module ``name`` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [f"{target}.{a.name}" for a in node.names] + [target]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for c in candidates:
            while c and c not in modules and "." in c:
                c = c.rsplit(".", 1)[0]
            if c in modules and c != name:
                found.add(c)
    return found


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # a package importing its own submodules (and they it) is how packages work; cycles between modules are not
    def edges(name):
        return {d for d in graph[name] if not (name.startswith(d + ".") and d in graph and name in graph[d])}

    cycles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(edges(node)):
            if state.get(nxt) == "open":
                cycles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_functions_are_short():
    long = []
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                reason = any("long function:" in line for line in lines[node.lineno - 1:node.end_lineno])
                if n > MAX_FUNCTION_LINES and not reason:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "functions over 80 lines without a '# long function: <reason>' comment: " + ", ".join(long)


def test_lint_is_the_same_whatever_a_user_s_runs_left_in_the_checkout(tmp_path):
    """`make demo` writes runs/demo/ into the checkout, wandb writes wandb/, a user keeps a train.py at the root: none
    may change what ruff calls first-party (it once read `runs/` as a package, and `from runs import ...` in the
    tests sorted differently: `make demo` then `make lint` failed). Lints a copy of the tree with such leftovers."""
    pytest.importorskip("ruff")
    for name in ("grpokit", "tests", "benchmarks"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for folder in ("runs/demo", "runs/demo-2/checkpoint-10", "outputs", "wandb/run-1", "trainer_output"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "notes.md").write_text("a run's leftovers\n")
    for module in ("runs", "tiny", "train", "reward", "grpokit_job"):
        (tmp_path / f"{module}.py").write_text("import os\n\nprint(os.getcwd())\n")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "grpokit",
                          "tests", "benchmarks"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_loss_table_in_the_docs_is_the_registry_s():
    from grpokit.algorithms.losses import loss_table_markdown

    text = (ROOT / "docs" / "algorithms.md").read_text()
    table = text.split("<!-- loss-table:start -->\n", 1)[1].split("\n<!-- loss-table:end -->", 1)[0]
    assert table == loss_table_markdown(), (
        "docs/algorithms.md's loss table is out of date; paste the output of: python -c \"from "
        "grpokit.algorithms.losses import loss_table_markdown; print(loss_table_markdown())\"")


def test_every_cited_document_exists_and_nothing_points_outside():
    cited, outside = set(), []
    sources = [ROOT / "README.md", *PACKAGE.rglob("*.py"), *(ROOT / "docs").glob("*.md")]
    for path in sources:
        text = path.read_text()
        cited |= {m for m in re.findall(r"[\w./-]+\.md\b", text) if Path(m).name != "report.md"}
        if "../shared" in text:
            outside.append(str(path.relative_to(ROOT)))
    missing = [c for c in sorted(cited) if not any(ROOT.glob(f"**/{Path(c).name}"))]
    assert not missing, f"cited but not in the repository: {missing}"
    assert not outside, f"pointing outside the repository: {outside}"


def test_test_modules_have_unique_names():
    """pytest imports test modules by their base name (the test folders are not packages): two files with one name
    in different folders stop the whole run at collection."""
    seen: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("*.py"):
        if path.name not in ("__init__.py", "conftest.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test files share a name: {clashes}"


MAX_TRAINER_METHODS = 30
MAX_TRAINER_LINES = 500


def test_the_top_level_stays_small():
    """A new module goes into the wing it belongs to, not beside the package's front door."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules directly under grpokit/: {top}"
    for wing in [p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"]:
        assert (wing / "__init__.py").is_file(), f"grpokit/{wing.name}/ has no __init__.py"
        assert ast.get_docstring(ast.parse((wing / "__init__.py").read_text())), \
            f"grpokit/{wing.name}/__init__.py does not say what the wing owns (a docstring)"


SHADOWABLE = {"vllm", "trl", "torch", "transformers", "peft", "accelerate", "datasets", "deepspeed", "liger_kernel",
              "bitsandbytes", "safetensors", "grpokit"}


def test_no_test_folder_passes_for_a_package():
    """pytest puts ``tests/`` on ``sys.path``: a folder there named like a package (``tests/vllm``) is found by
    ``importlib.util.find_spec`` and breaks every library that probes for that package (TRL did)."""
    shadows = [p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name in SHADOWABLE]
    assert not shadows, f"tests/ folders named like packages: {shadows}"


def test_refusals_are_worded_in_one_place():
    """Every refusal of a user's value reads the same (field, value, what is allowed) because one module words it:
    ``grpokit/validation.py`` (``Checker``, ``refusal``). The phrase anywhere else is a hand-written refusal."""
    pattern = re.compile(r"is not(?:\"\s*\"|\s)+allowed")
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in PACKAGE.rglob("*.py") if p.name != "validation.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    split = [f"{p.relative_to(ROOT)}" for p in PACKAGE.rglob("*.py") if p.name != "validation.py"
             and re.search(r"is not\s*\"\s*\n\s*f?\"allowed", p.read_text())]
    assert not offenders + split, f"hand-written refusals (use grpokit.validation.refusal or Checker): {offenders + split}"


def test_every_http_reward_service_is_one_class_on_the_base():
    """A reward class that calls a service at a base URL is an ``HttpRewardService`` (the shared set-up lives there
    once) and is registered for configs with ``@reward_class`` (no second hand-written list)."""
    for path in (PACKAGE / "rewards").glob("*.py"):
        tree = ast.parse(path.read_text())
        for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
            init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            if init is None or "base_url" not in [a.arg for a in init.args.args]:
                continue
            bases = [getattr(b, "id", getattr(b, "attr", "")) for b in cls.bases]
            decorators = [getattr(d, "id", getattr(d, "attr", "")) for d in cls.decorator_list]
            assert "HttpRewardService" in bases, f"{path.name}: {cls.name} takes a base_url but is no HttpRewardService"
            assert "reward_class" in decorators, f"{path.name}: {cls.name} is not registered with @reward_class"


def test_the_trainer_is_glue():
    """GRPOTrainer orchestrates (transformers.Trainer glue); the rollout side lives in grpokit/pipeline/, setup with
    what it sets up (grpokit/training/policy.py, grpokit/rewards/setup.py, grpokit/pipeline/build.py, ...)."""
    path = PACKAGE / "trainer.py"
    lines = len(path.read_text().splitlines())
    tree = ast.parse(path.read_text())
    trainer = next(c for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "GRPOTrainer")
    methods = [n.name for n in trainer.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(methods) <= MAX_TRAINER_METHODS, f"GRPOTrainer has {len(methods)} methods: {methods}"
    assert lines <= MAX_TRAINER_LINES, f"grpokit/trainer.py has {lines} lines"


def _trainer_private_names() -> set[str]:
    """Every private name a GRPOTrainer has: its methods (transformers.Trainer's included) and its attributes."""
    from grpokit.trainer import GRPOTrainer

    names = {n for n in dir(GRPOTrainer) if n.startswith("_") and not n.startswith("__")}
    for node in ast.walk(ast.parse((PACKAGE / "trainer.py").read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            names.add(node.attr)
    return names


def test_nothing_outside_the_trainer_touches_its_private_members():
    """Code and tests use the trainer's public parts (``trainer.pipeline``, ``trainer.driver``, ...): an attribute
    access ``x._name`` anywhere but grpokit/trainer.py, where ``_name`` is private to GRPOTrainer, is a failure (an
    object's own ``self._name`` and ``super()._name`` are its business)."""
    private = _trainer_private_names()
    found = []
    files = [*(ROOT / "tests").rglob("*.py"), *(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "trainer.py")]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or node.attr not in private:
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
                continue
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not found, "reaching into GRPOTrainer's private members: " + ", ".join(found)


TRAINER_MODULES = {"grpokit.trainer", "grpokit.trainer_driver"}


def test_the_pipeline_imports_nothing_of_the_trainer():
    """grpokit/pipeline/ reaches the trainer only through its declared protocols (pipeline/driver.py)."""
    modules = _modules()
    offending = {name: sorted(_imports(name, path, modules) & TRAINER_MODULES)
                 for name, path in modules.items() if name.startswith("grpokit.pipeline")}
    assert not {k: v for k, v in offending.items() if v}, offending


def test_the_producer_reads_only_what_the_learner_declares():
    """Every member the asynchronous producer and the rollout workers' pool read off the learner (``learner.x``,
    ``self.learner.x``) is declared by :class:`grpokit.pipeline.driver.LearnerDriver` (or the :class:`RolloutDriver`
    it extends)."""
    from grpokit.pipeline.driver import LearnerDriver

    declared = {n for cls in LearnerDriver.__mro__ for n in vars(cls)} | {
        n for cls in LearnerDriver.__mro__ for n in getattr(cls, "__annotations__", {})}
    read = set()
    for node in (n for f in ("producer.py", "workers/pool.py") for n in ast.walk(ast.parse(
            (PACKAGE / "pipeline" / f).read_text()))):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "learner") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "learner"):
                read.add(node.attr)
    assert read, "the producer reads nothing of the learner: this test has lost what it checks"
    assert read <= declared, f"the producer reads undeclared members of the learner: {sorted(read - declared)}"
