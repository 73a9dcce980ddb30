"""``CodeExecution``: a reward function that runs the completion's code against the row's tests, each completion in
its own sandboxed process (:mod:`grpokit.rewards.sandbox`), several at a time.

>>> reward = CodeExecution(timeout_s=5)
>>> reward(completions=["```python\\ndef f(x):\\n    return 2 * x\\n```"], tests=[["assert f(2) == 4"]])  # doctest: +SKIP
[1.0]

* The code is the completion's last closed fenced block marked ``python`` (or ``py``, ``python3``); without one, the
  last closed unmarked block; without that, there is no code and the reward is 0.0 (counted in ``no_code``).
* The tests come from the row's ``tests`` column (``tests_column``): a list of Python statements, or one string with
  a statement per line (blank lines and ``#`` comments skipped), such as ``assert f(2) == 4``. They run one after
  another in the code's namespace, after the code; a row without tests gets ``None``.
* The reward is the share of tests passed (``score="fraction"``) or 1.0 only when all pass (``score="all"``). A run
  that ends early keeps the tests it passed before; one the sandbox could not start gets ``None``.
* Counted per call and over the instance's life (``stats``), and logged as ``rewards/<name>/<count>`` through the
  trainer's ``log_metric``: ``runs``, ``no_code``, ``failures`` (every run that did not end ``ok``) and, by how it
  ended, ``error``, ``memory``, ``timeout``, ``output_limit``, ``crash``, ``sandbox_error``; ``run_s``, the mean
  seconds of a run.

The sandbox protects the machine and the trainer, not the reward: code that runs in the tests' process can find ways
to pass them (an object whose ``__eq__`` is always true, reading the harness's state). Write tests that compare
plain values (``assert f(2) == 4`` compares whatever ``f`` returns with ``__eq__`` of that value; ``assert
type(f(2)) is int and f(2) == 4`` does not trust it).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import secrets
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..validation import Checker
from .builtin import completion_text
from .classes import reward_class
from .sandbox import STATUSES, Isolation, Limits, RunResult, detect_isolation, run_sandboxed
from .service import MetricLog, check_name

__all__ = ["CodeExecution", "extract_code", "split_tests"]

logger = logging.getLogger("grpokit")

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.DOTALL | re.MULTILINE)
PYTHON_TAGS = ("python", "py", "python3")
SCORES = ("fraction", "all")
MAX_WORKERS = 256
_warned: set[Isolation] = set()


def extract_code(text: str) -> str | None:
    """The last closed fenced block marked python/py/python3, else the last closed unmarked one; None if neither."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text or "")]
    for wanted in (lambda tag: tag in PYTHON_TAGS, lambda tag: tag == ""):
        found = [code for tag, code in blocks if wanted(tag)]
        if found:
            return found[-1]
    return None


def split_tests(value: Any) -> list[str] | None:
    """A row's tests as a list of statements; None when the row has none."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [line for line in value.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    elif isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value):
        value = [t for t in value if t.strip()]
    else:
        raise ValueError(f"a tests value must be a list of Python statements or a string of them, got "
                         f"{type(value).__name__}")
    return value or None


def _positive(check: Checker, name: str, integer: bool = True, optional: bool = False) -> None:
    value = check.value(name)
    if optional and value is None:
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        raise check.bad(name, f"expected a positive {'integer' if integer else 'number'}"
                        + (" or None" if optional else ""))


def _check_options(owner: str, options: dict[str, Any]) -> None:
    """:class:`CodeExecution`'s keyword arguments but ``name``, one error line for the first wrong one."""
    check = Checker(options, prefix=f"{owner}.", get=dict.get)
    check.choice("score", SCORES)
    tests_column = options["tests_column"]
    if not isinstance(tests_column, str) or not tests_column:
        raise check.bad("tests_column", "expected a column name")
    _positive(check, "timeout_s", integer=False)
    _positive(check, "cpu_s", integer=False, optional=True)
    for key in ("memory_mb", "file_mb", "max_processes", "max_open_files", "max_output_bytes"):
        _positive(check, key)
    _positive(check, "workers", optional=True)
    workers, python, workdir_root = options["workers"], options["python"], options["workdir_root"]
    if workers is not None and workers > MAX_WORKERS:
        raise check.bad("workers", f"at most {MAX_WORKERS}")
    if python is not None and (not isinstance(python, str) or not os.path.isfile(python)):
        raise check.bad("python", "expected the path of a Python interpreter")
    if workdir_root is not None and (not isinstance(workdir_root, str) or not os.path.isdir(workdir_root)):
        raise check.bad("workdir_root", "expected an existing directory")
    check.boolean("require_isolation")


