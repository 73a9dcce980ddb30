"""An independent plain-Python reading of docs/algorithms.md §1–§6 (no torch, no grpokit), for the tests.

Everything is lists of floats and the ``math`` module, written straight from the document's formulas so
that a wrong formula in ``grpokit.algorithms`` cannot hide behind a shared helper.

Stop-gradients: the reference takes two copies of the current log-probs, ``lp`` (the gradient path) and
``lp_sg`` (every ``sg[...]`` of docs/algorithms.md reads this one). They carry the same values; a central finite
difference in ``lp`` with ``lp_sg`` held fixed is then exactly the gradient autograd should give, including
for CISPO's and VESPO's detached weights. See :func:`fd_grad`.
"""

from __future__ import annotations

import math

CLAMP = 20.0
LOG_1E8 = math.log(1e-8)


def clamp(x: float, lo: float = -math.inf, hi: float = math.inf) -> float:
    return min(max(x, lo), hi)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy/torch default)."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    if abs(pos - round(pos)) < 1e-9:  # 1 - 0.7 = 0.30000000000000004: the exact quantile is the value itself
        pos = float(round(pos))
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _row_mean(x: list[float], m: list[float]) -> float:
    return sum(a * b for a, b in zip(x, m)) / max(1.0, sum(m))


def vespo_phi(d_row, m_row, a, rho_row=None, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0):
    """φ = W^k e^{λ(1-W)} with W the *sum* of masked clamped log-ratios (docs/algorithms.md §2 (VESPO))."""
    s = sum(m * clamp(d, -CLAMP, CLAMP) for d, m in zip(d_row, m_row))
    if rho_row is not None:
        s += sum(m * clamp(math.log(r) if r > 0 else -math.inf, LOG_1E8, CLAMP) for r, m in zip(rho_row, m_row))
    log_w = clamp(s, LOG_1E8, CLAMP)
    k, lam = (k_pos, lam_pos) if a >= 0 else (k_neg, lam_neg)
    lam = max(lam, 1e-4)
    try:
        phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
    except OverflowError:
        phi = 0.0
    return phi if math.isfinite(phi) else 0.0


