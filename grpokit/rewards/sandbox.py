"""Running untrusted Python in a sandboxed process: what isolation this machine allows (found once, at first use),
starting :mod:`grpokit.rewards.sandbox_child` under it, and watching it (wall time, output size), then ending it and
everything it started.

Isolation, strongest first (the first that works is used; ``Isolation.protections()`` says what holds):

* always: a new session and process group, a fresh work directory as the current directory, an environment with
  nothing of the trainer's (``PATH``, ``HOME``/``TMPDIR`` = the work directory, ``LANG``), ``python -I``, no inherited
  file descriptors, limits on CPU seconds, address space, file size, open files and processes (``RLIMIT_*``), no
  core files, stdout + stderr cut at a size (the run is ended past it), a wall-clock limit after which the whole
  process group is killed.
* as root: the run switches to a uid of its own (one per worker slot, unused by any account), so the process limit is
  enforced, the trainer's processes cannot be signalled nor their ``/proc/<pid>/environ`` read, and files are
  reachable only as any other user's are. The interpreter must be readable by that uid: the trainer's own, else a
  system ``python3``.
* not root: a user namespace (root inside, your uid outside), where the kernel allows unprivileged ones.
* Linux namespaces where the kernel allows them: network (no interface up: no network at all), pid (the run sees
  only its own processes, and when it ends every process it started ends with it), mount (every mount read-only; a
  fresh ``/proc``; fresh, small ``/tmp``, ``/var/tmp``, ``/run`` and ``/dev/shm``, so what others left there, files
  and Unix sockets, is out of sight; the work directory a fresh tmpfs of ``4 * file_mb`` MiB, gone with the run).
* every capability dropped and ``no_new_privs`` set (setuid programs cannot give privileges back).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("grpokit")

CHILD = str(Path(__file__).with_name("sandbox_child.py"))
SETUP_FAILED = 112
RESULT_BYTES = 1 << 20
STATUSES = ("ok", "error", "memory", "timeout", "output_limit", "crash", "sandbox_error")
"""How a run ended: the tests ran (``ok``); the code raised before the tests (``error``; ``memory`` for
MemoryError); the time was up (``timeout``: wall clock or CPU seconds); stdout + stderr passed the limit
(``output_limit``); the process ended without finishing (``crash``: ``os._exit``, a signal, a crash of the
interpreter); the sandbox could not be set up (``sandbox_error``)."""
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
CANARY = ("import json, math, re, collections, itertools, functools, heapq, bisect, string, fractions, random, typing\n"
          "def f(x):\n    return x + 1\n")


@dataclass(frozen=True)
class Limits:
    """Per-run limits (one completion's code and tests)."""

    timeout_s: float = 10.0
    cpu_s: float | None = None
    memory_mb: int = 512
    file_mb: int = 16
    processes: int = 32
    open_files: int = 64
    output_bytes: int = 64 * 1024
    tmpfs_mb: int = 16

    def for_child(self) -> dict:
        cpu = self.cpu_s if self.cpu_s is not None else self.timeout_s
        return {"cpu_s": max(1, int(cpu + 0.999)), "memory_bytes": self.memory_mb << 20, "file_bytes": self.file_mb << 20,
                "processes": self.processes, "open_files": self.open_files, "tmpfs_mb": self.tmpfs_mb,
                "workdir_mb": 4 * self.file_mb}


@dataclass(frozen=True)
class Isolation:
    """The isolation runs get on this machine (found by :func:`detect_isolation`)."""

    python: str
    uid_base: int | None = None
    userns: bool = False
    mountns: bool = False
    netns: bool = False
    pidns: bool = False

    def uid(self, slot: int) -> int | None:
        return None if self.uid_base is None else self.uid_base + slot

    def protections(self) -> list[str]:
        out = ["own session and process group, killed as a whole", "scrubbed environment", "resource limits"]
        if self.uid_base is not None:
            out.append(f"own uid per worker ({self.uid_base}+slot): process limit enforced, the trainer out of reach")
        if self.userns:
            out.append("user namespace")
        if self.netns:
            out.append("network namespace: no network")
        if self.pidns:
            out.append("pid namespace: only its own processes visible, all ended with the run")
        if self.mountns:
            out.append("mount namespace: read-only file system; private /proc, /tmp, /var/tmp, /run, /dev/shm and a "
                       "work directory of bounded size")
        return out

    def gaps(self) -> list[str]:
        """What this isolation does not prevent, in words (empty when every protection above holds)."""
        out = []
        if not self.netns:
            out.append("network access (no network namespace)")
        if self.uid_base is None and not (self.userns and self.pidns):
            out.append("signalling and reading the trainer's processes (same uid, no pid namespace)")
        if self.uid_base is None and not self.userns and os.geteuid() == 0:
            out.append("the process limit (root is exempt from RLIMIT_NPROC)")
        if not self.mountns:
            out.append("writing where the sandbox's uid may write (no read-only mount namespace)")
        return out


@dataclass
class RunResult:
    """How one run ended (``status``: one of :data:`STATUSES`), the tests passed, and the first bytes of output."""

    status: str
    passed: int = 0
    total: int = 0
    detail: str = ""
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    tests: dict[int, str] = field(default_factory=dict)


class SlotPool:
    """Worker slots, unique in this process at any moment (each slot is a uid of its own): the lowest free one is
    handed out, waiting while all are taken."""

    def __init__(self, size: int = 256):
        self._free = list(range(size))
        self._cond = threading.Condition()

    def acquire(self) -> int:
        with self._cond:
            while not self._free:
                self._cond.wait()
            return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        with self._cond:
            heapq.heappush(self._free, slot)
            self._cond.notify()


SLOTS = SlotPool()
"""Every run of this process takes its slot here, whichever reward or thread starts it."""


def _slot_uid_base() -> int:
    """Unused uids for this trainer process's sandboxes: 256 per process id, far above any account's."""
    return 2_000_000_000 + (os.getpid() % 4_194_304) * 256


def _pythons(python: str | None) -> list[str]:
    if python is not None:
        return [python]
    found = [sys.executable]
    for candidate in (shutil.which("python3", path=SAFE_PATH), "/usr/bin/python3", "/usr/local/bin/python3"):
        if candidate and os.path.isfile(candidate) and os.path.realpath(candidate) not in map(os.path.realpath, found):
            found.append(candidate)
    return found


def _candidates(python: str | None) -> list[Isolation]:
    """Isolations to try, strongest first."""
    ladders = [dict(mountns=True, netns=True, pidns=True), dict(netns=True, pidns=True), dict(netns=True),
               dict(pidns=True), {}]
    if sys.platform != "linux":
        ladders = [{}]
    out: list[Isolation] = []
    if os.geteuid() == 0:
        for uid in (_slot_uid_base(), 65534 - 256):  # the second for user namespaces that map only 0-65535
            for exe in _pythons(python):
                out += [Isolation(exe, uid, **ns) for ns in ladders]
        out += [Isolation(_pythons(python)[0], None, **ns) for ns in ladders]
    else:
        exe = _pythons(python)[0]
        if sys.platform == "linux":
            out += [Isolation(exe, None, userns=True, **ns) for ns in ladders[:-1]]
        out.append(Isolation(exe, None))
    return out


_detected: dict[tuple, Isolation] = {}
_detect_lock = threading.Lock()


def detect_isolation(python: str | None = None, workdir_root: str | None = None) -> Isolation:
    """The strongest isolation under which a canary program runs here (found once per interpreter and folder)."""
    key = (python, workdir_root, os.geteuid(), _slot_uid_base())
    with _detect_lock:
        if key not in _detected:
            sweep_stale_workdirs(workdir_root)
            tried = []
            for iso in _candidates(python):
                result = run_sandboxed(CANARY, ["assert f(1) == 2"], Limits(timeout_s=20.0), iso, "probe", workdir_root)
                if result.status == "ok" and result.passed == 1:
                    _detected[key] = iso
                    break
                tried.append(f"{iso}: {result.status} {result.detail or result.stderr[-200:]}")
            else:
                raise RuntimeError("no sandbox could run Python here; tried: " + " | ".join(tried[-3:]))
        return _detected[key]


def _environment(workdir: str) -> dict[str, str]:
    return {"PATH": SAFE_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


WORKDIR_PREFIX = "grpokit-sandbox-"


def _make_workdir(root: str | None, uid: int | None) -> str:
    """A fresh directory named after this process (``grpokit-sandbox-<pid>-...``), so that one a killed trainer left
    is recognised and removed later (:func:`sweep_stale_workdirs`)."""
    workdir = os.path.realpath(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-", dir=root))
    if uid is not None:
        os.chown(workdir, uid, uid)
    os.chmod(workdir, 0o700)
    return workdir


def sweep_stale_workdirs(root: str | None = None) -> list[str]:
    """Remove the work directories of trainer processes that no longer run (killed mid-run, their cleanup never
    ran); returns them."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        pid = name[len(WORKDIR_PREFIX):].split("-", 1)[0]
        if not name.startswith(WORKDIR_PREFIX) or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # that process still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # someone else's live process
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            _remove_tree(path)
            removed.append(path)
    return removed


def _remove_tree(path: str) -> None:
    def retry(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_uid(iso: Isolation, uid: int) -> None:
    """Every process of ``uid`` ended (runs without a pid namespace: a process that left the group is found too)."""
    kill = shutil.which("kill", path=SAFE_PATH)
    command = [kill, "-s", "KILL", "--", "-1"] if kill else [
        iso.python, "-I", "-S", "-c", "import os, signal\ntry:\n os.kill(-1, signal.SIGKILL)\nexcept OSError:\n pass"]
    try:
        subprocess.run(command, user=uid, group=uid, extra_groups=[], env={"PATH": SAFE_PATH}, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10, cwd="/")
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("could not end the processes of sandbox uid %d: %s", uid, e)


@dataclass
class _Watch:
    """What a run's supervision collected."""

    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    results: bytearray = field(default_factory=bytearray)
    output_total: int = 0
    killed: str | None = None


def _watch(proc: subprocess.Popen, results_fd: int, payload: bytes, limits: Limits) -> _Watch:
    """Feed stdin, read stdout/stderr/results until all close, the wall time is up, or the output is too large;
    the process group is killed in the last two cases."""
    w = _Watch()
    deadline = time.monotonic() + limits.timeout_s
    sel = selectors.DefaultSelector()
    sinks = {proc.stdout.fileno(): w.out, proc.stderr.fileno(): w.err, results_fd: w.results}
    for fd in sinks:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    stdin = proc.stdin.fileno()
    os.set_blocking(stdin, False)
    sel.register(stdin, selectors.EVENT_WRITE)
    view = memoryview(payload)
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                w.killed = "timeout"
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                fd = key.fd
                if fd == stdin:
                    try:
                        view = view[os.write(fd, view[:65536]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # it ended before reading its job: the status says how
                        view = view[:0]
                    if not view:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                sink = sinks[fd]
                if fd == results_fd:
                    sink += chunk[:max(0, RESULT_BYTES - len(sink))]
                    continue
                w.output_total += len(chunk)
                sink += chunk[:max(0, limits.output_bytes - len(w.out) - len(w.err))]
                if w.output_total > limits.output_bytes:
                    w.killed = "output_limit"
                    break
            if w.killed:
                break
    finally:
        sel.close()
    return w


def _parse(token: str, raw: bytes, n_tests: int) -> tuple[dict[int, str], dict[str, str]]:
    tests: dict[int, str] = {}
    events: dict[str, str] = {}
    prefix = token + " "
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line.startswith(prefix):
            continue
        parts = line[len(prefix):].split(" ", 3)
        if parts[0] == "test" and len(parts) >= 3 and parts[1].isdigit() and int(parts[1]) < n_tests:
            tests.setdefault(int(parts[1]), parts[2] if parts[2] == "pass" else " ".join(parts[2:]))
        elif parts[0] in ("ready", "done"):
            events[parts[0]] = ""
        elif parts[0] == "code":
            events.setdefault("code", " ".join(parts[2:]))
        elif parts[0] == "sandbox":
            events.setdefault("sandbox", line[len(prefix) + len("sandbox "):])
    return tests, events


def _status(watch: _Watch, events: dict[str, str], returncode: int | None) -> tuple[str, str]:
    if "sandbox" in events:
        return "sandbox_error", events["sandbox"]
    if watch.killed:
        return watch.killed, ""
    if "code" in events:
        return ("memory" if events["code"] == "MemoryError" else "error"), events["code"]
    if "done" in events:
        return "ok", ""
    if "ready" not in events:
        return "sandbox_error", f"the sandbox did not start (exit status {returncode})"
    sig = None
    if returncode is not None and returncode < 0:
        sig = -returncode
    elif returncode is not None and returncode > 128:  # relayed by the pid namespace's init as 128 + signal
        sig = returncode - 128
    if sig == signal.SIGXCPU:
        return "timeout", "CPU time limit"
    try:
        how = f"signal {signal.Signals(sig).name}"
    except ValueError:
        how = f"exit status {returncode}"
    return "crash", f"ended before the tests finished ({how})"


def run_sandboxed(code: str, tests: list[str], limits: Limits, iso: Isolation, tag: str,
                  workdir_root: str | None = None) -> RunResult:
    """Run ``code`` then each test in a fresh sandbox (see the module docstring), in a worker slot of its own while it
    runs; never raises for what the code does."""
    slot = SLOTS.acquire()
    try:
        return _run_in_slot(code, tests, limits, iso, slot, tag, workdir_root)
    finally:
        SLOTS.release(slot)


def _run_in_slot(code: str, tests: list[str], limits: Limits, iso: Isolation, slot: int, tag: str,
                 workdir_root: str | None) -> RunResult:
    start = time.monotonic()
    uid = iso.uid(slot)
    token = secrets.token_hex(16)
    workdir = _make_workdir(workdir_root, uid)
    job = {"isolation": {**dataclasses.asdict(iso), "uid": uid, "gid": uid}, "limits": limits.for_child(),
           "workdir": workdir, "token": token, "code": code, "tests": list(tests)}
    read_fd, write_fd = os.pipe()
    payload = json.dumps({**job, "result_fd": write_fd, "parent_pid": os.getpid()}).encode()
    proc = None
    try:
        try:
            proc = subprocess.Popen([iso.python, "-I", CHILD, f"grpokit-sandbox:{tag}:{slot}"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(write_fd,),
                                    start_new_session=True, env=_environment(workdir), cwd=workdir)
        except OSError as e:
            return RunResult("sandbox_error", total=len(tests), detail=f"could not start {iso.python}: {e}")
        finally:
            os.close(write_fd)
        watch = _watch(proc, read_fd, payload, limits)
        _kill_group(proc.pid)  # the leader is not reaped yet: its group id cannot have been reused
        if uid is not None and not iso.pidns:
            _kill_uid(iso, uid)
        try:
            returncode = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            returncode = None
        tests_seen, events = _parse(token, bytes(watch.results), len(tests))
        status, detail = _status(watch, events, returncode)
        return RunResult(status, sum(1 for v in tests_seen.values() if v == "pass"), len(tests), detail,
                         watch.out.decode("utf-8", "replace"), watch.err.decode("utf-8", "replace"),
                         time.monotonic() - start, tests_seen)
    finally:
        os.close(read_fd)
        if proc is not None:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None and not stream.closed:
                    stream.close()
        _remove_tree(workdir)
