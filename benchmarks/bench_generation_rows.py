"""How generation time grows with the rows generated together: the demo's sampling (SmolLM2-135M with LoRA r16/α32
on every linear layer, the arithmetic prompts, groups of 4, temperature 0.9, top-k 50, up to 32 new tokens) for
32, 64 and 128 rows, the sampled tokens' count held equal by a fixed length (``min_new_tokens``). What
``dynamic_sampling_oversample`` trades on: one refill round of 128 completions against four of 32.

    python benchmarks/bench_generation_rows.py --dtype bfloat16 --tokens 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import write_section


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=16, help="new tokens per completion (fixed)")
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true", help="print only; RESULTS.md unchanged")
    args = ap.parse_args()
    from peft import LoraConfig, get_peft_model

    from grpokit.models import load_model, load_tokenizer
    from grpokit.rollout.base import SamplingParams
    from grpokit.rollout.transformers_backend import TransformersRollout
    from grpokit.tasks import get_task

    tok = load_tokenizer("smollm2-135m-instruct")
    tok.padding_side = "left"
    model = get_peft_model(load_model("smollm2-135m-instruct", dtype=args.dtype),
                           LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    rollout = TransformersRollout(tok)
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0.9, top_k=50, do_sample=True,
                            extra={"min_new_tokens": args.tokens})
    train = get_task("arithmetic").train_dataset
    rows_out = []
    for rows in args.rows:
        texts = [tok.apply_chat_template(train[i]["prompt"], tokenize=False, add_generation_prompt=True)
                 for i in range(rows // 4)]
        enc = tok(texts, return_tensors="pt", padding=True)
        ids, mask = enc.input_ids.repeat_interleave(4, 0), enc.attention_mask.repeat_interleave(4, 0)
        torch.manual_seed(0)
        with rollout.generation_batch(model):
            rollout.generate(model, ids, mask, params)  # warm-up
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                rollout.generate(model, ids, mask, params)
                times.append(time.perf_counter() - t0)
        rows_out.append((rows, statistics.median(times)))
        print(f"{rows} rows: {rows_out[-1][1]:.2f} s", flush=True)
    base_rows, base = rows_out[0]
    table = [f"| rows generated together | seconds (median of {args.repeats}) | × the time of {base_rows} rows "
             "| per completion (ms) |", "|---|---|---|---|"]
    for rows, t in rows_out:
        table.append(f"| {rows} | {t:.2f} | {t / base:.2f} | {1000 * t / rows:.0f} |")
    body = "\n".join(table) + (
        f"\n\n{args.tokens} new tokens per completion, {args.dtype} weights with the adapter merged once for all "
        "calls (as in a dynamic-sampling batch), the demo's sampling. Rounds of one batch (32 completions) each pay "
        "the full per-token cost of a forward pass through 30 layers for few rows; benchmarks/demo_runs.md (`oversample`) has "
        "what one large refill round did for the demo.")
    if not args.no_write:
        write_section(f"Generation rows on SmolLM2-135M (LoRA r16, {args.dtype})",
                      f"python benchmarks/bench_generation_rows.py --dtype {args.dtype} --tokens {args.tokens}", body)


if __name__ == "__main__":
    main()
