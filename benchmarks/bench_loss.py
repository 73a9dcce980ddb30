"""Loss forward+backward per call, grpokit ``policy_loss`` vs TRL 1.16 ``GRPOTrainer._compute_loss``, on the same
precomputed log-probs (only the loss math is timed), with identical values checked first.

    python benchmarks/bench_loss.py            # full grid, writes the "Loss per call" section of RESULTS.md
    python benchmarks/bench_loss.py --quick    # 8×128 only, no write
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("GRPOKIT_SRC") or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from _common import interleaved, paired, trl_loss_fn, write_section  # noqa: E402

from grpokit.algorithms import policy_loss  # noqa: E402

GRID = [(8, 128), (32, 512), (128, 512), (128, 1024)]
ALGOS = {  # name: (loss_type, importance_sampling_level)
    "vespo": ("vespo", "token"),
    "gspo": ("grpo", "sequence"),
    "dapo": ("dapo", "token"),
}


def make_inputs(B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g) * 4
    old = logps + 0.1 * torch.randn(B, T, generator=g)  # off-policy: ratios ≠ 1, clipping active
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    adv = torch.randn(B, generator=g)
    ent = torch.rand(B, T, generator=g) * 3
    return logps, old, adv, mask, ent


def bench_point(algo: str, B: int, T: int):
    loss_type, level = ALGOS[algo]
    logps, old, adv, mask, ent = make_inputs(B, T)
    n_items = mask.sum()
    x_g = logps.clone().requires_grad_(True)
    x_t = logps.clone().requires_grad_(True)

    def grpokit_call():
        x_g.grad = None
        out = policy_loss(x_g, old, adv, mask, loss_type=loss_type, importance_sampling_level=level,
                          entropies=ent, num_items_in_batch=n_items, max_completion_length=T)
        out.loss.backward()
        return out

    trl = trl_loss_fn(loss_type, level, T)
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": old, "num_items_in_batch": n_items.float()}

    def trl_call():
        x_t.grad = None
        loss, metrics = trl(x_t, ent, inputs)
        loss.backward()
        return loss, metrics

    out = grpokit_call()
    loss_t, metrics_t = trl_call()
    torch.testing.assert_close(out.loss, loss_t, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x_g.grad, x_t.grad, rtol=1e-6, atol=1e-9)
    for key in set(out.metrics) & set(metrics_t):
        torch.testing.assert_close(float(out.metrics[key]), float(metrics_t[key][-1]), rtol=1e-5, atol=1e-6)
    g, t, ratio = paired(interleaved({"grpokit": grpokit_call, "trl": trl_call}), "grpokit", "trl")
    return g, t, ratio, float(out.loss.detach())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (default 1: on a shared 2-core machine a preempted OpenMP thread stalls "
                         "every parallel op; one thread keeps both sides' timings stable)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    grid = GRID[:1] if args.quick else GRID
    rows = ["| B×T | algorithm | grpokit µs | TRL µs | speed-up (TRL / grpokit) | loss (identical) |",
            "|---|---|---|---|---|---|"]
    worst = float("inf")
    for B, T in grid:
        for algo in ALGOS:
            g, t, ratio, value = bench_point(algo, B, T)
            worst = min(worst, ratio)
            rows.append(f"| {B}×{T} | {algo} | {g * 1e6:.0f} | {t * 1e6:.0f} | {ratio:.2f}× | {value:.6f} |")
            print(rows[-1], flush=True)
    summary = (f"Lowest speed-up over the grid: {worst:.2f}× (target ≥ 1.5×). Times are medians over 9 interleaved "
               "rounds; the speed-up is the median of the per-round ratios. Loss values, gradients and the shared "
               "metrics were checked equal (rtol 1e-6) before timing. Off-policy inputs (old ≠ current log-probs), "
               f"ragged lengths, float32, {args.threads} intra-op thread(s); TRL's time includes its metric "
               "bookkeeping (`.item()` calls), grpokit's returns metric tensors.")
    print(summary)
    if not (args.quick or args.no_write or os.environ.get("GRPOKIT_SRC")):
        write_section("Loss per call", "python benchmarks/bench_loss.py", "\n".join(rows) + "\n\n" + summary)


if __name__ == "__main__":
    main()
