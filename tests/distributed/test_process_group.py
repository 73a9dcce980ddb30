"""grpokit/bounds/process_group.py: a rank that ran a process group ends with its exit handlers run and its output
flushed, with the exit code it returned, and without the interpreter's teardown (where a gloo work thread releasing
a finished all-gather aborts the process); without a process group, a plain exit."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import atexit, sys
    import torch.distributed as dist
    from grpokit.bounds.process_group import distributed_initialized, exit_process

    marker = sys.argv[1]
    if sys.argv[2] == "group":
        dist.init_process_group("gloo", init_method="file://" + marker + ".store", rank=0, world_size=1)
    atexit.register(lambda: open(marker, "w").write("handlers ran"))


    class Teardown:  # a module global: deleted when the interpreter tears the module down
        def __del__(self, open=open, path=marker + ".teardown"):  # builtins may be gone by then
            open(path, "w").write("teardown ran")


    kept = Teardown()
    sys.stdout.write("unflushed line without a newline")  # still in the buffer when exit_process is called
    print("|initialized=" + str(distributed_initialized()), end="")
    exit_process(3)
    print("never reached")
""")


def run(tmp_path, mode):
    marker = tmp_path / f"marker-{mode}"
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(marker), mode], capture_output=True, text=True,
                       timeout=300)
    return r, marker


def test_with_a_process_group_handlers_run_output_is_flushed_and_the_code_kept(tmp_path):
    r, marker = run(tmp_path, "group")
    assert r.returncode == 3, r.stderr[-2000:]
    assert r.stdout == "unflushed line without a newline|initialized=True"
    assert marker.read_text() == "handlers ran"
    assert not (tmp_path / "marker-group.teardown").exists()  # the interpreter's teardown was skipped


def test_without_a_process_group_a_plain_exit(tmp_path):
    r, marker = run(tmp_path, "plain")
    assert r.returncode == 3, r.stderr[-2000:]
    assert r.stdout == "unflushed line without a newline|initialized=False"
    assert marker.read_text() == "handlers ran"
    assert (tmp_path / "marker-plain.teardown").exists()  # the probe sees a teardown where there is one