@reward_class
class CodeExecution:
    """A reward function that runs each completion's code against its row's tests (see the module docstring).

    Args:
        name: the name metrics are logged under (``rewards/<name>/mean``, ``rewards/<name>/timeout``, ...).
        score: ``"fraction"`` (share of tests passed) or ``"all"`` (1.0 only when every test passes).
        tests_column: the dataset column holding the tests.
        timeout_s: wall-clock seconds per completion (code and tests together); past it the run is killed.
        cpu_s: CPU seconds per process (default ``timeout_s``).
        memory_mb: address space per process, MiB.
        file_mb: the largest file a run may write, MiB.
        max_processes: processes (and threads) a run may have at once.
        max_open_files: open file descriptors per process.
        max_output_bytes: stdout and stderr together; past it the run is killed.
        workers: runs at a time (default: the CPUs this process may use, divided among the ranks of this machine).
        python: the interpreter that runs the code (default: this one, or a system ``python3`` when the sandbox's
            uid cannot read this one).
        workdir_root: where the fresh work directories are made (default: the system's temporary directory).
        require_isolation: refuse to run (an error at the first call) unless the network is cut off and the
            trainer is out of reach (a uid of its own, or user and pid namespaces).
    """

    def __init__(self, *, name: str = "code_execution", score: str = "fraction", tests_column: str = "tests",
                 timeout_s: float = 10.0, cpu_s: float | None = None, memory_mb: int = 512, file_mb: int = 16,
                 max_processes: int = 32, max_open_files: int = 64, max_output_bytes: int = 65536,
                 workers: int | None = None, python: str | None = None, workdir_root: str | None = None,
                 require_isolation: bool = False):
        owner = "CodeExecution"
        if os.name != "posix":
            raise ValueError(f"{owner} needs a POSIX system (Linux for its namespaces); this is {sys.platform}")
        self.__name__ = check_name(owner, name)
        _check_options(owner, dict(
            score=score, tests_column=tests_column, timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb,
            file_mb=file_mb, max_processes=max_processes, max_open_files=max_open_files,
            max_output_bytes=max_output_bytes, workers=workers, python=python, workdir_root=workdir_root,
            require_isolation=require_isolation))
        self.score, self.tests_column = score, tests_column
        self.limits = Limits(timeout_s=float(timeout_s), cpu_s=cpu_s, memory_mb=memory_mb, file_mb=file_mb,
                             processes=max_processes, open_files=max_open_files, output_bytes=max_output_bytes)
        self.workers, self.python, self.workdir_root = workers, python, workdir_root
        self.require_isolation = require_isolation
        self.tag = secrets.token_hex(6)  # in every sandboxed process's command line
        self.metrics = MetricLog(self.__name__)

    def __repr__(self) -> str:
        return f"CodeExecution(name={self.__name__!r}, score={self.score!r}, timeout_s={self.limits.timeout_s:g})"

    @property
    def stats(self) -> dict[str, float]:
        """Counts over every call so far (see the module docstring)."""
        return dict(self.metrics.totals)

    @property
    def isolation(self) -> Isolation:
        """The isolation runs get here (found at the first use, then kept)."""
        iso = detect_isolation(self.python, self.workdir_root)
        if self.require_isolation and (not iso.netns or (iso.uid_base is None and not (iso.userns and iso.pidns))):
            raise RuntimeError(f"reward {self.__name__!r}: require_isolation is set and this machine's sandbox lacks: "
                               + "; ".join(iso.gaps()))
        if iso.gaps() and iso not in _warned:
            _warned.add(iso)
            logger.warning("CodeExecution: the sandbox here does not prevent %s (docs/rewards.md says what each "
                           "setting allows)", "; ".join(iso.gaps()))
        return iso

    def run(self, code: str, tests: Sequence[str]) -> RunResult:
        """Run ``code`` and then ``tests`` in a fresh sandbox; the full :class:`~grpokit.rewards.sandbox.RunResult`."""
        return run_sandboxed(code, list(tests), self.limits, self.isolation, self.tag, self.workdir_root)

    def _worker_count(self, n: int) -> int:
        if self.workers is not None:
            return min(self.workers, n)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        try:  # ranks of one machine score at the same moment: they share its cores
            ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            ranks_here = 1
        return max(1, min(cores // ranks_here, n, MAX_WORKERS))

    def _run_all(self, jobs: list[tuple[int, str, list[str]]]) -> dict[int, RunResult]:
        iso = self.isolation
        workers = self._worker_count(len(jobs))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="grpokit-sandbox") as pool:
            futures = {i: pool.submit(run_sandboxed, code, tests, self.limits, iso, self.tag, self.workdir_root)
                       for i, code, tests in jobs}
            return {i: f.result() for i, f in futures.items()}

    def __call__(self, prompts: Sequence | None = None, completions: Sequence | None = None,
                 completion_ids: Sequence | None = None, trainer_state: Any = None, *,
                 log_metric: Callable[[str, float], None] | None = None, **columns: Any) -> list[float | None]:
        completions = list(completions or [])
        n = len(completions)
        column = columns.get(self.tests_column)
        if column is None or len(column) != n:
            raise ValueError(f"reward {self.__name__!r} needs a dataset column {self.tests_column!r} with one value per "
                             f"completion (the tests: Python statements such as 'assert f(2) == 4')"
                             + ("" if column is None else f"; got {len(column)} values for {n} completions"))
        scores: list[float | None] = [None] * n
        counts = {"runs": 0, "no_code": 0, "failures": 0} | {s: 0 for s in STATUSES if s != "ok"}
        jobs = []
        for i, (completion, value) in enumerate(zip(completions, column)):
            tests = split_tests(value)
            if tests is None:
                continue
            code = extract_code(completion_text(completion))
            if code is None:
                scores[i] = 0.0
                counts["no_code"] += 1
            else:
                jobs.append((i, code, tests))
        results = self._run_all(jobs) if jobs else {}
        seconds = []
        for i, result in results.items():
            counts["runs"] += 1
            seconds.append(result.seconds)
            if result.status != "ok":
                counts[result.status] += 1
                counts["failures"] += 1
            if result.status == "sandbox_error":
                logger.warning("reward %r: the sandbox failed: %s", self.__name__, result.detail)
                continue
            if self.score == "all":
                scores[i] = 1.0 if result.passed == result.total and result.status == "ok" else 0.0
            else:
                scores[i] = result.passed / result.total
        if seconds:
            counts["run_s"] = sum(seconds) / len(seconds)
        self.metrics.record(counts, log_metric)
        return scores
