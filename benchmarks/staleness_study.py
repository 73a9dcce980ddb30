"""How stale can rollouts be? GRPO, DAPO and VESPO on the embedded SmolLM2-135M-Instruct (arithmetic task, the
demo's LoRA recipe, CPU), with every generation batch produced by weights exactly ``s`` optimizer steps old
(``max_staleness=s, staleness_mode="exact"``) for s in 0, 2, 4, 8, a fixed number of steps per run (exact
staleness costs the same per step at every s, so a fixed step budget is a fixed compute budget, and unlike a
wall-clock budget it does not depend on what else the machine is doing), several seeds.

    python benchmarks/staleness_study.py run --steps 48 --seeds 0 1 2      # resumable: finished runs are skipped
    python benchmarks/staleness_study.py summarize                         # prints the table; plot: docs/staleness.png

Each run trains from the same base model and evaluates greedily on the task's 128 held-out questions after
training (the base model's accuracy is measured once). Results: runs/staleness/<loss>-s<s>-seed<seed>/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "staleness"
LOSSES = {"grpo": {"loss_type": "grpo"},
          "dapo": {"loss_type": "dapo", "epsilon_high": 0.28},
          "vespo": {"loss_type": "vespo"}}
STALENESS = (0, 2, 4, 8)


def spec(loss: str, s: int, seed: int, steps: int, out: Path, eval_before: bool) -> dict:
    sys.path.insert(0, str(ROOT))
    from grpokit.cli import DEMO_SPEC

    spec = dict(DEMO_SPEC)
    # the recipe the study started with (the demo's until it moved to 4 questions a step with dynamic sampling)
    spec.update(per_device_train_batch_size=8, max_completion_length=48, learning_rate=1e-4, temperature=0.7,
                dynamic_sampling=False)
    spec.update(LOSSES[loss])
    spec.update(output_dir=str(out), seed=seed, max_steps=steps, max_staleness=s, staleness_mode="exact",
                logging_steps=1)
    spec.pop("time_budget_s", None)
    spec["eval"] = {**spec["eval"], "before": eval_before}
    return spec


def run(steps: int, seeds: list[int], losses: list[str], staleness: list[int], eval_n: int = 128) -> None:
    from grpokit.run.job import run_job

    for seed in seeds:
        for s in staleness:
            for loss in losses:
                out = RUNS / f"{loss}-s{s}-seed{seed}"
                if (out / "report.json").is_file():
                    continue
                first = not any((RUNS / f"{lo}-s{st}-seed{seed}" / "report.json").is_file()
                                for lo in LOSSES for st in STALENESS)
                print(f"== {out.name}", flush=True)
                job = spec(loss, s, seed, steps, out, eval_before=first)
                job["eval"]["n"] = eval_n
                run_job(job, quiet=True)


def _accuracy(report: dict, key: str) -> float | None:
    ev = report.get(key) or {}
    return ev.get("accuracy")


def summarize() -> str:
    rows = {}
    before = []
    for path in sorted(RUNS.glob("*/report.json")):
        loss, s, seed = path.parent.name.split("-")
        report = json.loads(path.read_text())
        if _accuracy(report, "eval_before") is not None:
            before.append(_accuracy(report, "eval_before"))
        curve = [json.loads(line) for line in (path.parent / "metrics.jsonl").read_text().splitlines() if line]
        rewards = [r["reward"] for r in curve if "reward" in r]
        rows.setdefault((loss, int(s[1:])), []).append({"acc": _accuracy(report, "eval_after"), "rewards": rewards,
                                                        "seed": int(seed[4:]),
                                                        "ci": (report.get("eval_after") or {}).get("accuracy_ci95")})
    lines = ["| loss | staleness | held-out accuracy after | seeds | mean reward, last 10 steps |",
             "|---|---|---|---|---|"]
    for (loss, s), runs in sorted(rows.items(), key=lambda kv: (list(LOSSES).index(kv[0][0]), kv[0][1])):
        accs = [r["acc"] for r in runs if r["acc"] is not None]
        last = [statistics.mean(r["rewards"][-10:]) for r in runs if r["rewards"]]
        if len(accs) > 1:
            acc = f"{statistics.mean(accs):.1%} ± {statistics.stdev(accs):.1%} (sd over seeds)"
        else:  # one seed: its own 95% interval (128 questions)
            lo, hi = runs[0]["ci"] or (float("nan"), float("nan"))
            acc = f"{accs[0]:.1%} (95% CI {lo:.1%}–{hi:.1%})"
        lines.append(f"| {loss} | {s} | {acc} | {len(accs)} | {statistics.mean(last):.3f} |")
    text = "\n".join(lines)
    if before:
        text += f"\n\nBase model before training: {statistics.mean(before):.1%} (greedy, 128 held-out questions)."
    _plot(rows)
    return text


def _plot(rows: dict) -> None:
    """Left: held-out accuracy against staleness (error bars: sd over seeds, or one seed's 95% interval). Right: the
    training reward, a moving mean over 8 steps (one prompt a step makes the raw curve mostly noise), at staleness 0
    and 8."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip(LOSSES, ("tab:blue", "tab:orange", "tab:green")))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for loss in LOSSES:
        cells = sorted((s, runs) for (lo, s), runs in rows.items() if lo == loss)
        if not cells:
            continue
        xs, means, err = [], [], [[], []]
        for s, runs in cells:
            accs = [r["acc"] for r in runs if r["acc"] is not None]
            mean = statistics.mean(accs)
            if len(accs) > 1:
                lo = hi = statistics.stdev(accs)
            else:
                ci = runs[0]["ci"] or (mean, mean)
                lo, hi = mean - ci[0], ci[1] - mean
            xs.append(s)
            means.append(mean)
            err[0].append(lo)
            err[1].append(hi)
        ax1.errorbar(xs, means, yerr=err, marker="o", capsize=3, label=loss, color=colours[loss])
        for s, runs in cells:
            if s not in (0, 8):
                continue
            curves = [r["rewards"] for r in runs if r["rewards"]]
            n = min(map(len, curves))
            mean_curve = [statistics.mean(c[i] for c in curves) for i in range(n)]
            smooth = [statistics.mean(mean_curve[max(0, i - 7):i + 1]) for i in range(n)]
            ax2.plot(range(1, n + 1), smooth, label=f"{loss}, staleness {s}", color=colours[loss],
                     linestyle="-" if s == 0 else "--")
    ax1.set(xlabel="staleness (optimizer steps)", ylabel="held-out accuracy after training", xticks=list(STALENESS))
    ax2.set(xlabel="step", ylabel="training reward (moving mean, 8 steps)")
    ax1.legend()
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "staleness.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--steps", type=int, default=48)
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--losses", nargs="+", default=list(LOSSES))
    r.add_argument("--staleness", type=int, nargs="+", default=list(STALENESS))
    r.add_argument("--eval-n", type=int, default=128)
    r.add_argument("--out", help="where the runs go (default runs/staleness)")
    sm = sub.add_parser("summarize")
    sm.add_argument("--out", help="where the runs are (default runs/staleness)")
    args = ap.parse_args()
    global RUNS
    if getattr(args, "out", None):
        RUNS = Path(args.out)
    if args.cmd == "run":
        run(args.steps, args.seeds, args.losses, args.staleness, args.eval_n)
    else:
        print(summarize())


if __name__ == "__main__":
    main()
