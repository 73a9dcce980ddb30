"""Rollouts alone, side by side in one process: grpokit's transformers backend (``TransformersRollout.generate``:
the decode loop that drops finished rows, weights packed for oneDNN, the group's prompt prefilled once, the
inverse-CDF draw) against what TRL 1.16's trainer runs for the same rows (the model's ``generate`` with the
``GenerationConfig`` TRL builds from the same settings). SmolLM2-135M, the demo's arithmetic prompts in groups of
4, the same sampling settings on both sides; the sides alternate within every repeat.

Two ways to count: ``natural`` (completions end at their own end-of-sequence token, up to ``--max-tokens``; the
two sides draw different random streams, so the comparison is completion tokens per second) and ``fixed`` (every
completion exactly ``--max-tokens`` tokens, ``min_new_tokens`` on both sides: seconds for the same work).

    python benchmarks/bench_rollout.py                      # float32 (what the demo loads on a CPU without bf16 units)
    python benchmarks/bench_rollout.py --rows 8 32 --no-write
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import write_section


def trl_generation_config(tok, params, eos):
    """The generation config TRL 1.16's GRPOTrainer passes to ``generate`` (its transformers path)."""
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=params.max_new_tokens, do_sample=True, pad_token_id=tok.pad_token_id,
                            bos_token_id=tok.bos_token_id, eos_token_id=eos, temperature=params.temperature,
                            top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
                            repetition_penalty=params.repetition_penalty, cache_implementation=None,
                            **params.extra)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true", help="print only; RESULTS.md unchanged")
    args = ap.parse_args()

    from grpokit.models import load_model, load_tokenizer
    from grpokit.rollout.base import SamplingParams, completion_mask_from_eos, stop_token_ids
    from grpokit.rollout.transformers_backend import TransformersRollout
    from grpokit.tasks import get_task

    tok = load_tokenizer("smollm2-135m-instruct")
    tok.padding_side = "left"
    model = load_model("smollm2-135m-instruct", dtype=args.dtype).eval()
    rollout = TransformersRollout(tok)
    eos = stop_token_ids(model, tok)
    train = get_task("arithmetic").train_dataset
    results = []  # (mode, rows, side, seconds, tokens)
    for mode in ("natural", "fixed"):
        extra = {"min_new_tokens": args.max_tokens} if mode == "fixed" else {}
        params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0.9, top_k=50, do_sample=True,
                                extra=extra)
        config = trl_generation_config(tok, params, eos)
        for rows in args.rows:
            texts = [tok.apply_chat_template(train[i]["prompt"], tokenize=False, add_generation_prompt=True)
                     for i in range(max(1, rows // 4))]
            enc = tok(texts, return_tensors="pt", padding=True)
            ids, mask = enc.input_ids.repeat_interleave(4, 0)[:rows], enc.attention_mask.repeat_interleave(4, 0)[:rows]

            def grpokit_side(ids=ids, mask=mask, params=params):
                return rollout.generate(model, ids, mask, params).completion_mask.sum().item()

            @torch.no_grad()
            def trl_side(ids=ids, mask=mask, config=config):
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
                return completion_mask_from_eos(out[:, ids.shape[1]:], eos)[0].sum().item()

            sides = {"grpokit": grpokit_side, "trl": trl_side}
            for fn in sides.values():  # warm-up
                fn()
            samples = {name: [] for name in sides}
            for r in range(args.repeats):
                for name, fn in (list(sides.items()) if r % 2 == 0 else list(reversed(sides.items()))):
                    torch.manual_seed(r)
                    t0 = time.perf_counter()
                    tokens = fn()
                    samples[name].append((time.perf_counter() - t0, tokens))
            for name, s in samples.items():
                seconds = statistics.median(t for t, _ in s)
                tokens = sum(n for _, n in s) / len(s)
                results.append((mode, rows, name, seconds, tokens))
                print(f"{mode} {rows} rows {name}: {seconds:.2f} s, {tokens:.0f} completion tokens", flush=True)

    table = ["| completions | rows | grpokit s | TRL s | grpokit tok/s | TRL tok/s | grpokit / TRL (tok/s) |",
             "|---|---|---|---|---|---|---|"]
    for mode in ("natural", "fixed"):
        for rows in args.rows:
            g = next(r for r in results if r[:3] == (mode, rows, "grpokit"))
            t = next(r for r in results if r[:3] == (mode, rows, "trl"))
            ratio = (g[4] / g[3]) / (t[4] / t[3])
            table.append(f"| {mode} | {rows} | {g[3]:.2f} | {t[3]:.2f} | {g[4] / g[3]:.0f} | {t[4] / t[3]:.0f} "
                         f"| {ratio:.2f}× |")
    body = "\n".join(table) + (
        f"\n\n{args.dtype} weights, full model (no adapter), the demo's sampling (temperature 0.9, top-k 50), groups "
        f"of 4 identical prompts, up to {args.max_tokens} new tokens; median of {args.repeats} alternated repeats "
        "after a warm-up; tokens/s counts the completion tokens each side produced (natural: up to each row's end "
        "of sequence; fixed: min_new_tokens = max on both sides). grpokit's time includes packing the weights once "
        "per call (inside a trainer's generation batch they are packed once for all its calls).")
    if not args.no_write:
        write_section(f"Rollouts alone on SmolLM2-135M ({args.dtype})",
                      "python benchmarks/bench_rollout.py" + (f" --dtype {args.dtype}" if args.dtype != "float32"
                                                             else ""), body)


if __name__ == "__main__":
    main()