def ref_policy_loss(
    lp, old, A, m, *, lp_sg=None, loss_type="dapo", level="token", epsilon=0.2, epsilon_high=None, delta=None,
    beta=0.0, ref=None, use_bias_correction_kl=False, sampler_ratio=None, entropies=None, top_entropy_quantile=1.0,
    off_policy_mask_threshold=None, sampler_logps=None, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
    vespo_lambda_neg=2.0, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, max_completion_length=None,
    num_items_in_batch=None, gradient_accumulation_steps=1, steps_per_generation=1, num_processes=1,
) -> float:
    """The micro-batch loss of docs/algorithms.md, for lists ``lp[B][T]`` etc. ``A`` is a list of B floats;
    ``sampler_ratio`` is ``[B][T]`` or ``[B][1]``."""
    B = len(lp)
    T = len(lp[0]) if B else 0
    lp_sg = lp if lp_sg is None else lp_sg
    old_v = lp_sg if old is None else old
    eps_lo = epsilon
    eps_hi = epsilon_high if epsilon_high is not None else (5.0 if loss_type == "cispo" else epsilon)

    # §1: token log-ratio (gradient path and detached copy), then the level's log weight.
    d = [[clamp(lp[i][t] - old_v[i][t], -CLAMP, CLAMP) for t in range(T)] for i in range(B)]
    d_sg = [[clamp(lp_sg[i][t] - old_v[i][t], -CLAMP, CLAMP) for t in range(T)] for i in range(B)]
    if level == "token":
        logw = d
    elif level == "sequence":
        logw = [[_row_mean(d[i], m[i])] * T for i in range(B)]
    elif level == "sequence_token":
        logw = [[_row_mean(d_sg[i], m[i]) + d[i][t] - d_sg[i][t] for t in range(T)] for i in range(B)]
    else:
        raise ValueError(level)

    token_rho = sampler_ratio is not None and T > 0 and len(sampler_ratio[0]) == T

    # §2: per-token loss ℓ, broadcast to B×T.
    ell = [[0.0] * T for _ in range(B)]
    for i in range(B):
        a = A[i]
        if loss_type == "gmpo":
            sgn = (a > 0) - (a < 0)
            dstar = [sgn * min(sgn * x, sgn * clamp(x, -eps_lo, eps_hi)) for x in d[i]]
            value = -a * math.exp(_row_mean(dstar, m[i]))
            ell[i] = [value] * T
            continue
        if loss_type == "vespo":
            rho_row = sampler_ratio[i] if (sampler_ratio is not None and token_rho) else None
            phi = vespo_phi(d_sg[i], m[i], a, rho_row, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
            ell[i] = [-phi * a * lp[i][t] for t in range(T)]
            continue
        for t in range(T):
            r = math.exp(logw[i][t])
            if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
                r2 = clamp(r, 1 - eps_lo, 1 + eps_hi)
                r1 = min(r, delta) if delta is not None else r
                ell[i][t] = -min(r1 * a, r2 * a)
            elif loss_type == "cispo":
                r_sg = math.exp(_sg_logw(level, d_sg, m, i, t))
                ell[i][t] = -min(r_sg, eps_hi) * a * lp[i][t]
            elif loss_type == "sapo":
                tau = sapo_temperature_pos if a > 0 else sapo_temperature_neg
                ell[i][t] = -sigmoid(tau * (r - 1)) * (4 / tau) * a
            else:
                raise ValueError(loss_type)

    # §6: masks, in order: off-policy sequence mask, high-entropy mask, sampler ratio.
    if off_policy_mask_threshold is not None:
        lp_s = sampler_logps if sampler_logps is not None else old_v
        for i in range(B):
            drift = _row_mean([lp_s[i][t] - lp_sg[i][t] for t in range(T)], m[i])
            if not (A[i] >= 0 or drift <= off_policy_mask_threshold):
                ell[i] = [0.0] * T
    if top_entropy_quantile < 1.0:
        valid = [entropies[i][t] for i in range(B) for t in range(T) if m[i][t]]
        if valid:
            thr = quantile(valid, 1.0 - top_entropy_quantile)
            keep = [[1.0 if (m[i][t] and entropies[i][t] >= thr) else 0.0 for t in range(T)] for i in range(B)]
        else:
            keep = [[0.0] * T for _ in range(B)]
        ell = [[ell[i][t] * keep[i][t] for t in range(T)] for i in range(B)]
    if sampler_ratio is not None and loss_type != "vespo":
        ell = [[ell[i][t] * (sampler_ratio[i][t] if len(sampler_ratio[i]) == T else sampler_ratio[i][0])
                for t in range(T)] for i in range(B)]

    # §4: + beta * k3 KL (bias correction with the token-level, non-detached ratio).
    if beta != 0.0:
        for i in range(B):
            for t in range(T):
                x = clamp(ref[i][t] - lp[i][t], -CLAMP, CLAMP)
                kl = math.exp(x) - x - 1
                if use_bias_correction_kl:
                    kl *= math.exp(d[i][t])
                ell[i][t] += beta * kl

    # §3: aggregation.
    ga = gradient_accumulation_steps
    row_sums = [sum(ell[i][t] * m[i][t] for t in range(T)) for i in range(B)]
    row_counts = [sum(m[i]) for i in range(B)]
    total = sum(row_sums)
    if loss_type in ("grpo", "sapo", "gmpo"):
        return (sum(s / max(1.0, c) for s, c in zip(row_sums, row_counts)) / B if B else 0.0) / ga
    if loss_type == "bnpo":
        return total / max(1.0, sum(row_counts)) / ga
    if loss_type == "dr_grpo":
        L = max_completion_length if max_completion_length is not None else T
        return total / (max(1, B) * L) / ga
    if loss_type in ("dapo", "cispo", "vespo"):
        n = sum(row_counts) if num_items_in_batch is None else float(num_items_in_batch)
        return total / (max(1.0, n) / num_processes * (ga / steps_per_generation))
    if loss_type == "luspo":
        return (total / B if B else 0.0) / ga
    raise ValueError(loss_type)


def _sg_logw(level, d_sg, m, i, t):
    if level == "token":
        return d_sg[i][t]
    return _row_mean(d_sg[i], m[i])


def fd_grad(lp, old, A, m, h=1e-6, **kw) -> list[list[float]]:
    """d loss / d lp by central differences on the gradient path, with every sg[...] held at ``lp``."""
    lp_sg = [row[:] for row in lp]
    grad = []
    for i in range(len(lp)):
        g_row = []
        for t in range(len(lp[i])):
            plus = [row[:] for row in lp]
            minus = [row[:] for row in lp]
            plus[i][t] += h
            minus[i][t] -= h
            f_plus = ref_policy_loss(plus, old, A, m, lp_sg=lp_sg, **kw)
            f_minus = ref_policy_loss(minus, old, A, m, lp_sg=lp_sg, **kw)
            g_row.append((f_plus - f_minus) / (2 * h))
        grad.append(g_row)
    return grad
