"""Launching ddp_worker.py: under torchrun (real processes, gloo) or as one plain process, bounded in time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from hang import HANG_S  # noqa: E402

WORKER = HERE / "ddp_worker.py"
TIMEOUT = HANG_S  # a hang guard only (tests/hang.py)
LOSSES = ["dapo", "grpo", "vespo"]  # the losses every multi-process comparison covers


EXAMPLES = HERE.parents[1] / "examples" / "accelerate"


def accelerate_env(config: str) -> dict[str, str]:
    """The environment ``accelerate launch --config_file examples/accelerate/<config>.yaml`` gives its processes
    (what accelerate's plugins read), with mixed precision off for the CPU."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(EXAMPLES / f"{config}.yaml"), "unused.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    keep = {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}
    keep["ACCELERATE_MIXED_PRECISION"] = "no"
    return keep


def torchrun(out: Path, *args: str, nproc: int = 2, timeout: int = TIMEOUT, env: dict | None = None,
             worker: Path = WORKER) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(worker), str(out), *args]
    # own process group, so a timeout kills the workers too, not only the launcher
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"torchrun did not finish in {timeout} s (a hang guard, far above a normal run):\n"
                             f"{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun_ok(out: Path, *args: str, **kw) -> None:
    out.mkdir(parents=True, exist_ok=True)
    r = torchrun(out, *args, **kw)
    assert r.returncode == 0, r.stderr[-4000:]


def several(runs: list[tuple[Path, list[str]]]) -> list[str]:
    """The worker's arguments for several runs made one after another in the same processes (``++`` between
    them), each ``(OUT, [PER_DEVICE, GA, LOSSES, flags...])``; every OUT is created."""
    args: list[str] = []
    for out, run_args in runs:
        out.mkdir(parents=True, exist_ok=True)
        args += (["++"] if args else []) + [str(out), *run_args]
    return args


def torchrun_several(runs: list[tuple[Path, list[str]]], **kw) -> None:
    args = several(runs)
    torchrun_ok(Path(args[0]), *args[1:], **kw)


def single(out: Path, per_device: int, ga: int, losses: list[str], num_generations: int = 4, *flags: str) -> None:
    single_several([(out, [str(per_device), str(ga), ",".join(losses), "--num-generations", str(num_generations),
                           *flags])])


def single_several(runs: list[tuple[Path, list[str]]]) -> None:
    """One plain process (one rank) making each run of :func:`several` in turn."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, str(WORKER), *several(runs)], env=env, capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]


def load(path: Path) -> dict:
    return torch.load(path, weights_only=False)
