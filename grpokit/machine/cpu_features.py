"""What this CPU computes natively and fast, for choosing the demo's dtype.

bf16 matrix products run on AMX tiles or AVX512-BF16 units where the CPU has them: on a 2-core AMX CPU a LoRA step
of SmolLM2-135M is faster in bf16 than in float32, and the demo fits more steps into its budget. Without those units
torch emulates bf16 arithmetic, slower than float32, so float32 stays the choice there. Having the units is not
enough: on a Xeon's cores with AMX turned off (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``) oneDNN's AVX512-BF16 kernels
multiply a prefill-sized product slower than float32 (whose AVX512 units that CPU has twice), where an AMD EPYC's
are several times faster and AMX faster still (benchmarks/RESULTS.md, 'Measurements behind design choices'):
so the choice also times one such product in both dtypes (:func:`bf16_speedup`, well under a second) and takes bf16
only where it is clearly faster (:data:`BF16_MIN_SPEEDUP`). The timing is made once per machine and kept
(:func:`measured_bf16_speedup`), so every later demo there — another seed, a resumed run — takes the same dtype, as
the choice by CPU flags alone did.
"""

from __future__ import annotations

import json
import os
import time

BF16_MIN_SPEEDUP = 1.5
"""bf16 is chosen where it multiplies at least this many times faster than float32: far from both sides measured
(under 1× on AVX512-BF16 Xeon cores, several times on an AMD EPYC and with AMX: benchmarks/RESULTS.md, 'Measurements
behind design choices'), so a busy machine's timing noise does not flip it."""

SPEEDUP_FILE = "bf16-speedup.json"
"""In grpokit's cache folder: :func:`bf16_speedup` by machine (:func:`machine_key`)."""


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
    finally:
        torch.set_num_threads(threads)
    return best[torch.float32] / max(best[torch.bfloat16], 1e-9)


def machine_key() -> str:
    """What :func:`bf16_speedup` depends on: the CPU's model name and its vector/matrix flags (a virtual machine's
    name can be as plain as "Intel(R) Xeon(R) Processor", and a shared home folder serves several machines), the
    instruction set oneDNN is capped to (``ONEDNN_MAX_CPU_ISA``) and torch's version."""
    import platform

    import torch

    name, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            info = dict(line.split(":", 1) for line in f if ":" in line and not line.startswith("processor"))
        info = {k.strip(): v.strip() for k, v in info.items()}
        name = info.get("model name", name)
        flags = " ".join(sorted(f for f in info.get("flags", "").split() if f.startswith(("avx", "amx", "fma"))))
    except OSError:
        pass
    return (f"{name} [{flags}] | ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '')} | "
            f"torch {torch.__version__}")


def measured_bf16_speedup() -> float:
    """:func:`bf16_speedup` as first measured on this machine (:func:`machine_key`), kept in grpokit's cache folder
    (``$GRPOKIT_CACHE`` or ``~/.cache/grpokit``); measured and kept on first use. A cache that cannot be read or
    written is ignored: it is then measured every time."""
    from ..config_names import cache_dir
    from ..run.files import atomic_write_text

    path, key = cache_dir() / SPEEDUP_FILE, machine_key()
    try:
        known = json.loads(path.read_text())
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(key), (int, float)):
        return float(known[key])
    speedup = bf16_speedup()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({**known, key: speedup}, indent=1, sort_keys=True))
    except OSError:
        pass
    return speedup


def cpu_dtype() -> str:
    """``"bfloat16"`` where :func:`native_bf16` and bf16 multiplies at least :data:`BF16_MIN_SPEEDUP` times faster
    than float32 on this machine (:func:`measured_bf16_speedup`), else ``"float32"``."""
    return "bfloat16" if native_bf16() and measured_bf16_speedup() >= BF16_MIN_SPEEDUP else "float32"
