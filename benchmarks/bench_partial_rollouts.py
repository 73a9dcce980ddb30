"""The learner's idle time with and without partial rollouts, when one completion in 16 is 8x the median length.

SmolLM2-135M-Instruct (the embedded model) with the demo's LoRA trains through ``GRPOTrainer`` with asynchronous
rollouts (``max_staleness=2``), the thread producer or one rollout worker. Its completion lengths are drawn: the model's
logits are shaped so that a completion's first token decides its length — with probability 1/16 it is *long*
(``8 * median`` tokens), else ``median`` tokens — and it then ends with the end-of-sequence token exactly there. The
shaping is in the model's forward, which generation runs; the learner computes its log-probs from the hidden states and
the head (grpokit's lean path) and does not see it, so the run measures time, not learning (its ratios are clipped).
Everything else is the model's own distribution (temperature 1).

Measured per run: ``perf/rollout_wait_s`` summed over the steps after the first (the learner waiting for a generation
batch), seconds per step, and partial rollouts' own metrics. Run on a quiet machine::

    python benchmarks/bench_partial_rollouts.py --steps 10
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time

import torch
from _common import machine
from transformers.models.llama.modeling_llama import LlamaForCausalLM

LONG_EVERY = 16


class DrawnLengths(LlamaForCausalLM):
    """SmolLM2 whose completions are ``median`` tokens long, or ``8 * median`` for one in ``LONG_EVERY``: token ids
    divisible by ``LONG_EVERY`` are *long* tokens, the others *short*; the first completion token is long with
    probability ``1 / LONG_EVERY``, every later one of the first one's kind, and the end-of-sequence token comes
    exactly at the length of that kind. ``prompt_length``: every prompt's length in tokens (equal by construction)."""

    prompt_length = 0
    median = 16
    stops: list[int] = []

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, logits_to_keep=0, **kw):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              cache=cache, logits_to_keep=logits_to_keep, **kw)
        logits = out.logits
        t = logits.shape[1]
        if t == 0:  # (a forward for its hidden states only)
            return out
        if position_ids is None:  # left-padded rows: positions count real tokens
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        made = position_ids[:, -t:] - (self.prompt_length - 1)  # completion tokens before the one chosen there
        at = made >= 0  # (the prompt's positions are left as they are)
        if bool(at.any()):
            shaped = logits.clone()
            shaped[at] = self._shape(logits[at].float(), input_ids[:, -t:][at], made[at]).to(logits.dtype)
            out.logits = shaped
        return out

    def _shape(self, logits: torch.Tensor, ids: torch.Tensor, made: torch.Tensor) -> torch.Tensor:
        """``logits`` (M, V) at completion positions, ``ids`` (M,) the token there, ``made`` (M,) how many
        completion tokens precede the one these logits choose."""
        vocab = logits.shape[-1]
        is_long = torch.arange(vocab, device=logits.device) % LONG_EVERY == 0
        stops = torch.tensor(self.stops, device=logits.device)
        is_long[stops] = False
        is_short = ~is_long
        is_short[stops] = False
        first = made == 0
        later = made > 0
        long_row = (ids % LONG_EVERY == 0) & ~torch.isin(ids, stops)
        out = logits.clone()
        # the first token: long with probability 1/LONG_EVERY (the model's own choice within each kind)
        lp = torch.log_softmax(logits, -1)
        mass_long = torch.logsumexp(lp.masked_fill(~is_long, -math.inf), -1, keepdim=True)
        mass_short = torch.logsumexp(lp.masked_fill(~is_short, -math.inf), -1, keepdim=True)
        shaped_first = torch.where(is_long, lp - mass_long + math.log(1 / LONG_EVERY),
                                   lp - mass_short + math.log(1 - 1 / LONG_EVERY)).masked_fill(~(is_long | is_short),
                                                                                               -math.inf)
        out = torch.where(first.unsqueeze(-1), shaped_first, out)
        # later tokens: the first one's kind, until the kind's length; then the end-of-sequence token
        own_kind = torch.where(long_row.unsqueeze(-1), is_long, is_short)
        length = torch.where(long_row, self.median * 8, self.median)
        ending = later & (made >= length - 1)
        keep = torch.where(ending.unsqueeze(-1), torch.zeros_like(own_kind), own_kind)
        keep[..., stops[0]] |= ending
        out = torch.where(later.unsqueeze(-1), out.masked_fill(~keep, -math.inf), out)
        return out


