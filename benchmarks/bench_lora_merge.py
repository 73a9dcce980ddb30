"""What merging LoRA into SmolLM2-135M for one generation costs: ``lora_merged`` entered and left (merge, then
the base given back), median of 7, on the embedded model with LoRA r16/α32 on every linear layer.

    python benchmarks/bench_lora_merge.py --dtype bfloat16
    GRPOKIT_SRC=/path/to/other/checkout python benchmarks/bench_lora_merge.py --dtype bfloat16   # the code before
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    sys.path.insert(0, os.environ.get("GRPOKIT_SRC") or os.path.dirname(HERE))
    from peft import LoraConfig, get_peft_model

    from grpokit.models import load_model
    from grpokit.rollout.transformers_backend import lora_merged

    model = get_peft_model(load_model("smollm2-135m-instruct", dtype=args.dtype),
                           LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        with lora_merged(model) as merged:
            assert merged
        times.append(time.perf_counter() - t0)
    print(f"{args.dtype}: merge and give back {statistics.median(times):.3f} s (median of {args.repeats})")


if __name__ == "__main__":
    main()
