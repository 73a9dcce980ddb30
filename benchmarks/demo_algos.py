"""Does ``grpokit demo --algo X`` learn, for every algorithm? Each recipe of the loss registry runs the demo (the
embedded SmolLM2-135M-Instruct, the arithmetic task, the demo's recipe with the algorithm's own settings) for a fixed
number of optimizer steps, then is evaluated greedily on the 128 held-out questions; the base model is measured
once. An algorithm "learns" when the lower end of its accuracy's 95% interval is above the upper end of the base
model's.

    python benchmarks/demo_algos.py run --steps 12            # resumable: finished runs are skipped
    python benchmarks/demo_algos.py run --steps 12 --algos grpo vespo
    python benchmarks/demo_algos.py summarize                 # the markdown table (benchmarks/demo_runs.md holds it)

A fixed step budget rather than a wall-clock one: what each algorithm is given does not depend on what else the
machine is doing. Results: runs/demo_algos/<algo>-seed<seed>-<steps>steps/ (runs of several budgets side by side).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "demo_algos"


def recipes() -> dict[str, dict]:
    sys.path.insert(0, str(ROOT))
    from grpokit.run.job import algorithms

    return algorithms()


def spec(algo: str, seed: int, steps: int, out: Path, eval_before: bool) -> dict:
    from grpokit.cli import demo_spec

    job = demo_spec(algo)  # what `grpokit demo --algo X` runs, the dtype included
    job.update(output_dir=str(out), seed=seed, max_steps=steps)
    job.pop("time_budget_s", None)
    job["eval"] = {**job["eval"], "before": eval_before, "every_steps": None}
    return job


def run(steps: int, seed: int, algos: list[str]) -> None:
    from grpokit.run.job import run_job

    for algo in algos:
        out = RUNS / f"{algo}-seed{seed}-{steps}steps"
        if (out / "report.json").is_file():
            continue
        first = not any(p.is_file() for p in RUNS.glob(f"*-seed{seed}-*/report.json"))
        print(f"== {out.name}", flush=True)
        run_job(spec(algo, seed, steps, out, eval_before=first), quiet=True, overwrite=True)


def summarize() -> str:
    reports = {p.parent.name: json.loads(p.read_text()) for p in RUNS.glob("*/report.json")}
    reports = dict(sorted(reports.items(), key=lambda kv: (kv[0].split("-seed", 1)[0], kv[1]["config"].get("steps"))))
    base = next((r["eval_before"] for r in reports.values() if (r.get("eval_before") or {}).get("accuracy")
                 is not None), None)
    lines = []
    if base is not None:
        lo, hi = base["accuracy_ci95"]
        lines.append(f"Base model: {base['accuracy']:.1%} ({lo:.1%}–{hi:.1%}), n={base['n']}.\n")
    lines += ["| algorithm | steps | held-out accuracy after (95% CI) | learns (interval above the base's) | "
              "wall time |", "|---|---|---|---|---|"]
    for name, r in reports.items():
        after = r.get("eval_after") or {}
        if after.get("accuracy") is None:
            continue
        lo, hi = after["accuracy_ci95"]
        learns = "—" if base is None else ("yes" if lo > base["accuracy_ci95"][1] else "**no**")
        minutes = r.get("wall_time_s", 0) / 60
        lines.append(f"| {name.split('-seed', 1)[0]} | {r['config'].get('steps')} | {after['accuracy']:.1%} "
                     f"({lo:.1%}–{hi:.1%}) | {learns} | {minutes:.1f} min |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--steps", type=int, default=12)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--algos", nargs="*", default=None, help="default: every recipe")
    sub.add_parser("summarize")
    ns = parser.parse_args(argv)
    if ns.cmd == "run":
        names = list(recipes())
        unknown = sorted(set(ns.algos or []) - set(names))
        if unknown:
            parser.error(f"--algos {unknown} is not allowed: expected some of {', '.join(names)}")
        run(ns.steps, ns.seed, ns.algos or names)
    print(summarize())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
