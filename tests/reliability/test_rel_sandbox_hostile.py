"""Hostile completions against CodeExecution, one test each: a fork bomb, an infinite loop, a memory hog, a flood of
output, writing or deleting outside the sandbox, reading the trainer's environment, opening sockets, killing the
trainer, ``os._exit``. Each must score 0 with its failure counted, and leave the test process, the files outside and
the machine as they were, with no process of the run left behind.

Each hostile block stands before ``def f``: where the attack is stopped it raises (or the run is ended) and the test
``assert f(2) == 4`` never passes; an attack that went through would let ``f`` be defined and score 1. Checks that
need a protection this machine lacks (docs/rewards.md lists them per setting) are skipped with the reason."""

import json
import os
import secrets
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from grpokit.rewards import CodeExecution
from grpokit.rewards.sandbox import sweep_stale_workdirs

TESTS = ["assert f(2) == 4"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def completion(hostile: str) -> str:
    return f"```python\n{textwrap.dedent(hostile).strip()}\ndef f(x):\n    return 2 * x\n```"


@pytest.fixture
def reward():
    r = CodeExecution(timeout_s=2.0, memory_mb=128, max_output_bytes=4096, max_processes=16)
    yield r
    assert_no_leftovers(r)


def sandbox_processes(tag: str) -> list[int]:
    """Processes whose command line carries this reward's tag (every process of its runs, forks included)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                if f"grpokit-sandbox:{tag}".encode() in fh.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


def assert_no_leftovers(reward: CodeExecution) -> None:
    deadline = time.monotonic() + 15
    while (left := sandbox_processes(reward.tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the sandbox still running: {left}"
    assert subprocess.run(["true"]).returncode == 0  # the machine still starts processes


def score_of(reward: CodeExecution, hostile: str) -> float:
    (value,) = reward(completions=[completion(hostile)], tests=[TESTS])
    return value


def test_the_honest_version_scores_1(reward):
    assert score_of(reward, "pass") == 1.0 and reward.stats["failures"] == 0


@pytest.mark.parametrize("bomb,kind", [
    ("import os\nwhile True:\n    os.fork()", "error"),  # the process limit stops it: fork raises
    ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "timeout"),
])
def test_fork_bomb(reward, bomb, kind):
    if os.geteuid() == 0 and reward.isolation.uid_base is None:
        pytest.skip("root without a uid of its own: RLIMIT_NPROC does not apply, a fork bomb would fill the process "
                    "table until the time limit")
    assert score_of(reward, bomb) == 0.0
    assert reward.stats[kind] == 1 and reward.stats["failures"] == 1


def test_infinite_loop(reward):
    assert score_of(reward, "while True:\n    pass") == 0.0
    assert reward.stats["timeout"] == 1 and reward.stats["failures"] == 1


@pytest.mark.parametrize("hog", ["x = bytearray(10 ** 10)", "x = []\nwhile True:\n    x.append(bytearray(10 ** 6))"])
def test_memory_hog(reward, hog):
    assert score_of(reward, hog) == 0.0
    assert reward.stats["memory"] == 1 and reward.stats["failures"] == 1


def test_huge_output(reward):
    hostile = "import sys\nfor _ in range(10 ** 6):\n    sys.stdout.write('x' * 100000)\n    sys.stderr.write('y' * 1000)"
    assert score_of(reward, hostile) == 0.0
    assert reward.stats["output_limit"] == 1 and reward.stats["failures"] == 1
    result = reward.run(completion(hostile).split("\n", 1)[1].rsplit("```", 1)[0], TESTS)
    assert result.status == "output_limit" and len(result.stdout) + len(result.stderr) <= 4096


@pytest.mark.parametrize("fill", ["with open('big', 'wb') as fh:\n    for _ in range(200):\n        fh.write(b'x' * (1 << 20))",
                                  "for i in range(10 ** 6):\n    open(f'f{i}', 'w').close()"])
def test_filling_the_disk(reward, fill):
    """One file past file_mb (16 MiB), or files without end: the write fails (EFBIG; with a mount namespace the work
    directory is a tmpfs of bounded size and inode count)."""
    if not reward.isolation.mountns and "range" in fill:
        pytest.skip("without a mount namespace the number of files a run makes is bounded by its time only")
    assert score_of(reward, fill) == 0.0
    assert reward.stats["failures"] == 1 and reward.stats["error"] == 1


@pytest.fixture
def victims(tmp_path):
    """Files the sandbox must not touch: one in a private folder, one writable by anyone in a folder open to all."""
    private = tmp_path / "owned.txt"
    private.write_text("keep")
    shared_dir = tempfile.mkdtemp(prefix="grpokit-victim-", dir="/tmp")
    os.chmod(shared_dir, 0o777)
    shared = os.path.join(shared_dir, "open.txt")
    with open(shared, "w") as fh:
        fh.write("keep")
    os.chmod(shared, 0o666)
    yield {"private": str(private), "shared": shared, "shared_dir": shared_dir}
    for name in os.listdir(shared_dir):
        os.unlink(os.path.join(shared_dir, name))
    os.rmdir(shared_dir)


WRITES = {
    "overwrite a private file": "open({private!r}, 'w').write('pwned')",
    "delete a private file": "import os\nos.unlink({private!r})",
    "overwrite a file open to all": "open({shared!r}, 'w').write('pwned')",
    "delete a file open to all": "import os\nos.unlink({shared!r})",
    "create a file in a folder open to all": "open({shared_dir!r} + '/new.txt', 'w').write('x')",
    "create a file in /etc": "open('/etc/grpokit-sandbox-{token}', 'w').write('x')",
    "chmod a private file": "import os\nos.chmod({private!r}, 0o777)",
}


@pytest.mark.parametrize("attack", list(WRITES))
def test_writing_or_deleting_outside_the_sandbox(reward, victims, attack):
    iso = reward.isolation
    if "open to all" in attack and not iso.mountns:
        pytest.skip("without a mount namespace a file anyone may write is writable by the sandbox too")
    if iso.uid_base is None and not iso.mountns:
        pytest.skip("same uid as the trainer and no mount namespace: the sandbox may write what the trainer may")
    token = secrets.token_hex(4)
    before = {k: (Path(v).read_text(), stat.S_IMODE(os.stat(v).st_mode)) for k, v in victims.items() if k != "shared_dir"}
    assert score_of(reward, WRITES[attack].format(token=token, **victims)) == 0.0
    assert reward.stats["error"] == 1 and reward.stats["failures"] == 1
    after = {k: (Path(v).read_text(), stat.S_IMODE(os.stat(v).st_mode)) for k, v in victims.items() if k != "shared_dir"}
    assert after == before
    assert os.listdir(victims["shared_dir"]) == ["open.txt"]
    assert not os.path.exists(f"/etc/grpokit-sandbox-{token}")


TRAINER = """
import json, os, sys
from grpokit.rewards import CodeExecution
from grpokit.rewards.sandbox import sweep_stale_workdirs

reward = CodeExecution(timeout_s=5.0)
code = sys.stdin.read().replace("TRAINER_PID", str(os.getpid()))
scores = reward(completions=[code], tests=[["assert f(2) == 4"]])
result = reward.run(code.split("\\n", 1)[1].rsplit("```", 1)[0], ["assert f(2) == 4"])
print(json.dumps({"scores": scores, "stats": reward.stats, "output": result.stdout + result.stderr,
                  "status": result.status, "iso": reward.isolation.protections(), "pid": os.getpid()}))
"""


def run_trainer(hostile: str, secret: str | None = None) -> dict:
    """A trainer process of its own (so that an attack that went through kills it, not the test process), its
    environment holding ``secret``; returns what it reports."""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    if secret is not None:
        env["GRPOKIT_TRAINER_SECRET"] = secret
    proc = subprocess.run([sys.executable, "-c", TRAINER], input=completion(hostile), capture_output=True, text=True,
                          env=env, timeout=120, start_new_session=True)
    assert proc.returncode == 0, f"the trainer process ended with {proc.returncode}: {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


READ_ENVIRONMENT = """
import os
found = [k for k in os.environ if "SECRET" in k]
for pid in [p for p in os.listdir('/proc') if p.isdigit()] + [str(os.getppid()), 'self', '1']:
    for name in ('environ', 'cmdline', 'mem'):
        try:
            with open('/proc/' + pid + '/' + name, 'rb') as fh:
                if SECRET_BYTES in fh.read(1 << 20):
                    found.append(pid + '/' + name)
        except (OSError, ValueError):
            pass
print(found)
if not found:
    raise PermissionError('no environment of the trainer could be read')
"""


def test_reading_the_trainers_environment():
    iso = CodeExecution().isolation
    if iso.uid_base is None and not iso.pidns and os.geteuid() != 0:
        pytest.skip("same uid as the trainer and no pid namespace: /proc/<trainer>/environ is readable")
    secret = "s3cr3t-" + secrets.token_hex(8)
    hostile = READ_ENVIRONMENT.replace("SECRET_BYTES", repr(secret.encode()))
    report = run_trainer(hostile, secret)
    assert report["scores"] == [0.0] and report["stats"]["error"] == 1 and report["stats"]["failures"] == 1
    assert secret not in report["output"] and report["output"].strip() == "[]"


@pytest.mark.parametrize("target", ["os.getppid()", "TRAINER_PID", "-os.getpgid(TRAINER_PID)"])
def test_killing_the_trainer(target):
    """Signals to the parent (in a pid namespace: its init, which ignores them), to the trainer's pid and to its process
    group; the run then gives up (a kill that is ignored raises nothing)."""
    iso = CodeExecution().isolation
    if iso.uid_base is None and not iso.pidns:
        pytest.skip("same uid as the trainer and no pid namespace: the sandbox can signal the trainer")
    hostile = (f"import os, signal, time\nfor _ in range(3):\n    try:\n        os.kill({target}, signal.SIGKILL)\n"
               "    except OSError:\n        pass\n    time.sleep(0.05)\nraise RuntimeError('the trainer is still there')")
    report = run_trainer(hostile)  # the trainer survived: it reported
    assert report["scores"] == [0.0] and report["stats"]["error"] == 1 and report["stats"]["failures"] == 1


def test_opening_sockets(reward, tmp_path):
    if not reward.isolation.netns:
        pytest.skip("no network namespace here: the sandbox can reach the network")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    unix_dir = tempfile.mkdtemp(prefix="grpokit-sock-", dir="/tmp")
    os.chmod(unix_dir, 0o777)
    unix_path = os.path.join(unix_dir, "s")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    os.chmod(unix_path, 0o777)
    unix.listen()
    unix.settimeout(0.2)
    try:
        attacks = [f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
                   "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)",
                   "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))",
                   f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({unix_path!r})"]
        if not reward.isolation.mountns:
            attacks.pop()  # a Unix socket anyone may open is only out of sight with a private /tmp
        for attack in attacks:
            assert score_of(reward, attack) == 0.0, attack
        assert reward.stats["error"] == len(attacks)
        for server in (listener, unix):
            with pytest.raises(TimeoutError):
                server.accept()  # nothing reached the test's servers
    finally:
        listener.close()
        unix.close()
        os.unlink(unix_path)
        os.rmdir(unix_dir)


@pytest.mark.parametrize("attack", ["import os\nos.setuid(0)", "import os\nos.setgid(0)",
                                    "import ctypes\nassert ctypes.CDLL(None).unshare(0x40000000) == 0"])
def test_regaining_privileges(reward, attack):
    assert score_of(reward, attack) == 0.0
    assert reward.stats["failures"] == 1


def test_no_capability_is_left(reward):
    result = reward.run("status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
                        "print(status['CapEff'].strip(), status['CapPrm'].strip(), status['NoNewPrivs'].strip())",
                        ["pass"])
    assert result.status == "ok" and result.stdout.split() == ["0000000000000000", "0000000000000000", "1"]


@pytest.mark.parametrize("exit_call,kind", [("import os\nos._exit(0)", "crash"), ("import sys\nsys.exit(0)", "error")])
def test_exiting_early(reward, exit_call, kind):
    assert score_of(reward, exit_call) == 0.0
    assert reward.stats[kind] == 1 and reward.stats["failures"] == 1


def test_exiting_inside_a_test_keeps_only_what_passed_before(reward):
    (value,) = reward(completions=[completion("pass")], tests=[["assert f(2) == 4", "import os; os._exit(0)",
                                                                "assert f(3) == 6"]])
    assert value == pytest.approx(1 / 3) and reward.stats["crash"] == 1


ORPHAN = """
import sys
from grpokit.rewards import CodeExecution
from grpokit.rewards.sandbox import sweep_stale_workdirs

reward = CodeExecution(timeout_s=120)
print(reward.tag, reward.isolation.pidns, flush=True)
reward(completions=[sys.stdin.read()], tests=[["pass"]])
"""


def test_a_trainer_killed_mid_run_leaves_nothing_running():
    """The trainer gets SIGKILL while its sandbox runs code that forked, left the process group and sleeps."""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    proc.stdin.write(completion("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\n"
                                "time.sleep(1000)"))
    proc.stdin.close()
    tag, pidns = proc.stdout.readline().split()
    try:
        deadline = time.monotonic() + 60
        while len(sandbox_processes(tag)) < 2 and time.monotonic() < deadline:  # the run and its fork are up
            time.sleep(0.1)
        assert len(sandbox_processes(tag)) >= 2, "the sandboxed code did not start"
    finally:
        os.kill(proc.pid, 9)
        proc.wait(timeout=30)
        proc.stdout.close()
    try:
        if pidns != "True":
            pytest.skip("without a pid namespace a forked process that left the group may outlive the trainer")
        deadline = time.monotonic() + 15
        while sandbox_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sandbox_processes(tag) == []
    finally:
        for pid in sandbox_processes(tag):  # what a failure left behind
            os.kill(pid, 9)
        left = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(f"grpokit-sandbox-{proc.pid}-")]
        assert len(left) == 1, left  # the killed trainer could not remove its run's directory: the next one does
        swept = sweep_stale_workdirs()
        assert os.path.join(tempfile.gettempdir(), left[0]) in swept, swept
