"""The process that runs one completion's code and tests (``python -I sandbox_child.py TAG``), started by
:mod:`grpokit.rewards.sandbox` in a new session with a scrubbed environment. Standard library only (it may run on
another interpreter than the trainer's) and no grpokit import.

It reads one JSON object from stdin (the isolation to set up, the limits, the code, the tests and a per-run token),
then: enters the namespaces asked for (user, mount, network, pid), makes every mount read-only, mounts a fresh /proc,
private /tmp, /var/tmp, /run and /dev/shm and a fresh work directory, sets the resource limits, drops to
the sandbox uid and every capability, forbids gaining privileges again, and runs the code and then each test in one
namespace. Results go to the file descriptor the job names (a pipe to the parent), one line each, prefixed with the
token: ``ready``, ``test I pass`` / ``test I fail KIND``, ``code error KIND``, ``done``. A setup step that fails
writes ``sandbox STEP: ERROR`` and exits with status 112, so a sandbox is never silently weaker than the one asked
for.
"""

import builtins
import ctypes
import json
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 1, 24, 38, 47, 4
SETUP_FAILED = 112

_libc = None


class SetupError(Exception):
    pass


def libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def check(result, step):
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{step}: {os.strerror(err)} (errno {err})")


def mount(source, target, fstype, flags, data, step):
    enc = (lambda s: None if s is None else s.encode())
    check(libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), step)


def write_file(path, text):
    with open(path, "w") as fh:
        fh.write(text)


def enter_namespaces(iso):
    flags = 0
    if iso.get("userns"):
        flags |= CLONE_NEWUSER
    if iso.get("mountns"):
        flags |= CLONE_NEWNS
    if iso.get("netns"):
        flags |= CLONE_NEWNET
    if iso.get("pidns"):
        flags |= CLONE_NEWPID
    if not flags:
        return
    uid, gid = os.getuid(), os.getgid()
    check(libc().unshare(ctypes.c_int(flags)), "unshare")
    if iso.get("userns"):  # root inside, our own uid outside; every capability dropped after the setup
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", f"0 {uid} 1")
        write_file("/proc/self/gid_map", f"0 {gid} 1")