def build(median: int):
    from grpokit.models import load_model
    from grpokit.rollout.base import stop_token_ids

    model = load_model("smollm2-135m-instruct")
    model.__class__ = DrawnLengths  # (the learner's log-probs take the head's shortcut: they do not see the shaping)
    return model, stop_token_ids


def run(partial: bool, workers: int, steps: int, median: int, out_dir: str) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback

    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    model, stop_token_ids = build(median)
    prompts = [[{"role": "user", "content": f"Write about item {1000 + i}."}] for i in range(512)]
    lengths = {len(tok(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]) for p in prompts[:64]}
    assert len(lengths) == 1, f"prompts of different lengths: {lengths}"
    DrawnLengths.prompt_length, DrawnLengths.median = lengths.pop(), median
    DrawnLengths.stops = stop_token_ids(model, tok)

    def distinct(completions, **kw):
        return [len(set(c[0]["content"])) / 40 for c in completions]

    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=32, num_generations=4,
                      max_completion_length=8 * median, temperature=1.0, top_k=0, learning_rate=5e-4, max_steps=steps,
                      logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0, beta=0.0,
                      gradient_checkpointing=False, disable_tqdm=True, max_staleness=2, partial_rollouts=partial,
                      rollout_workers=workers)
    t = GRPOTrainer(model, distinct, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
                    processing_class=tok, peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    stamps = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    t.add_callback(Stamp())
    t0 = time.perf_counter()
    t.train()
    wall = time.perf_counter() - t0
    logs = [h for h in t.state.log_history if "reward" in h]
    after_first = logs[1:]
    row = {"partial_rollouts": partial, "rollout_workers": workers, "steps": len(logs), "wall_s": wall,
           "wall_s_per_step": (stamps[-1] - stamps[0]) / (len(stamps) - 1),
           "learner_step_s": statistics.mean(h["step_time"] for h in after_first),
           "learner_idle_s": sum(h["perf/rollout_wait_s"] for h in after_first),
           "mean_length": statistics.mean(h["completions/mean_length"] for h in logs),
           "max_length": max(h["completions/max_length"] for h in logs)}
    for name in ("sample/token_staleness_mean", "sample/partial_straddling_frac", "sample/partial_in_flight",
                 "sample/partial_restarted_total"):
        if name in logs[-1]:
            row[name] = statistics.mean(h[name] for h in logs)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--median", type=int, default=16)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--one", help="internal: one run, its result as JSON on the last line")
    a = parser.parse_args()
    if a.one:
        partial, workers = json.loads(a.one)
        with tempfile.TemporaryDirectory() as out:
            print(json.dumps(run(partial, workers, a.steps, a.median, out)))
        return
    import subprocess

    rows = []
    for workers in a.workers:
        for partial in (False, True):  # each run in a process of its own: nothing carries over
            done = subprocess.run([sys.executable, __file__, "--steps", str(a.steps), "--median", str(a.median),
                                   "--one", json.dumps([partial, workers])], capture_output=True, text=True)
            if done.returncode:
                sys.exit(done.stderr[-3000:])
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    print(machine())
    print(f"| rollout_workers | partial_rollouts | learner idle (s, steps 2-{a.steps}) | wall s/step | learner s/step "
          "| mean length | token staleness | straddling | in flight | restarted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        extra = [f"{r[k]:.2f}" if k in r else "—" for k in (
            "sample/token_staleness_mean", "sample/partial_straddling_frac", "sample/partial_in_flight",
            "sample/partial_restarted_total")]
        print(f"| {r['rollout_workers']} | {r['partial_rollouts']} | {r['learner_idle_s']:.1f} | "
              f"{r['wall_s_per_step']:.2f} | {r['learner_step_s']:.2f} | {r['mean_length']:.1f} | "
              + " | ".join(extra) + " |")


if __name__ == "__main__":
    main()
