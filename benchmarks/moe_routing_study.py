"""Routing replay, measured small: does forcing the sampler's (R3) or the old pass's (R2) experts change what a
Mixture-of-Experts policy learns when its rollouts run in bf16 and its training in float32 (so routes flip)?

A tiny Qwen3-MoE (4 layers, 8 experts, 2 a token, ~2M parameters, random init, a byte-level tokenizer) trains on the
built-in ``word_count`` task (graded ``length`` reward: how close the reply's word count is to the asked one) for a
fixed number of steps, with every completion sampled by a bf16 copy of the policy (refreshed after every optimizer
step; it records the experts it routes to and reports its own log-probs, as a rollout engine does) and the loss in
float32 with TRL 1.16's sampler correction (``vllm_importance_sampling_correction``, token_truncate). Each generation
batch serves two optimizer steps (``steps_per_generation=2``), so the second is off-policy and R2 has something to
replay. GRPO (token-level ratio) against GSPO (sequence-level ratio, its ε), each with ``routing_replay`` none / old /
rollout, three seeds.

    python benchmarks/moe_routing_study.py run --steps 40 --seeds 0 1 2   # resumable: finished runs are skipped
    python benchmarks/moe_routing_study.py summarize                      # the table; plot: docs/moe_routing.png
    python benchmarks/moe_routing_study.py overhead --rounds 10           # what replay and recording cost, side by side

Results: runs/moe_routing/<algo>-<replay>-seed<seed>/metrics.json (one dict of lists per run).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "moe_routing"
ALGOS = {"grpo": dict(loss_type="grpo", importance_sampling_level="token"),
         "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4)}
REPLAYS = ("none", "old", "rollout")
ROUTING_KEYS = ("moe/rerouted_share", "moe/rerouted_any_layer", "moe/ratio_std/rerouted", "moe/ratio_std/kept",
                "moe/policy_ratio_std/rerouted", "moe/policy_ratio_std/kept")
KEYS = ("reward", *ROUTING_KEYS, "moe/load_imbalance", "sampling/sampling_logp_difference/mean", "clip_ratio/region_mean",
        "step_time")


def _imports():
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))


def tiny_moe(tok, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=512, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def bf16_engine(tok):
    """grpokit's transformers backend as an engine of its own: a bf16 copy of the policy that samples (recording its
    experts) and scores what it sampled (its own log-probs, full vocabulary at the temperature)."""
    import torch

    from grpokit.forward.logprobs import completion_logps
    from grpokit.rollout.transformers_backend import TransformersRollout

    class Bf16Engine(TransformersRollout):
        holds_weights = True

        def __init__(self, tokenizer, temperature: float):
            super().__init__(tokenizer)
            self.copy, self.temperature = None, temperature

        def sync_weights(self, model):
            with torch.no_grad():
                if self.copy is None:
                    self.copy = copy.deepcopy(model).to(torch.bfloat16).eval().requires_grad_(False)
                    return
                mine = dict(self.copy.named_parameters())
                for name, p in model.named_parameters():
                    mine[name].copy_(p)

        def generation_batch(self, model):  # the copy packs its weights in each generate call: syncs land in it
            return contextlib.nullcontext()

        def generate(self, model, prompt_ids, prompt_mask, params, **kw):
            if self.copy is None:
                self.sync_weights(model)
            gen = super().generate(self.copy, prompt_ids, prompt_mask, params, **kw)
            with torch.no_grad():
                gen.sampler_logps = completion_logps(self.copy, prompt_ids, prompt_mask, gen.completion_ids,
                                                     gen.completion_mask, temperature=self.temperature,
                                                     compute_entropy=False)[0].float()
            return gen

    return Bf16Engine(tok, temperature=1.0)


def train_one(algo: str, replay: str, seed: int, steps: int, out: Path) -> dict:
    _imports()
    from tiny import tiny_tokenizer

    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.tasks import get_task

    tok = tiny_tokenizer()
    task = get_task("word_count", seed=0)
    args = GRPOConfig(
        output_dir=str(out / "trainer"), per_device_train_batch_size=16, num_generations=4, steps_per_generation=2,
        max_completion_length=32, max_steps=steps, learning_rate=1e-3, temperature=1.0, beta=0.0, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, seed=seed, disable_tqdm=True, gradient_checkpointing=False,
        routing_replay=replay, **ALGOS[algo])
    trainer = GRPOTrainer(tiny_moe(tok, seed), task.reward_funcs, args=args, train_dataset=task.train_dataset,
                          processing_class=tok, rollout_backend=bf16_engine(tok))
    trainer.train()
    if trainer.state.global_step < steps:  # stopped by SIGINT/SIGTERM (the trainer saved and stopped): so does the study
        raise SystemExit(f"{out.name} stopped at step {trainer.state.global_step} of {steps}")
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = {key: [h.get(key) for h in logs] for key in KEYS + ("rewards/length/mean",)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(result))
    return result


def run(args) -> None:
    for seed in args.seeds:
        for algo in ALGOS:
            for replay in REPLAYS:
                out = RUNS / f"{algo}-{replay}-seed{seed}"
                if (out / "metrics.json").exists():
                    continue
                start = time.perf_counter()
                result = train_one(algo, replay, seed, args.steps, out)
                print(f"{out.name}: {time.perf_counter() - start:.0f} s, reward {_mean(result['reward'][-10:]):.3f}",
                      flush=True)


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else float("nan")


def _phase(values: list, sampled: list[bool], first: bool) -> list:
    """The values of the steps that began a generation batch (``first``: the sampler's weights are the trainer's, up
    to bf16) or of those that reused it (one optimizer step later)."""
    return [v for v, s in zip(values, sampled) if s == first and v is not None]


def summarize(args) -> None:
    rows, curves = [], {}
    for algo in ALGOS:
        for replay in REPLAYS:
            runs = [json.loads(p.read_text()) for p in sorted(RUNS.glob(f"{algo}-{replay}-seed*/metrics.json"))]
            if not runs:
                continue
            stats: dict[str, list[float]] = {}
            for r in runs:
                sampled = [v is not None for v in r["reward"]]  # rewards are logged where a batch was generated
                rewards = [v for v in r["reward"] if v is not None]
                add = {"first": _mean(rewards[:5]), "last": _mean(rewards[-10:])}
                for phase, first in (("fresh", True), ("reused", False)):
                    for key in ROUTING_KEYS:
                        add[f"{phase} {key}"] = _mean(_phase(r[key], sampled, first))
                for key, value in add.items():
                    stats.setdefault(key, []).append(value)
            rows.append((algo, replay, len(runs), stats))
            curves[(algo, replay)] = [[v for v in r["reward"] if v is not None] for r in runs]

    def cell(values):
        return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 \
            else f"{values[0]:.3f}"

    print("Rewards (mean ± std over seeds of each run's mean over its first 5 / last 10 generation batches):\n")
    print("| algorithm | replay | seeds | reward, first 5 batches | reward, last 10 batches |")
    print("|---|---|---|---|---|")
    for algo, replay, n, st in rows:
        print(f"| {algo} | {replay} | {n} | {cell(st['first'])} | {cell(st['last'])} |")
    for phase, title in (("fresh", "steps on a fresh batch (sampler = trainer's weights in bf16)"),
                         ("reused", "steps reusing the batch (one optimizer step later)")):
        print(f"\nRouting, {title}:\n")
        print("| algorithm | replay | re-routed share (mean of layers) | re-routed in some layer | π_θ/π_sampler "
              "std, re-routed | π_θ/π_sampler std, other | π_θ/π_old std, re-routed | π_θ/π_old std, other |")
        print("|---|---|---|---|---|---|---|---|")
        for algo, replay, _, st in rows:
            print(f"| {algo} | {replay} | " + " | ".join(cell(st[f"{phase} {k}"]) for k in ROUTING_KEYS) + " |")
    if curves:
        _plot(curves, ROOT / "docs" / "moe_routing.png")


def _plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors = {"none": "tab:gray", "old": "tab:blue", "rollout": "tab:red"}
    for ax, algo in zip(axes, ALGOS):
        for replay in REPLAYS:
            runs = curves.get((algo, replay))
            if not runs:
                continue
            steps = min(len(r) for r in runs)
            mean = [statistics.fmean(r[i] for r in runs) for i in range(steps)]
            window = 5
            smooth = [statistics.fmean(mean[max(0, i - window + 1):i + 1]) for i in range(steps)]
            ax.plot(range(1, steps + 1), smooth, color=colors[replay], label=f"replay {replay}")
        ax.set_title(f"{algo.upper()}: reward (mean of {len(runs)} seeds, moving average of 5)")
        ax.set_xlabel("generation batch (2 optimizer steps each)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward (word_count + length)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path.relative_to(ROOT)}")


def overhead(args) -> None:
    """What replay costs a training step, side by side on one batch: the forward and backward of the loss's log-probs
    over 64 rows (16 prompts × 4) of the tiny MoE, plain (no hooks), observed (what every MoE run does: the router's
    own choice compared with the recording, for the metrics) and replayed (the recording forced, gate weights
    recomputed), interleaved round by round, median of ``--rounds``; and what recording costs generation."""
    _imports()
    import torch
    from tiny import tiny_tokenizer

    from grpokit.forward.logprobs import completion_logps
    from grpokit.moe import RouteTap, find_routers
    from grpokit.rollout.base import SamplingParams
    from grpokit.rollout.transformers_backend import TransformersRollout
    from grpokit.tasks import get_task

    tok = tiny_tokenizer()
    model = tiny_moe(tok, 0)
    prompts = [tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
               for row in get_task("word_count", seed=0).train_dataset.select(range(16))]
    enc = tok([p for p in prompts for _ in range(4)], return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    backend = TransformersRollout(tok)
    params = SamplingParams(max_new_tokens=32, record_routes=True, extra={"min_new_tokens": 32})
    gen_times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.rounds + 1):
        for record in (False, True):
            torch.manual_seed(i)
            start = time.perf_counter()
            gen = backend.generate(model.eval(), ids, mask, dataclasses.replace(params, record_routes=record))
            if i:  # the first round warms up
                gen_times[record].append(time.perf_counter() - start)
    routes = torch.cat([gen.prompt_routes, gen.completion_routes], 1)
    routers = find_routers(model)
    model.train()
    taps = {"plain": lambda: contextlib.nullcontext(), "observed": lambda: RouteTap(routers, reference=routes),
            "replayed": lambda: RouteTap(routers, forced=routes, reference=routes)}
    times: dict[str, list[float]] = {name: [] for name in taps}
    for i in range(args.rounds + 1):
        for name, tap in taps.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            with tap():
                logps, _ = completion_logps(model, ids, mask, gen.completion_ids, gen.completion_mask)
                (logps * gen.completion_mask).sum().backward()
            if i:
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain"])
    for name in taps:
        med = statistics.median(times[name])
        print(f"training forward + backward, {name}: {med:.3f} s (median of {args.rounds}), {med / base:.3f}x plain")
    off, on = statistics.median(gen_times[False]), statistics.median(gen_times[True])
    print(f"generation, 64 rows x 32 tokens: {off:.3f} s without recording, {on:.3f} s with ({on / off:.3f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    sub.add_parser("summarize")
    o = sub.add_parser("overhead")
    o.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    {"run": run, "summarize": summarize, "overhead": overhead}[args.command](args)


if __name__ == "__main__":
    main()
