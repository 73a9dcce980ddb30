"""What this CPU computes natively and fast, for choosing the demo's dtype.

bf16 matrix products run on AMX tiles or AVX512-BF16 units where the CPU has them: a LoRA step of SmolLM2-135M
takes 5.6 s in bf16 against 6.6 s in float32 on a 2-core AMX CPU (benchmarks/RESULTS.md), and the demo fits 42-60
steps into its budget against 28-35. Without those units torch emulates bf16 arithmetic, slower than float32, so
float32 stays the choice there. Having the units is not enough: on a Xeon's cores with AMX turned off
(``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``) oneDNN's AVX512-BF16 kernels multiply a prefill-sized product at 0.75× the
speed of float32 (whose AVX512 units that CPU has twice), where an AMD EPYC's reach 2.8× and AMX 6×: so the choice
also times one such product in both dtypes (:func:`bf16_speedup`, ~0.1 s) and takes bf16 only where it is clearly
faster (:data:`BF16_MIN_SPEEDUP`).
"""

from __future__ import annotations

import time

BF16_MIN_SPEEDUP = 1.5
"""bf16 is chosen where it multiplies at least this many times faster than float32: far from both sides measured
(0.75× on AVX512-BF16 Xeon cores, 2.8× on an AMD EPYC, 6× with AMX), so a busy machine's timing noise does not flip
it."""


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


def bf16_speedup(rounds: int = 5) -> float:
    """How many times faster this CPU computes a (256 × 576) · (576 × 1536) product — one of SmolLM2-135M's MLP
    projections over a prefill's or a training batch's positions — in bf16 than in float32: the fastest of
    ``rounds`` timings of each, the two dtypes alternated (so a machine that slows down slows both), on one thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: no core's stall (another process on it) holds up the others at a barrier
    try:
        return _timed_ratio(torch, rounds)
    finally:
        torch.set_num_threads(threads)


def _timed_ratio(torch, rounds: int) -> float:
    with torch.no_grad():
        a = torch.randn(256, 576, generator=torch.Generator().manual_seed(0))
        w = torch.randn(1536, 576, generator=torch.Generator().manual_seed(1))
        pairs = {torch.float32: (a, w), torch.bfloat16: (a.bfloat16(), w.bfloat16())}
        best = dict.fromkeys(pairs, float("inf"))
        for _ in range(rounds + 1):  # the first round warms each kernel up
            for dtype, (x, y) in pairs.items():
                start = time.perf_counter()
                for _ in range(4):
                    torch.nn.functional.linear(x, y)
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.float32] / max(best[torch.bfloat16], 1e-9)


def cpu_dtype() -> str:
    """``"bfloat16"`` where :func:`native_bf16` and bf16 multiplies at least :data:`BF16_MIN_SPEEDUP` times faster
    than float32 (:func:`bf16_speedup`), else ``"float32"``."""
    return "bfloat16" if native_bf16() and bf16_speedup() >= BF16_MIN_SPEEDUP else "float32"