def mount_points():
    """(mount point, per-mount options) of every mount, from /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            parts = line.split()
            point = parts[4].encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "replace")
            out.append((point, parts[5].split(",")))
    return out


PRIVATE_DIRS = ("/tmp", "/var/tmp", "/run", "/dev/shm")
"""Replaced by fresh, small, private tmpfs mounts: what other users and programs leave there (files, Unix sockets) is
out of sight."""
TMPFS_INODES = 16384


def private_file_system(workdir, tmpfs_mb, workdir_mb, owner):
    """Every mount read-only; :data:`PRIVATE_DIRS` fresh tmpfs mounts; the work directory a fresh tmpfs of its own
    (``workdir_mb``, owned by ``owner``): what a run writes is bounded and gone with it."""
    mount(None, "/", None, MS_REC | MS_PRIVATE, None, "making mounts private")
    for point, options in mount_points():
        if point == "/proc" or point.startswith("/proc/") or "ro" in options:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for name in options:
            flags |= MOUNT_FLAGS.get(name, 0)
        mount(None, point, None, flags, None, f"remounting {point} read-only")
    for path in PRIVATE_DIRS:
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmpfs_mb}m,nr_inodes={TMPFS_INODES},mode=1777",
              f"mounting {path}")
    os.makedirs(workdir, exist_ok=True)  # inside a fresh /tmp when it lies below one
    mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={workdir_mb}m,nr_inodes={TMPFS_INODES},mode=0700,uid={owner},gid={owner}", "mounting the work directory")


def drop_privileges(iso):
    """The sandbox uid (as root), no capability left, no way to gain one (setuid binaries included; the capability
    and no_new_privs parts on Linux only)."""
    linux = sys.platform == "linux"
    prctl = libc().prctl if linux else None
    if linux:
        prctl(ctypes.c_int(PR_CAP_AMBIENT), ctypes.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL), ctypes.c_ulong(0),
              ctypes.c_ulong(0), ctypes.c_ulong(0))
    if linux and os.geteuid() == 0:
        for cap in range(64):
            prctl(ctypes.c_int(PR_CAPBSET_DROP), ctypes.c_ulong(cap), ctypes.c_ulong(0), ctypes.c_ulong(0),
                  ctypes.c_ulong(0))
    if iso.get("uid") is not None:
        os.setgroups([])
        os.setgid(iso["gid"])
        os.setuid(iso["uid"])
        if os.getuid() != iso["uid"] or os.geteuid() != iso["uid"]:
            raise SetupError("setuid: the uid did not change")
    if not linux:
        return
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: all empty
    check(libc().capset(header, data), "dropping capabilities")
    check(prctl(ctypes.c_int(PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
                ctypes.c_ulong(0)), "no_new_privs")


def set_limits(limits):
    """Resource limits of the process that runs the code (and of everything it starts)."""
    cpu = int(limits["cpu_s"])
    pairs = [(resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_CORE, (0, 0)),
             (resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2), (resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)]
    if hasattr(resource, "RLIMIT_NPROC"):
        pairs.append((resource.RLIMIT_NPROC, (limits["processes"],) * 2))
    if hasattr(resource, "RLIMIT_AS"):
        pairs.append((resource.RLIMIT_AS, (limits["memory_bytes"],) * 2))
    for which, value in pairs:
        try:
            resource.setrlimit(which, value)
        except (ValueError, OSError) as e:
            raise SetupError(f"setrlimit {which}: {e}") from None


def wait_status(pid):
    """Exit code of child ``pid``: its own, or 128 + the signal that ended it."""
    while True:
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return 128 + 9
        except InterruptedError:
            continue
        if os.WIFSIGNALED(status):
            return 128 + os.WTERMSIG(status)
        return os.WEXITSTATUS(status)


def run_harness(token, code, tests, result_fd):
    """The code, then each test, in one namespace; a line per result on ``result_fd`` from this process only (a fork
    of the code that returns here stays silent)."""
    me = os.getpid()

    def report(*parts):
        if os.getpid() == me:
            os.write(result_fd, (" ".join([token, *map(str, parts)]) + "\n").encode())

    def finish():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001, S110 - a closed or replaced stream: nothing to flush
                pass
        os._exit(0)

    namespace = {"__name__": "__main__", "__builtins__": builtins}
    report("ready")
    try:
        exec(compile(code, "<completion>", "exec"), namespace)
    except BaseException as e:  # noqa: BLE001 - whatever the code raises, SystemExit included, is its failure
        report("code", "error", type(e).__name__)
        finish()
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {i}>", "exec"), namespace)
        except BaseException as e:  # noqa: BLE001
            report("test", i, "fail", type(e).__name__)
        else:
            report("test", i, "pass")
    report("done")
    finish()


def die_with_parent(parent):
    """SIGKILL when the parent ends (a trainer killed mid-run leaves nothing running); the setting does not survive a
    change of uid, so it is made again after one. ``parent``: the pid the parent must still have (None: not
    visible from here)."""
    if sys.platform != "linux":
        return
    libc().prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(9), ctypes.c_ulong(0), ctypes.c_ulong(0),
                 ctypes.c_ulong(0))
    if parent is not None and os.getppid() != parent:
        os._exit(SETUP_FAILED)  # the parent ended before the setting was made


def setup(job):
    iso = job["isolation"]
    workdir = job["workdir"]
    os.chdir(workdir)
    enter_namespaces(iso)
    if iso.get("pidns"):  # the first child is the namespace's init: it waits for the harness, then all ends
        pid = os.fork()
        if pid:
            os._exit(wait_status(pid))
    if iso.get("mountns"):
        owner = iso["uid"] if iso.get("uid") is not None else os.getuid()
        private_file_system(workdir, job["limits"]["tmpfs_mb"], job["limits"]["workdir_mb"], owner)
        if iso.get("pidns"):
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None, "mounting /proc")
        os.chdir(workdir)  # into the bind mount: the one writable place
    drop_privileges(iso)
    die_with_parent(None if iso.get("pidns") else job["parent_pid"])


def main():
    job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    die_with_parent(job["parent_pid"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        setup(job)
    except (SetupError, OSError) as e:
        os.write(job["result_fd"], f"{job['token']} sandbox {e}\n".encode())
        os._exit(SETUP_FAILED)
    if job["isolation"].get("pidns"):
        pid = os.fork()
        if pid:
            os._exit(wait_status(pid))
    try:
        set_limits(job["limits"])
    except SetupError as e:
        os.write(job["result_fd"], f"{job['token']} sandbox {e}\n".encode())
        os._exit(SETUP_FAILED)
    run_harness(job["token"], job["code"], job["tests"], job["result_fd"])


if __name__ == "__main__":
    main()
