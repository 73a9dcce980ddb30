"""What this CPU computes natively, for choosing the demo's dtype.

bf16 matrix products run on AMX tiles or AVX512-BF16 units where the CPU has them: SmolLM2-135M with LoRA samples
32 completions about twice as fast in bf16 as in float32 there (benchmarks/RESULTS.md). Without those units
torch emulates bf16 arithmetic, slower than float32, so float32 stays the choice.
"""

from __future__ import annotations


def native_bf16() -> bool:
    """Whether this CPU has bf16 matrix units (AMX or AVX512-BF16), as torch detects them."""
    import torch

    checks = [getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    for check in checks:
        try:
            if check is not None and check():
                return True
        except (RuntimeError, AttributeError):  # a torch build without the CPU probe
            continue
    return False


def cpu_dtype() -> str:
    """``"bfloat16"`` where :func:`native_bf16`, else ``"float32"``."""
    return "bfloat16" if native_bf16() else "float32"
