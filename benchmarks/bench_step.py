"""One GRPO step on SmolLM2-135M, grpokit's GRPOTrainer vs TRL 1.16's, each in its own subprocess, alternated.

8 completions per step (2 prompts × G=4), exactly 48 new tokens each (``min_new_tokens``), fp32 (``--dtype``), no gradient
checkpointing, loss dapo, beta 0, the same seed, weights and prompts (no shuffling) for both.

    python benchmarks/bench_step.py                 # 2 alternated runs per side, writes RESULTS.md
    python benchmarks/bench_step.py --runs 1 --steps 4 --no-write
    python benchmarks/bench_step.py --child grpokit --steps 4   # one side, prints JSON
    python benchmarks/bench_step.py --lora --dtype bfloat16     # the demo's setting: LoRA r16 on bf16 weights

Per step it records wall time and where it went: ``generate`` (TRL: the model's ``generate``; grpokit: its rollout
backend's ``generate`` and the ``generation_batch`` context the trainer holds around a batch's generation calls:
prefill, LoRA fold or merge and weight packing included), ``forward`` (the
trainer's ``compute_loss``: log-probs + loss), ``backward`` (``accelerator.backward``) and ``rest`` (rewards,
tokenising, optimizer, bookkeeping). The first step is warm-up and not counted. ``GRPOKIT_SRC`` points the
grpokit child at another checkout (e.g. the code before a change) to compare rewards and profiles.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS, G, NEW_TOKENS = 8, 4, 48


def child(side: str, steps: int, seed: int, threads: int = 0, lora: bool = False, dtype: str = "float32",
          rollout_precision: str = "auto") -> dict:
    sys.path.insert(0, os.environ.get("GRPOKIT_SRC") or os.path.dirname(HERE))
    import torch

    if threads:
        torch.set_num_threads(threads)
    import transformers
    from datasets import Dataset

    from grpokit.models import load_model, load_tokenizer
    from grpokit.rewards import correctness, format_reward
    from grpokit.tasks import get_task

    torch.manual_seed(seed)
    task = get_task("arithmetic", seed=0)
    rows = list(task.train_dataset)[:64]
    dataset = Dataset.from_list(rows)
    model = load_model("smollm2-135m-instruct", dtype=dtype)
    tok = load_tokenizer("smollm2-135m-instruct")
    common = dict(
        output_dir=f"/tmp/bench_step_{side}", per_device_train_batch_size=ROWS, num_generations=G,
        max_completion_length=NEW_TOKENS, generation_kwargs={"min_new_tokens": NEW_TOKENS}, max_steps=steps,
        learning_rate=1e-5, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=seed,
        gradient_checkpointing=False, bf16=False, shuffle_dataset=False, disable_tqdm=True, temperature=1.0,
        loss_type="dapo", beta=0.0,
    )
    if side == "trl":
        from trl import GRPOConfig, GRPOTrainer

        # TRL 1.16 on transformers 5 rejects warmup_ratio and needs gradient_checkpointing=False (set above)
    else:
        from grpokit import GRPOConfig, GRPOTrainer

        common["rollout_precision"] = rollout_precision
    peft = None
    if lora:
        from peft import LoraConfig

        peft = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[correctness, format_reward], args=GRPOConfig(**common),
                          train_dataset=dataset, processing_class=tok, peft_config=peft)

    spent = {"generate": 0.0, "forward": 0.0, "backward": 0.0}

    def timed(key, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0
        return wrapper

    def timed_context(key, enter):
        @contextlib.contextmanager
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            with enter(*a, **k):
                spent[key] += time.perf_counter() - t0
                yield
                t0 = time.perf_counter()
            spent[key] += time.perf_counter() - t0
        return wrapper

    if side == "trl":  # the model's generate
        cls = type(model)
        cls.generate = timed("generate", cls.generate)
    else:  # the rollout backend's (grpokit's decode loop does not call the model's generate), and its
        cls = type(trainer.rollout)  # generation_batch context around a batch's calls (LoRA fold, weight packing)
        cls.generate = timed("generate", cls.generate)
        if hasattr(cls, "generation_batch"):  # (an older checkout with --before may lack it)
            cls.generation_batch = timed_context("generate", cls.generation_batch)
    trainer.compute_loss = timed("forward", trainer.compute_loss)
    trainer.accelerator.backward = timed("backward", trainer.accelerator.backward)

    records = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            for k in spent:
                spent[k] = 0.0
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            wall = time.perf_counter() - self.t0
            records.append({"wall": wall, **spent, "rest": wall - sum(spent.values())})

    trainer.add_callback(Clock())
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    lengths = [h.get("completions/mean_length") for h in trainer.state.log_history if "reward" in h]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"side": side, "steps": records, "rewards": rewards, "mean_length": lengths, "peak_rss_mb": peak_mb}


def run_child(side: str, steps: int, seed: int, before: str | None = None, threads: int = 0, lora: bool = False,
              dtype: str = "float32", rollout_precision: str = "auto") -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if side == "grpokit-before":
        env["GRPOKIT_SRC"] = before
    child_side = "grpokit" if side.startswith("grpokit") else side
    if "@" in side:  # grpokit@float32: grpokit with that rollout_precision
        rollout_precision = side.split("@", 1)[1]
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", child_side, "--steps", str(steps),
                          "--seed", str(seed), "--threads", str(threads), "--dtype", dtype,
                          "--rollout-precision", rollout_precision]
                         + (["--lora"] if lora else []), capture_output=True, text=True, env=env,
                         cwd=HERE)
    if out.returncode != 0:
        raise RuntimeError(f"{side} child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(results: list[dict]) -> dict:
    steps = [s for r in results for s in r["steps"][1:]]  # first step of each run is warm-up
    med = {k: statistics.median(s[k] for s in steps) for k in ("wall", "generate", "forward", "backward", "rest")}
    return {**med, "tok_s": ROWS * NEW_TOKENS / med["wall"], "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
            "n": len(steps), "rewards": [r["rewards"] for r in results]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--sides", default="grpokit,trl", help="comma-separated: grpokit, trl, and grpokit@P for grpokit "
                    "with rollout_precision P")
    ap.add_argument("--before", help="a checkout of grpokit before a change: adds the side 'grpokit-before'")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per child (0: torch's default)")
    ap.add_argument("--lora", action="store_true", help="LoRA r16/α32 on every linear layer (the demo's), both sides")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the weights' dtype")
    ap.add_argument("--rollout-precision", default="auto", choices=["auto", "float32", "bf16", "int8"],
                    help="grpokit's rollout_precision (its sampler then corrects the mismatch; TRL samples as it trains)")
    ap.add_argument("--save", help="append every run's JSON to this file")
    ap.add_argument("--load", help="summarize the runs saved in this file (with --save) instead of running")
    ap.add_argument("--command", help="with --load: the command that produced the saved runs, for RESULTS.md")
    args = ap.parse_args()
    if args.child:
        res = child(args.child, args.steps, args.seed, args.threads, args.lora, args.dtype, args.rollout_precision)
        res["side"] = "grpokit-before" if os.environ.get("GRPOKIT_SRC") else args.child
        print(json.dumps(res))
        return
    sides = args.sides.split(",") + (["grpokit-before"] if args.before else [])
    results = {s: [] for s in sides}
    if args.load:
        for line in open(args.load):
            res = json.loads(line)
            results.setdefault(res["side"], []).append(res)
        results = {s: v for s, v in results.items() if v}
    for r in range(0 if args.load else args.runs):
        for side in (sides if r % 2 == 0 else list(reversed(sides))):
            res = run_child(side, args.steps, args.seed, args.before, args.threads, args.lora, args.dtype,
                            args.rollout_precision)
            res["side"] = side
            results[side].append(res)
            if args.save:
                with open(args.save, "a") as f:
                    f.write(json.dumps(res) + "\n")
            print(side, json.dumps({k: v for k, v in res.items() if k != "steps"}),
                  [round(s["wall"], 2) for s in res["steps"]], flush=True)
    summ = {s: summarize(v) for s, v in results.items()}
    lines = ["| | step s (median) | generate s | forward s | backward s | rest s | completion tok/s | peak RSS MB |",
             "|---|---|---|---|---|---|---|---|"]
    for s, v in summ.items():
        lines.append(f"| {s} | {v['wall']:.2f} | {v['generate']:.2f} | {v['forward']:.2f} | {v['backward']:.2f} | "
                     f"{v['rest']:.2f} | {v['tok_s']:.1f} | {v['peak_rss_mb']:.0f} |")
    text = "\n".join(lines)
    if "grpokit" in summ and "trl" in summ:
        g, t = summ["grpokit"], summ["trl"]
        runs = len(g["rewards"])
        text += (f"\n\ngrpokit / TRL: {g['tok_s'] / t['tok_s']:.2f}× completion tokens/s (target ≥ 1.3×), "
                 f"{g['peak_rss_mb'] / t['peak_rss_mb']:.2f}× peak RSS (target ≤ 0.8×). {runs} alternated "
                 f"runs per side, first step of each run not counted ({g['n']} steps per side); torch threads: "
                 f"{args.threads or 'default'}.")
    text += "\n\nRewards per step, by run: " + "; ".join(f"{s}: {v['rewards']}" for s, v in summ.items())
    print(text)
    if not args.no_write:
        sys.path.insert(0, HERE)
        from _common import write_section

        command = "python benchmarks/bench_step.py " + " ".join(sys.argv[1:])
        if args.load:  # write_section adds the outer quotes
            command = f"{args.command or command}` (runs saved with `--save`), summarised with `--load"
        setting = ", ".join(([] if not args.lora else ["LoRA r16"]) + ([] if args.dtype == "float32" else [args.dtype])
                            + ([] if args.rollout_precision == "auto" else
                               [f"grpokit sampling in {args.rollout_precision}"]))
        write_section("GRPO step on SmolLM2-135M" + (f" ({setting})" if setting else ""), command.strip(), text)


if __name__ == "__main__":
    main()
