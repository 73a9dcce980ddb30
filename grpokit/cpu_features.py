"""What this CPU computes natively, for choosing the demo's dtype.

bf16 matrix products run on AMX tiles or AVX512-BF16 units where the CPU has them: a LoRA step of SmolLM2-135M
takes 5.6 s in bf16 against 6.6 s in float32 on a 2-core AMX CPU (benchmarks/RESULTS.md), and the demo fits 42-60
steps into its budget against 28-35. Without those units torch emulates bf16 arithmetic, slower than float32, so
float32 stays the choice there.
"""

from __future__ import annotations


def native_bf16() -> bool:
    """Whether this CPU has bf16 matrix units (AMX or AVX512-BF16), as torch detects them."""
    import torch

    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        probe = getattr(torch.cpu, name, None)  # private probes: a torch without them gets float32
        try:
            if probe is not None and probe():
                return True
        except RuntimeError:
            continue
    return False


def cpu_dtype() -> str:
    """``"bfloat16"`` where :func:`native_bf16`, else ``"float32"``."""
    return "bfloat16" if native_bf16() else "float32"
