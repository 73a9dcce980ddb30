"""DeepSpeed on a CPU without its first-use C++ build, for the test processes.

On the CPU accelerator DeepSpeed's communication backend builds its shared-memory all-reduce extension
(``deepspeed_shm_comm``, a JIT C++ compile of ~45 s on a 2-core machine with an empty ``~/.cache/torch_extensions``)
when it initialises. Only ``inference_all_reduce`` (tensor-parallel inference) uses it; ZeRO training communicates
through ``torch.distributed`` either way. Marking the op incompatible, as DeepSpeed does itself on a machine that
cannot build it, leaves training unchanged and skips the build.
"""

from __future__ import annotations

import runpy
import sys


def skip_inference_shm_build() -> None:
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


if __name__ == "__main__":  # python deepspeed_cpu.py -m module args...: run the module with the build skipped
    skip_inference_shm_build()
    if sys.argv[1:2] != ["-m"] or len(sys.argv) < 3:
        sys.exit("usage: deepspeed_cpu.py -m MODULE [ARGS...]")
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
