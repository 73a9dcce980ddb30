"""Generation in each ``rollout_precision`` on SmolLM2-135M at the demo's shapes: speed, refresh cost, bytes read, and
the sampler/trainer mismatch.

For each precision, grpokit's transformers backend (``TransformersRollout(rollout_precision=...)``: the decode loop,
the flat Llama step, copies of the linear layers made by ``generation_batch``) samples the demo's arithmetic prompts
(``--questions`` × 4 completions, temperature 0.9, top-k 50, exactly ``--tokens`` new tokens each), the precisions
alternated and their order flipped every round (the mismatch from a second call without ``min_new_tokens``, whose
completions end where the sampler ends them). Reported per precision: milliseconds per decode step (the call's
time over its tokens, prefill included), the refresh (making the copies: what every optimizer step adds), the bytes
of linear weights one decode step reads, and the mismatch of the sampler's log-probs against the trainer's (the
model in its own dtype, on the sampler's top-k support as grpokit's correction computes it): k3 = mean(r - 1 - log r)
with r = trainer / sampler over the sampled tokens, and max |log r|.

    python benchmarks/bench_rollout_precision.py                       # the float32 model
    python benchmarks/bench_rollout_precision.py --dtype bfloat16      # the demo's model on a CPU with bf16 units
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_rollout_precision.py --no-write
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import write_section  # noqa: E402

from grpokit.algorithms.sampling_support import SamplingSupport, support_logps  # noqa: E402
from grpokit.models import load_model, load_tokenizer  # noqa: E402
from grpokit.rollout.base import SamplingParams  # noqa: E402
from grpokit.rollout.precision import bytes_per_decode_step  # noqa: E402
from grpokit.rollout.transformers_backend import TransformersRollout  # noqa: E402
from grpokit.tasks import get_task  # noqa: E402

TEMPERATURE, TOP_K, GROUP = 0.9, 50, 4


def prompts(tok, questions: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = get_task("arithmetic").train_dataset.select(range(questions))
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    enc = tok([t for t in texts for _ in range(GROUP)], add_special_tokens=False, padding=True, return_tensors="pt")
    return enc.input_ids, enc.attention_mask


def mismatch(model, ids, mask, gen) -> tuple[float, float]:
    """(k3, max |log r|) of the sampler's log-probs against the model's own on the sampler's support."""
    full = torch.cat([ids, gen.completion_ids], 1)
    full_mask = torch.cat([mask, gen.completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=full_mask).logits[:, ids.shape[1] - 1:-1].float() / TEMPERATURE
    trainer = support_logps(logits.flatten(0, 1), gen.completion_ids.flatten(), SamplingSupport(top_k=TOP_K))
    valid = gen.completion_mask.flatten().bool()
    log_r = (trainer - gen.sampler_logps.flatten())[valid]
    r = log_r.exp()
    return float((r - 1 - log_r).mean()), float(log_r.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--questions", type=int, nargs="+", default=[2, 8], help="prompts per call (× 4 completions)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--precisions", nargs="+", default=["auto", "bf16", "int8"])
    ap.add_argument("--no-write", action="store_true", help="print only; RESULTS.md unchanged")
    args = ap.parse_args()
    tok = load_tokenizer("smollm2-135m-instruct")
    model = load_model("smollm2-135m-instruct", dtype=args.dtype).eval()
    own = "float32" if args.dtype == "float32" else "bf16"
    params = SamplingParams(max_new_tokens=args.tokens, temperature=TEMPERATURE, top_k=TOP_K,
                            extra={"min_new_tokens": args.tokens})
    backends = {p: TransformersRollout(tok, rollout_precision=p) for p in args.precisions}
    table = ["| rows | precision | MB read / decode step | ms / decode step (median) | vs the model's own | "
             "refresh ms | mismatch k3 | max abs log r |", "|---|---|---|---|---|---|---|---|"]
    for questions in args.questions:
        ids, mask = prompts(tok, questions)
        steps, refresh, gaps = {p: [] for p in backends}, {p: [] for p in backends}, {}
        for r in range(args.repeats + 1):
            order = list(backends) if r % 2 == 0 else list(backends)[::-1]
            for p in order:
                backend = backends[p]
                torch.manual_seed(r)
                t0 = time.perf_counter()
                with backend.generation_batch(model):
                    t1 = time.perf_counter()
                    gen = backend.generate(model, ids, mask, params)
                    t2 = time.perf_counter()
                if r:  # the first round warms up
                    steps[p].append(1000 * (t2 - t1) / gen.completion_ids.shape[1])
                    refresh[p].append(1000 * (t1 - t0))
                if r == 1 and backend.copy_precision(model) is not None:  # completions ending where they end
                    with backend.generation_batch(model):  # (min_new_tokens keeps the sampler off the EOS token)
                        free = backend.generate(model, ids, mask, dataclasses.replace(params, extra={}))
                    gaps[p] = mismatch(model, ids, mask, free)
        base = statistics.median(steps["auto"]) if "auto" in steps else None
        for p in backends:
            ms = statistics.median(steps[p])
            copy = backends[p].copy_precision(model)
            name = f"{p} ({own}, the model's own)" if copy is None else p
            mb = bytes_per_decode_step(model, copy) / 1e6
            k3, gap = gaps.get(p, (0.0, 0.0))
            ratio = f"{base / ms:.2f}×" if base else "—"
            table.append(f"| {ids.shape[0]} | {name} | {mb:.0f} | {ms:.1f} | {ratio} | "
                         f"{statistics.median(refresh[p]):.0f} | {k3:.1e} | {gap:.3f} |")
            print(table[-1], flush=True)
    caps = ", ".join(f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ)
    body = "\n".join(table) + (
        f"\n\nSmolLM2-135M in {args.dtype}; {caps or 'no ISA cap'}. A decode step's time is a whole `generate` call "
        f"of grpokit's backend over its {args.tokens} tokens (prefill and sampling included), median of "
        f"{args.repeats} alternated repeats after a warm-up round; the refresh is entering `generation_batch` (copies "
        "made, LoRA folded: none here). Mismatch: the sampler's log-probs against the model's own (k3 0 where the "
        "precision is the model's own: nothing to correct).")
    if not args.no_write:
        write_section(f"Rollout precision: SmolLM2-135M in {args.dtype}"
                      + (f" ({caps})" if caps else ""),
                      "python benchmarks/bench_rollout_precision.py" + (f" --dtype {args.dtype}"
                                                                         if args.dtype != "float32" else ""), body)


if __name__ == "__main__":
    main()
