"""Peak memory (and time) of per-token log-probs + entropy + backward from final hidden states,
B×T×V = 16×512×49152, hidden 576 (SmolLM2-135M's head), float32, the head weight trainable (tied embeddings).

Each variant runs in a fresh subprocess; peak RSS is ``ru_maxrss`` of that process, and "added" is the peak
minus the RSS just before the computation (inputs, weight and the weight's gradient buffer already allocated).

    python benchmarks/bench_logprobs_memory.py          # writes the "Log-prob memory" section of RESULTS.md
    python benchmarks/bench_logprobs_memory.py --child chunked

Variants:
- ``chunked``: grpokit's ``linear_logps_and_entropy`` (online log-sum-exp over vocabulary tiles, recomputed in
  backward; no (B, T, V) tensor).
- ``materialised``: the logits ``h·Wᵀ`` (B, T, V), then grpokit's previous row-chunked log-softmax
  (``token_logps_and_entropy``), i.e. the path before this change.
- ``trl_logits``: the logits, then TRL's ``selective_log_softmax`` + ``entropy_from_logits`` (entropy without
  gradient, as a metric).
- ``trl_fused``: TRL 1.16's own chunked head (``trl.kernels.ChunkedLogProbFunction``, what its GRPOTrainer
  uses through ``add_fused_lm_head``), for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
B, T, V, H = 16, 512, 49152, 576
VARIANTS = ("chunked", "materialised", "trl_logits", "trl_fused")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(variant: str) -> dict:
    sys.path.insert(0, os.path.dirname(HERE))
    import torch

    torch.manual_seed(0)
    hidden = torch.randn(B, T, H, requires_grad=True)
    weight = (torch.randn(V, H) * 0.05).requires_grad_(True)
    targets = torch.randint(0, V, (B, T))
    weight.grad = torch.zeros_like(weight)  # the gradient buffer exists in training anyway
    hidden.grad = torch.zeros_like(hidden)
    coef = torch.randn(B, T)

    if variant == "chunked":
        from grpokit.forward.logprobs import linear_logps_and_entropy

        def run():
            lp, ent = linear_logps_and_entropy(hidden, weight, targets)
            return lp, ent
    elif variant == "materialised":
        from grpokit.forward.logprobs import token_logps_and_entropy

        def run():
            logits = hidden @ weight.t()
            return token_logps_and_entropy(logits, targets)
    elif variant == "trl_logits":
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax

        def run():
            logits = hidden @ weight.t()
            lp = selective_log_softmax(logits, targets)
            with torch.no_grad():
                ent = entropy_from_logits(logits)
            return lp, ent
    elif variant == "trl_fused":
        from trl.kernels import ChunkedLogProbFunction

        def run():
            out = ChunkedLogProbFunction.apply(hidden.reshape(-1, H), weight, None, targets.reshape(-1), 1.0, 32768,
                                               None, 1.0, ("log_probs", "entropy"))
            return out[0].view(B, T), out[1].view(B, T)
    else:
        raise ValueError(variant)

    base = _rss_mb()
    t0 = time.perf_counter()
    lp, ent = run()
    (lp * coef).sum().backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": variant, "peak_mb": peak, "base_mb": base, "added_mb": peak - base, "seconds": seconds,
            "lp_sum": float(lp.detach().double().sum()), "ent_sum": float(ent.detach().double().sum()),
            "grad_w_norm": float(weight.grad.norm()), "grad_h_norm": float(hidden.grad.norm())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    res = {}
    for v in args.variants.split(","):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", v], capture_output=True,
                             text=True, cwd=HERE)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-3000:])
        res[v] = json.loads(out.stdout.strip().splitlines()[-1])
        print(res[v], flush=True)
    ref = res.get("materialised")
    lines = ["| variant | peak RSS MB | added over inputs MB | added / materialised | fwd+bwd s | Σ log-prob | Σ entropy "
             "| ‖∂W‖ |", "|---|---|---|---|---|---|---|---|"]
    for v, r in res.items():
        ratio = f"{r['added_mb'] / ref['added_mb']:.3f}" if ref else "-"
        lines.append(f"| {v} | {r['peak_mb']:.0f} | {r['added_mb']:.0f} | {ratio} | {r['seconds']:.2f} | "
                     f"{r['lp_sum']:.3f} | {r['ent_sum']:.3f} | {r['grad_w_norm']:.5f} |")
    text = "\n".join(lines)
    text += (f"\n\nB×T×V = {B}×{T}×{V}, hidden {H}, float32; one (B, T, V) float32 tensor is "
             f"{B * T * V * 4 / 2**20:.0f} MB. Inputs, weight and gradient buffers take the same memory in every "
             "variant (the base); \"added\" is what the computation itself needs. Target: chunked ≤ 1/8 of materialised.")
    print(text)
    if not args.no_write:
        sys.path.insert(0, HERE)
        from _common import write_section

        write_section("Log-prob memory", "python benchmarks/bench_logprobs_memory.py", text)


if __name__ == "__main__":
    main()
