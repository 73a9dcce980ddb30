"""The sampler mismatch of a real vLLM engine against the trainer, on the demo's prompts and sampler settings.

vLLM's CPU build (from ``.venv-vllm``, ``make vllm-env``) serves the embedded SmolLM2-135M in each ``--engine-dtype``;
it samples completions of the demo's arithmetic prompts at the demo's temperature 0.9 and top_k 50 and reports
each token's log-prob (``processed_logprobs``: on the top-k support). The trainer computes the same tokens'
log-probs in each ``--trainer-dtype``, on the sampler's support as grpokit's correction does
(:func:`grpokit.algorithms.sampling_support.support_logps`), and over the whole vocabulary as a trainer that ignores
the truncation would (TRL #6789's bias). Per pair: the mismatch KL (k1 = mean(log s - log t), k3 = mean(r - 1 - log r)
with r = t/s, over the sampled tokens), the token ratio's quantiles, the sequences' geometric-mean ratio's, and
max |log s - log t|.

With ``--repetition-penalty R`` and ``--min-tokens N`` the engine also penalises repeats and holds its stop tokens
back for the first N tokens; the trainer replays both (grpokit's correction), and the table adds the support
without that replay (what the trainer compared before).

    python benchmarks/bench_vllm_mismatch.py --prompts 32 --tokens 48
    python benchmarks/bench_vllm_mismatch.py --prompts 32 --tokens 48 --engine-dtype bfloat16 \
        --trainer-dtype float32 --repetition-penalty 1.3 --min-tokens 8
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpokit.algorithms.sampling_support import RowContext, SamplingSupport, support_logps  # noqa: E402
from grpokit.models import load_model, load_tokenizer  # noqa: E402
from grpokit.rollout.base import stop_token_ids  # noqa: E402
from grpokit.rollout.vllm_launch import ServeOptions, free_port, running_server  # noqa: E402
from grpokit.rollout.vllm_server import VLLMServerClient  # noqa: E402
from grpokit.tasks import get_task  # noqa: E402

TEMPERATURE, TOP_K = 0.9, 50


def prompts(tok, n: int) -> list[list[int]]:
    rows = get_task("arithmetic").train_dataset.select(range(n))
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def trainer_logps(model, prompt: list[int], completion: list[int], support: SamplingSupport) -> dict[str, torch.Tensor]:
    """``completion``'s tokens' log-probs by label: under the sampler's distribution as grpokit replays it
    (``support``), on the top-k support alone when ``support`` also reshapes, and over the whole vocabulary."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / TEMPERATURE
    tokens = torch.tensor(completion)
    n = len(completion)
    context = RowContext(torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long), tokens[None],
                         torch.zeros(n, dtype=torch.long), torch.arange(n))
    out = {"on the support (grpokit)": support_logps(logits, tokens, support, context)}
    if support.reshapes and (support.penalises or support.holds_stops):
        out["top-k alone, no penalty or min_tokens replayed"] = support_logps(logits, tokens, SamplingSupport(top_k=TOP_K))
    out["whole vocabulary (biased)"] = support_logps(logits, tokens, SamplingSupport())
    return out


def summary(sampler: list[torch.Tensor], trainer: list[torch.Tensor]) -> dict[str, float]:
    s, t = torch.cat(sampler), torch.cat(trainer)
    log_r = t - s
    r = log_r.exp()
    seq = torch.stack([(tt - ss).mean().exp() for ss, tt in zip(sampler, trainer)])
    q = torch.tensor([0.05, 0.5, 0.95])
    return {"k1": float((s - t).mean()), "k3": float((r - 1 - log_r).mean()), "max_abs": float(log_r.abs().max()),
            **{f"ratio_p{int(p * 100):02d}": float(v) for p, v in zip(q, torch.quantile(r, q))},
            **{f"seq_p{int(p * 100):02d}": float(v) for p, v in zip(q, torch.quantile(seq, q))}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--engine-dtype", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--trainer-dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--python", default=os.environ.get("GRPOKIT_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python")))
    a = p.parse_args()
    tok = load_tokenizer("smollm2-135m-instruct")
    batch = prompts(tok, a.prompts)
    trainers = {d: load_model("smollm2-135m-instruct", dtype=getattr(torch, d)) for d in a.trainer_dtype}
    any_model = next(iter(trainers.values()))
    support = SamplingSupport(top_k=TOP_K, repetition_penalty=a.repetition_penalty, min_tokens=a.min_tokens,
                              stop_ids=tuple(stop_token_ids(any_model, tok)))
    reshaping = {"repetition_penalty": a.repetition_penalty} if a.repetition_penalty != 1.0 else {}
    if a.min_tokens:
        reshaping["min_tokens"] = a.min_tokens
    print("| engine | trainer | log-probs compared | k1 | k3 | max abs | token ratio p05 / p50 / p95 | "
          "sequence ratio p05 / p50 / p95 |\n|---|---|---|---|---|---|---|---|")
    for engine_dtype in a.engine_dtype:
        opts = ServeOptions(model="smollm2-135m-instruct", port=free_port(), dtype=engine_dtype, python=a.python,
                            extra=["--enforce-eager", "--seed", "0"])
        with running_server(opts, log=Path(f"/tmp/bench_vllm_mismatch_{engine_dtype}.log")) as server:
            client = VLLMServerClient(server.url, timeout=600)
            client.check(str(trainers[a.trainer_dtype[0]].name_or_path))
            completions, sampler = client.generate(batch, {"temperature": TEMPERATURE, "top_k": TOP_K,
                                                           "max_tokens": a.tokens, "seed": 0, **reshaping})
        sampler = [torch.tensor(x) for x in sampler]
        for trainer_dtype, model in trainers.items():
            pairs = [trainer_logps(model, pr, c, support) for pr, c in zip(batch, completions)]
            for label in pairs[0]:
                m = summary(sampler, [pair[label] for pair in pairs])
                print(f"| {engine_dtype} | {trainer_dtype} | {label} | {m['k1']:.2e} | {m['k3']:.2e} | "
                      f"{m['max_abs']:.3f} | {m['ratio_p05']:.4f} / {m['ratio_p50']:.4f} / {m['ratio_p95']:.4f} | "
                      f"{m['seq_p05']:.4f} / {m['seq_p50']:.4f} / {m['seq_p95']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
