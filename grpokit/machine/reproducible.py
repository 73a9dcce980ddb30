"""Runs of one seed on one machine that take the same steps on a CPU with more than one thread.

Intel MKL, torch's BLAS on x86 CPUs, does not promise the same bits for the same product from run to run when it
runs threaded, unless its conditional numerical reproducibility (CNR) is asked for. Training amplifies last bits: on a
2-core Xeon runs of one seed with two torch threads sampled different tokens from steps 20-55 on (seeds 0 and 2 by
step 25), so a seed's run was a new draw each time. With ``MKL_CBWR=AUTO,STRICT`` (CNR in strict mode: one code path
for the CPU, results independent of how the operands lie in memory) two runs of seed 2 through the command had the
same loss, rewards and completion lengths at each of 25 steps, at the same speed; the grad
norm and entropy they log still differed in their last digits (a reduction that does not feed the update; not found
yet). Small products pay for it (a 576 × 1100 by 1100 × 16 one, a LoRA gradient's shape, took about twice as long),
large ones do not (1100 × 576 by 576 × 1536: the same time): benchmarks/RESULTS.md, 'Measurements behind design
choices'.

MKL reads the setting once, before its first product, so only the process's owner can choose it: the ``grpokit``
command sets it first thing (:func:`reproducible_blas`); a script that imports grpokit as a library sets
``MKL_CBWR=AUTO,STRICT`` in its environment itself if it wants the same (docs/reliability.md, "Runs that repeat").
"""

from __future__ import annotations

import os

MKL_CBWR = "AUTO,STRICT"


def reproducible_blas() -> None:
    """``MKL_CBWR`` set to :data:`MKL_CBWR` unless the user chose a value (any, kept as it is). Has effect only before
    MKL's first product in the process."""
    os.environ.setdefault("MKL_CBWR", MKL_CBWR)
