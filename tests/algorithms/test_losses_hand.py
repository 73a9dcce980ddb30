"""Family 1: values worked out by hand (plain ``math``) for every loss type, level and option of
docs/algorithms.md §1–§6, and a sweep of every (loss_type, level, option) against the plain-Python reading in
``_pyref.py`` (value and finite-difference gradient).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from grpokit.algorithms import LossContext, policy_loss, vespo_weights

from . import _pyref
from ._common import LEVELS, REFERENCE_LOSSES, assert_close, assert_grid_close, make_case, run_ours, tolist

LN = math.log
F64 = torch.float64


def t64(x):
    return torch.tensor(x, dtype=F64)


def loss_of(lp, old, A, m, **kw) -> float:
    return policy_loss(t64(lp), None if old is None else t64(old), t64(A), t64(m), **kw).loss.item()


# --------------------------------------------------------------------------------------------------------------
# A sweep: every loss type × level × option against the plain-Python reference (value and gradient).
# --------------------------------------------------------------------------------------------------------------

OPTIONS = {
    "default": {},
    "eps_asym": dict(epsilon=0.1, epsilon_high=0.28),
    "delta": dict(delta=1.25, epsilon=0.1),
    "kl": dict(beta=0.07, ref="ref"),
    "kl_bias": dict(beta=0.07, ref="ref", use_bias_correction_kl=True),
    "rho_token": dict(sampler_ratio="rho_tok"),
    "rho_seq": dict(sampler_ratio="rho_seq"),
    "entropy_mask": dict(entropies="ent", top_entropy_quantile=0.5),
    "off_policy_mask": dict(off_policy_mask_threshold=0.02, sampler_logps="sampler_lp"),
    "off_policy_mask_old": dict(off_policy_mask_threshold=0.0),
    "aggregation": dict(max_completion_length=7, num_items_in_batch=23, gradient_accumulation_steps=3,
                        steps_per_generation=2, num_processes=2),
    "vespo_sapo_params": dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.0, vespo_lambda_neg=1.0,
                              sapo_temperature_pos=0.5, sapo_temperature_neg=2.0),
    "on_policy": dict(old=None),
}


def _resolve(case, opts):
    kw = dict(opts)
    old = kw.pop("old", case["old"])
    for key in ("ref", "sampler_ratio", "entropies", "sampler_logps"):
        if isinstance(kw.get(key), str):
            kw[key] = case[kw[key]]
    if "ref" in kw:
        kw["ref_logps"] = kw.pop("ref")
    return old, kw


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", REFERENCE_LOSSES)
def test_matches_plain_python_reference(loss_type, level, option):
    if option == "rho_seq" and loss_type == "vespo":
        pytest.skip("a sequence-level sampler ratio is rejected for VESPO (tested in test_errors.py)")
    case = make_case(seed=zlib.crc32(f"{loss_type}/{level}/{option}".encode()) % 10_000, B=3, T=4)
    old, kw = _resolve(case, OPTIONS[option])
    loss, grad, _ = run_ours(case["lp"], old, case["A"], case["m"], loss_type=loss_type,
                             importance_sampling_level=level, **kw)
    ref_kw = {k: tolist(v) for k, v in kw.items()}
    if "ref_logps" in ref_kw:
        ref_kw["ref"] = ref_kw.pop("ref_logps")
    args = (tolist(case["lp"]), tolist(old), tolist(case["A"]), tolist(case["m"]))
    expected = _pyref.ref_policy_loss(*args, loss_type=loss_type, level=level, **ref_kw)
    assert_close(loss, expected, rel=1e-10, abs_=1e-12, what="loss")
    expected_grad = _pyref.fd_grad(*args, loss_type=loss_type, level=level, **ref_kw)
    assert_grid_close(grad, expected_grad, rel=1e-6, abs_=1e-8, what="grad")


# --------------------------------------------------------------------------------------------------------------
# Worked examples.
# --------------------------------------------------------------------------------------------------------------

# Two rows, three tokens; row 1 has its last token masked. d = lp - old chosen so the ratios are round numbers.
OLD = [[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]]
RATIOS = [[1.0, 1.5, 0.5], [1.1, 0.7, 3.0]]
LP = [[o + LN(r) for o, r in zip(orow, rrow)] for orow, rrow in zip(OLD, RATIOS)]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.0, -1.0]
# eps = 0.2: row 0 (A=+1): -min(r, clip(r)) = -[1, 1.2, 0.5]; row 1 (A=-1): max(r, clip(r)) = [1.1, 0.8, (masked)]
ROW0 = [-1.0, -1.2, -0.5]
ROW1 = [1.1, 0.8]


def test_clip_family_token_level_by_hand():
    s0, s1 = sum(ROW0), sum(ROW1)  # -2.7, 1.9
    expected = {
        "grpo": (s0 / 3 + s1 / 2) / 2,  # per-sequence mean, then mean over rows = 0.025
        "bnpo": (s0 + s1) / 5,  # token mean = -0.16
        "dr_grpo": (s0 + s1) / (2 * 3),  # B·L with L = T when max_completion_length is unset
        "dapo": (s0 + s1) / 5,  # global token mean; N = Σm here
        "luspo": (s0 + s1) / 2,  # sum per row, mean over rows
    }
    for loss_type, value in expected.items():
        assert_close(loss_of(LP, OLD, ADV, MASK, loss_type=loss_type), value, what=loss_type)
    assert_close(expected["grpo"], 0.025, rel=1e-12)
    # dr_grpo with its constant normaliser L, dapo with N from the whole generation batch
    assert_close(loss_of(LP, OLD, ADV, MASK, loss_type="dr_grpo", max_completion_length=4), -0.8 / 8)
    assert_close(loss_of(LP, OLD, ADV, MASK, loss_type="dapo", num_items_in_batch=10), -0.8 / 10)


def test_clip_metrics_by_hand():
    out = policy_loss(t64(LP), t64(OLD), t64(ADV), t64(MASK), loss_type="grpo")
    # low: r < 0.8 and A < 0 -> row 1 token 1 (0.7); high: r > 1.2 and A > 0 -> row 0 token 1 (1.5).
    # Row 1 token 2 (r = 3) is masked and must not count. 5 valid tokens.
    assert_close(out.metrics["clip_ratio/low_mean"].item(), 1 / 5)
    assert_close(out.metrics["clip_ratio/high_mean"].item(), 1 / 5)
    assert_close(out.metrics["clip_ratio/region_mean"].item(), 2 / 5)
    for value in out.metrics.values():
        assert not value.requires_grad and value.dim() == 0


def test_asymmetric_clip_by_hand():
    # eps_lo = 0.1, eps_hi = 0.3: the clip interval is [0.9, 1.3].
    ratios = [[1.25, 1.5, 0.85], [1.25, 0.85, 0.8]]
    old = [[-1.0] * 3, [-1.5] * 3]
    lp = [[o + LN(r) for o, r in zip(orow, rrow)] for orow, rrow in zip(old, ratios)]
    # A = +1: -min(r, clip) = -[1.25, 1.3, 0.85]; A = -1: max(r, clip) = [1.25, 0.9, 0.9]
    expected = (-(1.25 + 1.3 + 0.85) + (1.25 + 0.9 + 0.9)) / 6
    got = loss_of(lp, old, ADV, [[1] * 3] * 2, loss_type="dapo", epsilon=0.1, epsilon_high=0.3)
    assert_close(got, expected)
    # eps_high unset: the interval is symmetric [0.9, 1.1]
    expected_sym = (-(1.1 + 1.1 + 0.85) + (1.25 + 0.9 + 0.9)) / 6
    assert_close(loss_of(lp, old, ADV, [[1] * 3] * 2, loss_type="dapo", epsilon=0.1), expected_sym)


def test_two_sided_clipping_delta_by_hand():
    # A = -1: ℓ = max(min(r, delta), clip(r, 0.8, 1.2)); delta = 1.4 caps the unbounded side.
    ratios = [[2.0, 1.5, 0.5, 1.3]]
    old = [[-1.0] * 4]
    lp = [[o + LN(r) for o, r in zip(old[0], ratios[0])]]
    with_delta = [max(min(r, 1.4), min(max(r, 0.8), 1.2)) for r in ratios[0]]
    assert with_delta == pytest.approx([1.4, 1.4, 0.8, 1.3])
    assert_close(loss_of(lp, old, [-1.0], [[1] * 4], loss_type="bnpo", delta=1.4), sum(with_delta) / 4)
    without = [2.0, 1.5, 0.8, 1.3]
    assert_close(loss_of(lp, old, [-1.0], [[1] * 4], loss_type="bnpo"), sum(without) / 4)
    # With A = +1 the clipped side already bounds the ratio: delta changes nothing.
    assert_close(loss_of(lp, old, [1.0], [[1] * 4], loss_type="bnpo", delta=1.4),
                 loss_of(lp, old, [1.0], [[1] * 4], loss_type="bnpo"))
    assert_close(loss_of(lp, old, [1.0], [[1] * 4], loss_type="bnpo"), -(1.2 + 1.2 + 0.5 + 1.2) / 4)


def test_gspo_sequence_level_by_hand():
    old = [[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]]
    d = [[0.3, -0.1, 0.4], [-0.6, -0.3, -0.3]]
    lp = [[o + x for o, x in zip(orow, drow)] for orow, drow in zip(old, d)]
    mask = [[1, 1, 0], [1, 1, 1]]
    # s_0 = (0.3 - 0.1)/2 = 0.1 (masked 0.4 ignored), s_1 = -1.2/3 = -0.4
    r0, r1 = math.exp(0.1), math.exp(-0.4)
    A = [2.0, -1.0]
    # eps = 0.05: row 0 clipped to 1.05 (A>0), row 1 raised to 0.95 (A<0)
    l0 = -min(r0 * 2.0, 1.05 * 2.0)
    l1 = -min(r1 * -1.0, 0.95 * -1.0)
    assert_close(l0, -2.1, rel=1e-12)
    assert_close(l1, 0.95, rel=1e-12)
    kw = dict(epsilon=0.05, importance_sampling_level="sequence")
    assert_close(loss_of(lp, old, A, mask, loss_type="grpo", **kw), (l0 + l1) / 2)
    # token-summed aggregations weight each sequence value by its length
    assert_close(loss_of(lp, old, A, mask, loss_type="dapo", **kw), (2 * l0 + 3 * l1) / 5)
    assert_close(loss_of(lp, old, A, mask, loss_type="luspo", **kw), (2 * l0 + 3 * l1) / 2)
    assert_close(loss_of(lp, old, A, mask, loss_type="dr_grpo", max_completion_length=5, **kw),
                 (2 * l0 + 3 * l1) / (2 * 5))
    # GSPO-token: the same value at every token
    kw["importance_sampling_level"] = "sequence_token"
    assert_close(loss_of(lp, old, A, mask, loss_type="grpo", **kw), (l0 + l1) / 2)
    assert_close(loss_of(lp, old, A, mask, loss_type="dapo", **kw), (2 * l0 + 3 * l1) / 5)
    # unclipped (eps = 0.5): ℓ = -r·A
    kw = dict(epsilon=0.5, importance_sampling_level="sequence")
    assert_close(loss_of(lp, old, A, mask, loss_type="grpo", **kw), (-2 * r0 + r1) / 2)


def test_sequence_level_clip_metrics_count_rows():
    old = [[-1.0] * 3] * 2
    lp = [[-1.0 + 0.5, -1.0, -1.0], [-1.0 - 0.9, -1.0, -1.0]]  # s = [0.5/3, -0.3]
    out = policy_loss(t64(lp), t64(old), t64([1.0, -1.0]), t64([[1] * 3] * 2), loss_type="grpo",
                      importance_sampling_level="sequence", epsilon=0.1)
    # r0 = e^{1/6} = 1.18 > 1.1 with A>0 (high); r1 = e^{-0.3} = 0.74 < 0.9 with A<0 (low): one row each
    assert_close(out.metrics["clip_ratio/high_mean"].item(), 0.5)
    assert_close(out.metrics["clip_ratio/low_mean"].item(), 0.5)
    assert_close(out.metrics["clip_ratio/region_mean"].item(), 1.0)


def test_cispo_by_hand():
    ratios = [6.0, 2.0, 0.5]
    old = [[-1.0, -1.0, -1.0]]
    lp = [[o + LN(r) for o, r in zip(old[0], ratios)]]
    A = [1.5]
    # default cap 5.0 (epsilon_high unset): ℓ = -min(r, 5)·A·lp
    expected = sum(-min(r, 5.0) * 1.5 * x for r, x in zip(ratios, lp[0])) / 3
    assert_close(loss_of(lp, old, A, [[1] * 3], loss_type="cispo"), expected)
    # the cap is absolute, not 1 + eps: epsilon_high = 1.5 caps at 1.5
    expected = sum(-min(r, 1.5) * 1.5 * x for r, x in zip(ratios, lp[0])) / 3
    assert_close(loss_of(lp, old, A, [[1] * 3], loss_type="cispo", epsilon_high=1.5), expected)
    # the 5.0 default is CISPO's only: epsilon=0.2 (the TRL default) would have capped at 0.2
    assert abs(loss_of(lp, old, A, [[1] * 3], loss_type="cispo") -
               loss_of(lp, old, A, [[1] * 3], loss_type="cispo", epsilon_high=0.2)) > 0.5
    out = policy_loss(t64(lp), t64(old), t64(A), t64([[1] * 3]), loss_type="cispo")
    assert_close(out.metrics["cispo_clip_ratio"].item(), 1 / 3)  # only r = 6 exceeds the cap 5


def test_cispo_default_cap_is_logged_once(caplog, monkeypatch):
    import logging

    from grpokit.algorithms import resolve_epsilon_high
    from grpokit.algorithms import settings as settings_module

    monkeypatch.setattr(settings_module, "_said_once", set())
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        for _ in range(3):
            loss_of([[-1.0]], [[-1.0]], [1.0], [[1]], loss_type="cispo")
    said = [r for r in caplog.records if "5.0" in r.getMessage() and "cispo" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert resolve_epsilon_high("cispo", 0.2, None) == 5.0
    assert resolve_epsilon_high("cispo", 0.2, 0.3) == 0.3
    assert resolve_epsilon_high("dapo", 0.2, None) == 0.2
    assert resolve_epsilon_high("grpo", 0.2, 0.28) == 0.28


def test_sapo_by_hand():
    ratios = [[1.0, 1.5, 0.6], [1.0, 1.5, 0.6]]
    old = [[-1.0] * 3, [-1.0] * 3]
    lp = [[o + LN(r) for o, r in zip(orow, rrow)] for orow, rrow in zip(old, ratios)]
    A = [0.8, -1.2]

    def sig(x):
        return 1 / (1 + math.exp(-x))

    def expected(tp, tn):
        rows = []
        for a, rr in zip(A, ratios):
            tau = tp if a > 0 else tn
            rows.append(sum(-sig(tau * (r - 1)) * 4 / tau * a for r in rr) / 3)
        return sum(rows) / 2

    assert_close(loss_of(lp, old, A, [[1] * 3] * 2, loss_type="sapo"), expected(1.0, 1.05))
    assert_close(loss_of(lp, old, A, [[1] * 3] * 2, loss_type="sapo", sapo_temperature_pos=0.5,
                         sapo_temperature_neg=3.0), expected(0.5, 3.0))
    # at r = 1: σ(0)·4/τ = 2/τ
    assert_close(loss_of([[-1.0]], [[-1.0]], [1.0], [[1]], loss_type="sapo"), -2.0)
    assert_close(loss_of([[-1.0]], [[-1.0]], [-1.0], [[1]], loss_type="sapo"), 2.0 / 1.05)


def test_gmpo_sign_aware_log_space_clip_by_hand():
    d = [0.5, -0.6, 0.1]
    old = [[-1.0] * 3, [-1.0] * 3]
    lp = [[-1.0 + x for x in d]] * 2
    A = [1.0, -2.0]
    # A > 0: d* = min(d, eps_hi) = [0.4, -0.6, 0.1]; A < 0: d* = max(d, -eps_lo) = [0.5, -0.4, 0.1]
    l0 = -1.0 * math.exp((0.4 - 0.6 + 0.1) / 3)
    l1 = 2.0 * math.exp((0.5 - 0.4 + 0.1) / 3)
    kw = dict(loss_type="gmpo", epsilon=0.4, epsilon_high=0.4)
    assert_close(loss_of(lp, old, A, [[1] * 3] * 2, **kw), (l0 + l1) / 2)
    # asymmetric: eps_lo = 0.3, eps_hi = 0.2 -> row 0: [0.2, -0.6, 0.1]; row 1: [0.5, -0.3, 0.1]
    l0 = -1.0 * math.exp((0.2 - 0.6 + 0.1) / 3)
    l1 = 2.0 * math.exp((0.5 - 0.3 + 0.1) / 3)
    assert_close(loss_of(lp, old, A, [[1] * 3] * 2, loss_type="gmpo", epsilon=0.3, epsilon_high=0.2),
                 (l0 + l1) / 2)
    # one value per row: the mean over its valid tokens, then over rows; the level does not change it
    mask = [[1, 1, 0], [1, 1, 1]]
    l0 = -1.0 * math.exp((0.4 - 0.6) / 2)
    l1 = 2.0 * math.exp((0.5 - 0.4 + 0.1) / 3)
    for level in ("token", "sequence", "sequence_token"):
        assert_close(loss_of(lp, old, A, mask, importance_sampling_level=level, **kw), (l0 + l1) / 2, what=level)


VESPO_D = [[0, 0, 0, 0], [.1, .1, .1, 0], [.1, .1, .1, 0], [-.5, -.5, 0, 0], [.2, .2, .2, .2]]
VESPO_M = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
VESPO_A = [1.0, 1.0, -1.0, -1.0, 0.0]
VESPO_PHI = [1.000000, 0.637898, 1.221748, 0.176266, 0.125353]


def _vespo_phi_by_hand(d_row, m_row, a, k_pos=2.0, l_pos=3.0, k_neg=3.0, l_neg=2.0):
    w_log = sum(x * m for x, m in zip(d_row, m_row))
    k, lam = (k_pos, l_pos) if a >= 0 else (k_neg, l_neg)
    return math.exp(lam + k * w_log - lam * math.exp(w_log))  # W^k e^{λ(1-W)}


def test_vespo_reference_vector_by_hand():
    phi = [_vespo_phi_by_hand(d, m, a) for d, m, a in zip(VESPO_D, VESPO_M, VESPO_A)]
    assert phi == pytest.approx(VESPO_PHI, abs=1e-6)


def test_vespo_reference_vector_through_policy_loss():
    old = [[-1.0 - 0.1 * t for t in range(4)] for _ in range(5)]
    lp = [[o + x for o, x in zip(orow, drow)] for orow, drow in zip(old, VESPO_D)]
    x = t64(lp).requires_grad_(True)
    out = policy_loss(x, t64(old), t64(VESPO_A), t64(VESPO_M), loss_type="vespo")
    out.loss.backward()
    n = sum(map(sum, VESPO_M))  # 15 tokens
    # ℓ = -φ·A·lp, summed over valid tokens, over N
    expected = sum(-phi * a * sum(v * m for v, m in zip(row, mrow))
                   for phi, a, row, mrow in zip(VESPO_PHI, VESPO_A, lp, VESPO_M)) / n
    assert_close(out.loss.item(), expected, rel=1e-5)
    # d loss / d lp = -φ·A·m / N recovers φ for the rows with A ≠ 0
    for i, (a, mrow) in enumerate(zip(VESPO_A, VESPO_M)):
        for t, mm in enumerate(mrow):
            assert_close(x.grad[i, t].item(), -VESPO_PHI[i] * a * mm / n, rel=1e-5, abs_=1e-9, what=f"[{i},{t}]")
    assert_close(out.metrics["vespo/phi_seq_mean"].item(), sum(VESPO_PHI) / 5, rel=1e-5)
    assert_close(out.metrics["vespo/phi_pos_mean"].item(), (1.0 + 0.637898 + 0.125353) / 3, rel=1e-5)
    assert_close(out.metrics["vespo/phi_neg_mean"].item(), (1.221748 + 0.176266) / 2, rel=1e-5)
    log_w = [0.0, 0.3, 0.3, -1.0, 0.8]
    assert_close(out.metrics["vespo/log_w_seq_mean"].item(), sum(log_w) / 5, rel=1e-9)
    assert_close(out.metrics["vespo/w_seq_mean"].item(), sum(map(math.exp, log_w)) / 5, rel=1e-9)


def test_vespo_weights_helper_matches_reference_vector():
    d = t64(VESPO_D)
    ctx = LossContext(lp=d, d=d, log_w=d, A=t64(VESPO_A).unsqueeze(-1), mask=t64(VESPO_M), eps_lo=0.2, eps_hi=0.2)
    phi, log_w = vespo_weights(ctx)
    assert phi.squeeze(-1).tolist() == pytest.approx(VESPO_PHI, abs=1e-6)
    assert log_w.squeeze(-1).tolist() == pytest.approx([0.0, 0.3, 0.3, -1.0, 0.8], abs=1e-12)


def test_vespo_ignores_level_and_uses_sum_not_mean():
    lp, old = [o + x for o, x in zip([-1.0] * 4, VESPO_D[4])], [-1.0] * 4
    vals = {lvl: loss_of([lp], [old], [1.0], [[1] * 4], loss_type="vespo", importance_sampling_level=lvl)
            for lvl in ("token", "sequence", "sequence_token")}
    phi = _vespo_phi_by_hand(VESPO_D[4], [1] * 4, 1.0)  # W = e^{0.8}, the sum; the mean would be e^{0.2}
    for lvl, v in vals.items():
        assert_close(v, -phi * sum(lp) / 4, what=lvl)


def test_vespo_custom_hyperparameters_and_clamps():
    # k_pos = 1, λ_pos = 0.5, row with log W = 0.3
    lp = [[-1.0 + 0.1, -1.0 + 0.2, -1.0]]
    old = [[-1.0] * 3]
    phi = math.exp(0.5 + 1.0 * 0.3 - 0.5 * math.exp(0.3))
    got = loss_of(lp, old, [2.0], [[1] * 3], loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5)
    assert_close(got, -phi * 2.0 * sum(lp[0]) / 3)
    # λ is floored at 1e-4: λ = 0 gives φ = e^{1e-4}·W^k·e^{-1e-4·W}
    phi0 = math.exp(1e-4 + 2.0 * 0.3 - 1e-4 * math.exp(0.3))
    got = loss_of(lp, old, [2.0], [[1] * 3], loss_type="vespo", vespo_lambda_pos=0.0)
    assert_close(got, -phi0 * 2.0 * sum(lp[0]) / 3)
    # log W is clamped below at log(1e-8): a sequence with S = -50 has W = 1e-8
    lp = [[-1.0 - 25.0, -1.0 - 25.0]]
    old = [[-1.0, -1.0]]
    # tokens clamp to -20 each: S = -40 -> clamp(S, log 1e-8, 20) = log 1e-8
    lw = math.log(1e-8)
    phi = math.exp(2.0 + 3.0 * lw - 2.0 * 1e-8)
    assert_close(loss_of(lp, old, [-1.0], [[1, 1]], loss_type="vespo"), phi * sum(lp[0]) / 2, rel=1e-9, abs_=0)


def test_vespo_folds_token_sampler_ratio_into_w():
    old = [[-1.0, -1.5, -2.0]]
    d = [0.1, -0.05, 0.3]
    lp = [[o + x for o, x in zip(old[0], d)]]
    rho = [[1.2, 0.9, 5.0]]  # last token masked: its ρ must not count
    mask = [[1, 1, 0]]
    log_w = 0.1 - 0.05 + LN(1.2) + LN(0.9)
    phi = math.exp(3.0 + 2.0 * log_w - 3.0 * math.exp(log_w))
    expected = -phi * 1.0 * (lp[0][0] + lp[0][1]) / 2
    got = policy_loss(t64(lp), t64(old), t64([1.0]), t64(mask), loss_type="vespo", sampler_ratio=t64(rho)).loss
    assert_close(got.item(), expected)
    # a zero ρ (token_mask mode) enters as log 1e-8, not -inf
    rho0 = [[0.0, 1.0, 1.0]]
    log_w = max(0.1 - 0.05 + math.log(1e-8), math.log(1e-8))
    phi = math.exp(3.0 + 2.0 * log_w - 3.0 * math.exp(log_w))
    got = policy_loss(t64(lp), t64(old), t64([1.0]), t64(mask), loss_type="vespo", sampler_ratio=t64(rho0)).loss
    assert_close(got.item(), -phi * (lp[0][0] + lp[0][1]) / 2, rel=1e-9, abs_=0)


def test_sampler_ratio_multiplies_per_token_loss_by_hand():
    # grpo on LP/OLD: ℓ row 0 = [-1, -1.2, -0.5], row 1 = [1.1, 0.8, masked]
    rho = [[2.0, 0.5, 1.0], [0.25, 4.0, 9.0]]
    row0 = [a * b for a, b in zip(ROW0, rho[0])]
    row1 = [a * b for a, b in zip(ROW1, rho[1][:2])]
    expected = (sum(row0) / 3 + sum(row1) / 2) / 2
    out = policy_loss(t64(LP), t64(OLD), t64(ADV), t64(MASK), loss_type="grpo", sampler_ratio=t64(rho))
    assert_close(out.loss.item(), expected)
    rho_seq = [[3.0], [0.5]]
    expected = (3.0 * sum(ROW0) / 3 + 0.5 * sum(ROW1) / 2) / 2
    out = policy_loss(t64(LP), t64(OLD), t64(ADV), t64(MASK), loss_type="grpo", sampler_ratio=t64(rho_seq))
    assert_close(out.loss.item(), expected)


def test_kl_k3_by_hand_token_and_sequence_level():
    lp = [[-1.0, -2.0, -0.7]]
    ref = [[-1.5, -1.0, -0.7]]
    old = [[-1.2, -1.9, -0.7]]  # token d = [0.2, -0.1, 0]
    mask = [[1, 1, 1]]
    x = [r - l for r, l in zip(ref[0], lp[0])]  # [-0.5, 1.0, 0]
    kl = [math.exp(v) - v - 1 for v in x]
    assert kl[0] == pytest.approx(0.10653065971263342) and kl[1] == pytest.approx(0.7182818284590451)
    beta = 0.1
    # A = 0 silences the policy term, leaving β·KL, aggregated per loss type
    for level in ("token", "sequence", "sequence_token"):
        kw = dict(beta=beta, ref_logps=t64(ref), importance_sampling_level=level)
        out = policy_loss(t64(lp), t64(old), t64([0.0]), t64(mask), loss_type="dapo", **kw)
        assert_close(out.loss.item(), beta * sum(kl) / 3, what=level)
        assert_close(out.metrics["kl"].item(), sum(kl) / 3, what=level)
        # DeepSeek-V3.2 correction: KL·exp(d) with the TOKEN ratio, at every level (not the sequence ratio)
        out = policy_loss(t64(lp), t64(old), t64([0.0]), t64(mask), loss_type="dapo", use_bias_correction_kl=True,
                          **kw)
        corrected = [k * math.exp(d) for k, d in zip(kl, [0.2, -0.1, 0.0])]
        assert_close(out.loss.item(), beta * sum(corrected) / 3, what=level)
        assert_close(out.metrics["kl"].item(), sum(corrected) / 3, what=level)


def test_kl_gradient_by_hand():
    # d/dlp [e^{ref-lp} - (ref-lp) - 1] = 1 - e^{ref-lp}; with correction, ∂/∂lp [KL·e^{lp-old}] = (1 - e^x + KL)·e^d
    lp, ref, old = [[-1.0, -2.0]], [[-1.5, -1.0]], [[-1.2, -1.9]]
    x = torch.tensor(lp, dtype=F64, requires_grad=True)
    policy_loss(x, t64(old), t64([0.0]), t64([[1, 1]]), loss_type="bnpo", beta=1.0, ref_logps=t64(ref)).loss.backward()
    xs = [r - l for r, l in zip(ref[0], lp[0])]
    assert_grid_close(x.grad, [[(1 - math.exp(v)) / 2 for v in xs]])
    x.grad = None
    policy_loss(x, t64(old), t64([0.0]), t64([[1, 1]]), loss_type="bnpo", beta=1.0, ref_logps=t64(ref),
                use_bias_correction_kl=True, importance_sampling_level="sequence").loss.backward()
    ds = [l - o for l, o in zip(lp[0], old[0])]
    expected = [((1 - math.exp(v)) + (math.exp(v) - v - 1)) * math.exp(d) / 2 for v, d in zip(xs, ds)]
    assert_grid_close(x.grad, [expected])


def test_off_policy_sequence_mask_by_hand():
    lp = [[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]]
    old = [[-1.0, -1.0]] * 3  # on the trainer side: ratio 1, grpo ℓ = -A per token
    sampler = [[-0.9, -0.9], [-0.7, -0.9], [-0.4, -0.4]]  # drift = mean(sampler - lp) = [0.1, 0.2, 0.6]
    A = [-1.0, -1.0, 2.0]
    kw = dict(loss_type="grpo", off_policy_mask_threshold=0.15, sampler_logps=t64(sampler))
    # row 0: A<0, drift 0.1 ≤ 0.15: kept (ℓ = 1); row 1: A<0, drift 0.2 > 0.15: dropped;
    # row 2: A ≥ 0: always kept (ℓ = -2)
    out = policy_loss(t64(lp), t64(old), t64(A), t64([[1, 1]] * 3), **kw)
    assert_close(out.loss.item(), (1.0 + 0.0 - 2.0) / 3)
    # a padded token's drift does not count: mask row 1 token 0 -> drift 0.1, kept
    out = policy_loss(t64(lp), t64(old), t64(A), t64([[1, 1], [0, 1], [1, 1]]), **kw)
    assert_close(out.loss.item(), (1.0 + 1.0 - 2.0) / 3)
    # without sampler log-probs the stored old log-probs are the reference
    old2 = [[-0.9, -0.9], [-0.7, -0.9], [-0.4, -0.4]]
    out = policy_loss(t64(lp), t64(old2), t64(A), t64([[1, 1]] * 3), loss_type="bnpo", off_policy_mask_threshold=0.15)
    r = [[math.exp(-1.0 - o) for o in row] for row in old2]
    row0 = [max(v, 0.8) for v in r[0]]  # A = -1
    row2 = [-2.0 * min(v, 1.2) for v in r[2]]
    assert_close(out.loss.item(), (sum(row0) + sum(row2)) / 6)


def test_high_entropy_mask_by_hand():
    ent = [[0.1, 0.5, 0.9], [0.3, 0.7, 2.0]]
    assert MASK == [[1, 1, 1], [1, 1, 0]]  # the shared mask: row 1's last token is padding
    # valid entropies sorted [0.1, 0.3, 0.5, 0.7, 0.9]; the (1 - 0.4) quantile: pos 0.6·4 = 2.4 -> 0.5 + 0.4·0.2 = 0.58
    # kept: 0.9 (row 0 token 2) and 0.7 (row 1 token 1); 2.0 is padding and never kept
    out = policy_loss(t64(LP), t64(OLD), t64(ADV), t64(MASK), loss_type="bnpo", entropies=t64(ent),
                      top_entropy_quantile=0.4)
    assert_close(out.loss.item(), (ROW0[2] + ROW1[1]) / 5)
    assert_close(out.metrics["entropy"].item(), (0.1 + 0.5 + 0.9 + 0.3 + 0.7) / 5)
    # an entropy exactly at the threshold is kept (≥): top 0.5 -> quantile 0.5 = 0.5 exactly -> keep 0.5, 0.7, 0.9
    out = policy_loss(t64(LP), t64(OLD), t64(ADV), t64(MASK), loss_type="bnpo", entropies=t64(ent),
                      top_entropy_quantile=0.5)
    assert_close(out.loss.item(), (ROW0[1] + ROW0[2] + ROW1[1]) / 5)


def test_mask_order_then_kl_is_not_masked():
    # The masks act on ℓ only; β·KL is added afterwards (§6), so a dropped row still pays its KL.
    lp = [[-1.0, -1.0]]
    ref = [[-1.5, -1.5]]
    sampler = [[0.0, 0.0]]  # drift 1.0
    kl = math.exp(-0.5) + 0.5 - 1
    out = policy_loss(t64(lp), t64(lp), t64([-1.0]), t64([[1, 1]]), loss_type="grpo", beta=0.5, ref_logps=t64(ref),
                      off_policy_mask_threshold=0.1, sampler_logps=t64(sampler), sampler_ratio=t64([[3.0, 3.0]]))
    assert_close(out.loss.item(), 0.5 * kl)


def test_aggregation_normalisers_by_hand():
    s0, s1 = sum(ROW0), sum(ROW1)
    ga, spg, P, N, L = 4, 2, 2, 40, 8
    kw = dict(gradient_accumulation_steps=ga, steps_per_generation=spg, num_processes=P, num_items_in_batch=N,
              max_completion_length=L)
    expected = {
        "grpo": (s0 / 3 + s1 / 2) / 2 / ga,
        "bnpo": (s0 + s1) / 5 / ga,
        "dr_grpo": (s0 + s1) / (2 * L) / ga,
        "dapo": (s0 + s1) / (N / P * ga / spg),
        "luspo": (s0 + s1) / 2 / ga,
    }
    for loss_type, value in expected.items():
        assert_close(loss_of(LP, OLD, ADV, MASK, loss_type=loss_type, **kw), value, what=loss_type)
    # num_items_in_batch as a tensor, and N = 0 clamps to 1
    assert_close(loss_of(LP, OLD, ADV, MASK, loss_type="dapo", num_items_in_batch=torch.tensor(10.0)), (s0 + s1) / 10)
    assert_close(loss_of(LP, OLD, ADV, MASK, loss_type="dapo", num_items_in_batch=0), s0 + s1)


def test_high_entropy_mask_keeps_a_float64_entropy_equal_to_the_quantile():
    from grpokit.algorithms import high_entropy_mask

    # the 0.5 quantile of [0.1 .. 0.5] is 0.3 exactly in float64 (0.30000001192… in float32): 0.3 must be kept
    e = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5]], dtype=F64)
    assert high_entropy_mask(e, torch.ones(1, 5, dtype=F64), 0.5).tolist() == [[0, 0, 1, 1, 1]]
    # low-precision entropies work (compared in float32), and padding is never kept
    e16 = e.to(torch.bfloat16)
    m = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bfloat16)
    assert high_entropy_mask(e16, m, 0.5).tolist() == [[0, 0, 1, 1, 0]]  # quantile of 4 values: 0.25
    # top 0.7 of 0.0, 0.1, …, 1.0: the 0.3 quantile is 0.3 itself, although 1 - 0.7 = 0.30000000000000004
    e11 = torch.tensor([[i / 10 for i in range(11)]], dtype=F64)
    assert high_entropy_mask(e11, torch.ones_like(e11), 0.7).tolist() == [[0, 0, 0] + [1] * 8]
    assert high_entropy_mask(e, torch.zeros(1, 5, dtype=F64), 0.5).tolist() == [[0] * 5]
