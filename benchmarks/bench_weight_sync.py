"""What one weight publication to rollout workers moves and costs (grpokit/pipeline/workers/weights.py), on
SmolLM2-135M-Instruct: full fine-tuning (every weight) and the demo's LoRA (r=16 on all linear layers: the adapter's
tensors alone). Times the learner's write into shared memory and a worker's read out of it (the read in a process
of its own), median of several.

    python benchmarks/bench_weight_sync.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from _common import machine

READER = r"""
import json, sys, time, torch
from grpokit.pipeline.workers.weights import WeightSlots
layout = [(n, getattr(torch, d), tuple(s)) for n, d, s in json.loads(sys.argv[1])]
slots = WeightSlots.attach(layout, int(sys.argv[2]))
into = {n: torch.empty(s, dtype=d) for n, d, s in layout}
times, seen = [], -1
for line in sys.stdin:
    t0 = time.perf_counter(); seen = slots.read(into, newer_than=seen); times.append(time.perf_counter() - t0)
    print(json.dumps(times[-1]), flush=True)
"""


def measure(name: str, tensors: dict[str, torch.Tensor], rounds: int) -> dict:
    from grpokit.pipeline.workers.weights import WeightSlots

    slots = WeightSlots.create(tensors)
    layout = json.dumps([(n, str(d).removeprefix("torch."), list(s)) for n, d, s in slots.layout])
    reader = subprocess.Popen([sys.executable, "-c", READER, layout, str(slots.shared.fd)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, pass_fds=(slots.shared.fd,))
    writes, reads = [], []
    for version in range(1, rounds + 1):
        t0 = time.perf_counter()
        slots.write(version, tensors)
        writes.append(time.perf_counter() - t0)
        reader.stdin.write("go\n")
        reader.stdin.flush()
        reads.append(json.loads(reader.stdout.readline()))
    reader.stdin.close()
    reader.wait()
    return {"what": name, "tensors": len(tensors), "bytes": slots.bytes_per_publication,
            "write_s": statistics.median(writes[1:]), "read_s": statistics.median(reads[1:])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    a = parser.parse_args()
    from peft import LoraConfig, get_peft_model

    from grpokit.models import load_model

    model = load_model("smollm2-135m-instruct")
    full = {n: p.detach() for n, p in model.named_parameters()}
    results = [measure("full fine-tuning (float32)", {n: t.float() for n, t in full.items()}, a.rounds)]
    lora = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    adapter = {n: p.detach() for n, p in lora.named_parameters() if p.requires_grad}
    results.append(measure("the demo's LoRA adapter (r=16, all linear layers)", adapter, a.rounds))
    print(machine())
    for r in results:
        print(f"{r['what']}: {r['tensors']} tensors, {r['bytes'] / 2**20:.1f} MiB; learner's write "
              f"{r['write_s'] * 1e3:.1f} ms, a worker's read {r['read_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
