"""What each sandbox isolation stops: the hostile snippets of tests/reliability/test_rel_sandbox_hostile.py run under
an isolation forced by name, one line per attack (docs/rewards.md's table was made with it).

    GRPOKIT_MATRIX_SECRET=s3cret python benchmarks/sandbox_isolation_matrix.py full
    python benchmarks/sandbox_isolation_matrix.py uid-only      # and: uid+net+pid, ns-no-uid, nothing (as root)
    su nobody -s /bin/sh -c "/usr/bin/python3 benchmarks/sandbox_isolation_matrix.py userns"   # not root

"stopped" is what the reward sees: the attack raised or the run was ended, so ``assert f(2) == 4`` never passed.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpokit.rewards.sandbox import Isolation, Limits, _slot_uid_base, run_sandboxed  # noqa: E402


def isolations() -> dict[str, Isolation]:
    system = "/usr/bin/python3"
    uid = _slot_uid_base() if os.geteuid() == 0 else None
    return {
        "full": Isolation(system, uid, mountns=True, netns=True, pidns=True),
        "uid-only": Isolation(system, uid),
        "uid+net+pid": Isolation(system, uid, netns=True, pidns=True),
        "ns-no-uid": Isolation(sys.executable, None, mountns=True, netns=True, pidns=True),
        "nothing": Isolation(sys.executable, None),
        "userns": Isolation(sys.executable, None, userns=True, mountns=True, netns=True, pidns=True),
    }


def attacks(port: int, private: str, shared: str, shared_dir: str, secret: bytes) -> dict[str, str]:
    read_env = ("import os\nhits = []\nfor p in [p for p in os.listdir('/proc') if p.isdigit()]:\n    try:\n"
                "        data = open('/proc/' + p + '/environ', 'rb').read()\n    except OSError:\n        continue\n"
                f"    if {secret!r} in data:\n        hits.append(p)\nif not hits:\n    raise PermissionError()")
    return {
        "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "infinite loop": "while True:\n    pass",
        "memory hog": "x = bytearray(10 ** 10)",
        "huge output": "import sys\nwhile True:\n    sys.stdout.write('x' * 100000)",
        "big file": "with open('big', 'wb') as fh:\n    for _ in range(200):\n        fh.write(b'x' * (1 << 20))",
        "endless files": "for i in range(10 ** 6):\n    open(f'f{i}', 'w').close()",
        "write a private file": f"open({private!r}, 'w').write('pwned')",
        "write a file open to all": f"open({shared!r}, 'w').write('pwned')",
        "create in a folder open to all": f"open({shared_dir!r} + '/new', 'w').write('x')",
        "read the trainer's environment": read_env,
        "tcp to 127.0.0.1": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
        "os._exit": "import os\nos._exit(0)",
        "signal the trainer": f"import os\nos.kill({os.getpid()}, 0)",
    }


def main(mode: str) -> None:
    iso = isolations()[mode]
    limits = Limits(timeout_s=2.0, memory_mb=128, output_bytes=4096, processes=16)
    secret = os.environ.get("GRPOKIT_MATRIX_SECRET", "no-secret-given").encode()
    server = socket.create_server(("127.0.0.1", 0))
    shared_dir = tempfile.mkdtemp(prefix="grpokit-victim-", dir="/tmp")
    try:
        os.chmod(shared_dir, 0o777)
        shared, private = os.path.join(shared_dir, "open.txt"), os.path.join(shared_dir, "private.txt")
        for path, mode_bits in ((shared, 0o666), (private, 0o644)):
            with open(path, "w") as fh:
                fh.write("keep")
            os.chmod(path, mode_bits)
        for name, code in attacks(server.getsockname()[1], private, shared, shared_dir, secret).items():
            r = run_sandboxed(code + "\ndef f(x):\n    return 2 * x\n", ["assert f(2) == 4"], limits, iso, "matrix")
            verdict = "stopped" if r.passed == 0 else "NOT STOPPED"
            print(f"{mode:12s} {name:32s} {verdict:12s} {r.status:13s} {r.detail[:50]}")
        intact = all(open(p).read() == "keep" for p in (private, shared))
        print(f"{mode:12s} files outside intact: {intact}; folder open to all holds {sorted(os.listdir(shared_dir))}")
    finally:
        server.close()
        shutil.rmtree(shared_dir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "full")
