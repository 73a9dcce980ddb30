"""Rows that agree, run once: the demo's batches at its steady state, this checkout against another (``--before``).

A policy that has grown confident writes the same reply several times in a group of four. The decode loop runs the
rows that share a history as one (``grpokit.rollout.decode``) and the training forward runs each distinct
(prompt, completion) once (``grpokit.forward.logprobs.distinct_rows``). This benchmark times both on SmolLM2-135M (float32,
LoRA r16 on every linear layer) with an adapter the demo trained (``runs/demo/final``), in child processes alternated
between the two checkouts:

* ``generate``: ``--prompts`` training questions × 4, sampled as the demo samples (temperature 0.9, top-k 50, up to
  32 new tokens), inside one generation batch (the adapter merged and the weights packed once);
* ``train``: the forward and backward of the log-probs of the first 8 groups of those samples whose correctness
  differs (the groups dynamic sampling keeps), ``per_device_train_batch_size`` 32; ``--long-rows N``: N of those
  rows (one per group) replaced by 30 random tokens, as a confident policy's occasional ramble pads the batch.

    python benchmarks/bench_agreeing_rows.py --adapter runs/demo/final --before ../grpokit-before
    python benchmarks/bench_agreeing_rows.py --adapter runs/demo/final --before ../grpokit-before --long-rows 2

Prints one line per run and the medians; RESULTS.md holds what was measured with it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(adapter: str, prompts: int, repeats: int, long_rows: int = 0, dtype: str = "float32") -> dict:
    import torch
    from peft import PeftModel

    from grpokit.forward.logprobs import completion_logps
    from grpokit.models import load_model, load_tokenizer
    from grpokit.rollout.base import SamplingParams
    from grpokit.rollout.transformers_backend import TransformersRollout
    from grpokit.tasks import get_task

    tok = load_tokenizer("smollm2-135m-instruct")
    tok.padding_side = "left"
    model = PeftModel.from_pretrained(load_model("smollm2-135m-instruct", dtype=dtype), adapter, is_trainable=True)
    rows = list(get_task("arithmetic", seed=0).train_dataset)[:prompts]
    texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
             for r in rows for _ in range(4)]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    params = SamplingParams(max_new_tokens=32, temperature=0.9, top_k=50)
    rollout = TransformersRollout(tok)
    out: dict = {"generate": [], "train": []}
    with rollout.generation_batch(model):
        for i in range(repeats):
            torch.manual_seed(i)
            t = time.perf_counter()
            gen = rollout.generate(model, enc["input_ids"], enc["attention_mask"], params)
            out["generate"].append(time.perf_counter() - t)
    out["tokens"] = int(gen.completion_mask.sum())
    replies = tok.batch_decode(gen.completion_ids, skip_special_tokens=True)
    right = torch.tensor([float(re.findall(r"Answer:\s*(-?\d+)", text)[-1:] == [rows[i // 4]["answer"]])
                          for i, text in enumerate(replies)]).view(-1, 4)
    kept = [i for i in range(prompts) if right[i].std() > 0][:8]
    idx = torch.tensor([4 * i + j for i in kept for j in range(4)])
    batch = (enc["input_ids"][idx], enc["attention_mask"][idx], gen.completion_ids[idx], gen.completion_mask[idx])
    if long_rows:
        width = 30
        ids = torch.nn.functional.pad(batch[2], (0, width - batch[2].shape[1]), value=tok.pad_token_id)
        mask = torch.nn.functional.pad(batch[3], (0, width - batch[3].shape[1]))
        noise = torch.Generator().manual_seed(1)
        for row in range(1, 1 + 4 * long_rows, 4):
            ids[row], mask[row] = torch.randint(100, 1000, (width,), generator=noise), 1
        batch = (batch[0], batch[1], ids, mask)
    out["kept_groups"] = len(kept)
    out["distinct_rows"] = len({(i // 4, tuple(batch[2][i].tolist())) for i in range(len(idx))})
    model.train()
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        logps, _ = completion_logps(model, *batch, temperature=0.9, batch_size=32)
        logps.sum().backward()
        out["train"].append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapter", required=True, help="a LoRA adapter the demo trained (runs/demo/final)")
    ap.add_argument("--before", help="a checkout of grpokit to compare with (required)")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of each part in a run")
    ap.add_argument("--runs", type=int, default=2, help="alternated runs per side")
    ap.add_argument("--long-rows", type=int, default=0, help="rows of the training batch made 30 tokens long")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the base weights' dtype")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.adapter, args.prompts, args.repeats, args.long_rows, args.dtype)))
        return
    if not args.before:
        ap.error("--before is required: a checkout of grpokit to compare with")
    sides = {"this": ROOT, "before": os.path.abspath(args.before)}
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(args.runs):
        for side, src in sides.items():
            env = dict(os.environ, PYTHONPATH=src)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--adapter", args.adapter,
                   "--prompts", str(args.prompts), "--repeats", str(args.repeats), "--long-rows", str(args.long_rows),
                   "--dtype", args.dtype]
            done = subprocess.run(cmd, env=env, cwd=src, capture_output=True, text=True, check=True)
            res = json.loads(done.stdout.strip().splitlines()[-1])
            results[side].append(res)
            print(side, json.dumps(res))
    for side, runs in results.items():
        gen = statistics.median(t for r in runs for t in r["generate"])
        train = statistics.median(t for r in runs for t in r["train"])
        print(f"{side}: generate {gen:.2f} s ({runs[0]['tokens']} completion tokens), train fwd+bwd {train:.2f} s "
              f"({runs[0]['kept_groups']} groups, {runs[0]['distinct_rows']} distinct rows of "
              f"{4 * runs[0]['kept_groups']})")


if __name__ == "__main__":
    main()
