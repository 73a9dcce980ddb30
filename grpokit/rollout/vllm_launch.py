"""Starting vLLM's OpenAI server the way grpokit's server client needs it (``grpokit vllm-serve``), and stopping it.

:func:`server_command` is the command line and environment (docs/vllm.md): vLLM's own entry point
(``python -m vllm.entrypoints.openai.api_server``) with grpokit's worker extension, the sampler's own log-probs
(``processed_logprobs``), dev mode (``/collective_rpc``) and, for adapter sync, runtime LoRA loading.
:func:`running_server` starts it in a process group of its own, waits until it answers (a bound, and the server's
own exit, end the wait with one line) and stops the whole group on every way out of the ``with`` block.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .fp8_kernel import check_fp8_serving
from .vllm_server import WORKER_EXTENSION


@dataclass
class ServeOptions:
    """What ``grpokit vllm-serve`` passes to vLLM (its other flags go through ``extra`` unchanged)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    max_model_len: int | None = 1024
    memory_fraction: float | None = None
    """vLLM's ``--gpu-memory-utilization``: on a CPU the share of the machine's memory the engine reserves (its
    default, 0.92, fails where other processes hold memory); None: vLLM's default."""
    enable_lora: bool = False
    max_lora_rank: int = 16
    python: str = sys.executable
    """The interpreter that has vLLM (a virtual environment of its own, where vLLM pins another transformers)."""
    extra: list[str] = field(default_factory=list)
    rollout_precision: str = "auto"
    """The trainer's ``rollout_precision``: the engine's dtype (over :attr:`dtype`) and, for ``"int8"``, its 8-bit
    weights (:data:`grpokit.rollout.precision.VLLM_ENGINE_ARGS`)."""


def model_directory(model: str) -> str:
    """A built-in name (``smollm2-135m-instruct``) → its float32 safetensors directory (converted once); anything else
    as given (vLLM reads directories and hub ids)."""
    from ..models import BUILTIN_MODELS, ensure_builtin_cache

    if model.lower() in BUILTIN_MODELS:
        return str(ensure_builtin_cache(model.lower()))
    return model


def server_command(opts: ServeOptions) -> tuple[list[str], dict[str, str]]:
    """The server's argv and environment."""
    from .precision import VLLM_ENGINE_ARGS

    engine = VLLM_ENGINE_ARGS[opts.rollout_precision]
    argv = [opts.python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_directory(opts.model),
            "--host", opts.host, "--port", str(opts.port), "--dtype", engine.get("dtype", opts.dtype),
            "--worker-extension-cls", WORKER_EXTENSION, "--logprobs-mode", "processed_logprobs"]
    if "quantization" in engine:
        argv += ["--quantization", engine["quantization"]]
    if opts.max_model_len:
        argv += ["--max-model-len", str(opts.max_model_len)]
    if opts.memory_fraction:
        argv += ["--gpu-memory-utilization", str(opts.memory_fraction)]
    if opts.enable_lora:
        argv += ["--enable-lora", "--max-lora-rank", str(opts.max_lora_rank), "--max-loras", "2"]
    argv += list(opts.extra)
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    # vLLM's CPU build reserves --gpu-memory-utilization (0.92) of the machine's memory unless told a KV-cache size:
    # 1 GiB holds the contexts RL on a CPU samples (GPU builds ignore it)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    root = str(Path(__file__).resolve().parents[2])  # the worker extension is imported from here
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return argv, env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2.0) as r:
            return r.status == 200
    except OSError:
        return False


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to the server's process group (vLLM's engine core and workers are its children), SIGKILL after
    ``grace_s``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def shared_memory_of_group(pgid: int) -> set[Path]:
    """The POSIX shared-memory segments (``/dev/shm/psm_*``, Python's ``multiprocessing.shared_memory``: vLLM's
    message queues between its server, engine core and workers) that processes of group ``pgid`` have mapped; empty
    where ``/proc`` cannot be read."""
    found: set[Path] = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:  # the field after the state: the process group
                continue
            for line in (proc / "maps").read_text().splitlines():
                parts = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
                path = parts[5] if len(parts) == 6 else ""
                if path.startswith("/dev/shm/psm_"):
                    found.add(Path(path.removesuffix(" (deleted)")))
        except (OSError, ValueError, IndexError):
            continue
    return found


def remove_left_behind(segments: set[Path]) -> None:
    """Unlink those of ``segments`` still there once their processes are gone: a vLLM server that was killed (it
    unlinks its own on a normal stop) leaves several hundred MB in ``/dev/shm`` otherwise."""
    for path in segments:
        try:
            path.unlink()
        except OSError:
            pass


def _stop_with_the_parent() -> None:
    """In the server's process, before vLLM starts: the kernel sends it SIGTERM when the thread that started it
    ends (Linux), so even a SIGKILL of the trainer leaves no server behind (vLLM's server stops its engine on
    SIGTERM); elsewhere, nothing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _root_cause(log: Path) -> str:
    """The line of a failed server's log that says why: its last error other than vLLM's "see root cause above"."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error:" in line and "initialization failed" not in line]
    text = (errors or lines or [""])[-1]
    return text.split("] ", 1)[-1][:400]


@dataclass
class RunningServer:
    url: str
    process: subprocess.Popen


@contextmanager
def running_server(opts: ServeOptions, *, start_timeout_s: float = 600.0, log: Path | None = None,
                   show_output: bool = False) -> Iterator[RunningServer]:
    """Start the server, wait until it answers, yield it; stop it (and everything it started) on the way out, an
    exception included, and remove the shared memory it leaves behind if it was killed; a signal that ends this
    process ends the server too (``PR_SET_PDEATHSIG``). ``log``: a file for its output; ``show_output``: this
    process's stdout instead; neither: discarded."""
    if opts.rollout_precision == "int8":  # refused in one line where its products would crawl (fp8_kernel.py)
        check_fp8_serving(opts.python)
    if port_in_use(opts.host, opts.port):
        raise RuntimeError(f"port {opts.port} on {opts.host} is in use: pick another with --port (vllm_server_port)")
    argv, env = server_command(opts)
    url = f"http://{opts.host}:{opts.port}"
    out = open(log, "ab") if log is not None else (None if show_output else subprocess.DEVNULL)  # noqa: SIM115
    proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_stop_with_the_parent)
    segments: set[Path] = set()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not _healthy(url):
            if proc.poll() is not None:
                cause = _root_cause(Path(log)) if log is not None else ""
                raise RuntimeError(f"the vLLM server ({opts.python} -m vllm...) exited with status {proc.returncode} "
                                   f"before answering{': ' + cause if cause else ''}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the vLLM server at {url} did not answer within {start_timeout_s:.0f} s")
            time.sleep(0.5)
        segments = shared_memory_of_group(proc.pid)  # (mapped once the engine is up)
        yield RunningServer(url, proc)
    finally:
        stop_group(proc)
        remove_left_behind(segments)
        if log is not None:
            out.close()
