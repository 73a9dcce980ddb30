"""Family 2: gradients, not only values (d loss / d logps, elementwise, against closed forms)."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algorithms import LOSSES, policy_loss

from ._common import CLIP_FAMILY, LEVELS, LOSS_TYPES, assert_close, assert_grid_close, make_case, run_ours

F64 = torch.float64


def normaliser(loss_type: str, m: torch.Tensor, i: int, *, L=None, N=None, ga=1, spg=1, P=1) -> float:
    """The factor that divides a token's contribution −A·m (docs/algorithms.md, "Aggregation"), for row ``i``,
    by the loss's aggregation."""
    B, T = m.shape
    kind = LOSSES[loss_type].aggregation
    if kind == "sequence_mean":
        return max(1.0, m[i].sum().item()) * B * ga
    if kind == "token_mean":
        return max(1.0, m.sum().item()) * ga
    if kind == "fixed_length":
        return B * (L if L is not None else T) * ga
    if kind == "global_token_mean":
        n = m.sum().item() if N is None else N
        return max(1.0, n) / P * ga / spg
    if kind == "sequence_sum":
        return B * ga
    raise ValueError(kind)


def test_vespo_gradient_is_minus_phi_a_over_n():
    case = make_case(seed=11, B=4, T=5, sigma=0.2)
    lp, old, A, m = case["lp"], case["old"], case["A"], case["m"]
    loss, grad, metrics = run_ours(lp, old, A, m, loss_type="vespo", num_items_in_batch=17)
    d = (lp - old).tolist()
    for i in range(4):
        w_log = sum(x * mm for x, mm in zip(d[i], m[i].tolist()))
        k, lam = (2.0, 3.0) if A[i] >= 0 else (3.0, 2.0)
        phi = math.exp(lam + k * w_log - lam * math.exp(w_log))
        for t in range(5):
            assert_close(grad[i, t].item(), -phi * A[i].item() * m[i, t].item() / 17, rel=1e-10, abs_=1e-14,
                         what=f"[{i},{t}]")


def test_vespo_weight_is_detached():
    # φ depends on lp only through a detached path: the gradient is exactly φ·(∂ of -A·lp), no ∂φ term.
    lp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.3, -2.4]], dtype=F64)
    policy_loss(lp, old, torch.tensor([1.0], dtype=F64), torch.ones(1, 2, dtype=F64), loss_type="vespo").loss.backward()
    w_log = 0.3 + 0.4
    phi = math.exp(3.0 + 2.0 * w_log - 3.0 * math.exp(w_log))
    assert_grid_close(lp.grad, [[-phi / 2, -phi / 2]])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo", "bnpo", "dr_grpo", "sapo", "cispo"])
def test_gspo_sequence_gradient_reaches_every_valid_token_through_the_mean(loss_type):
    # Inside the clip range: ℓ_i = f(s_i) with s_i = mean of the row's valid d; ∂s_i/∂lp_t = m_t/|o_i|.
    old = torch.tensor([[-1.0, -1.2, -0.8, -2.0], [-0.5, -1.5, -1.0, -1.0]], dtype=F64)
    d = torch.tensor([[0.05, -0.02, 0.03, 0.9], [-0.04, 0.01, 0.0, 0.0]], dtype=F64)
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=F64)
    A = torch.tensor([0.7, -1.3], dtype=F64)
    lp = old + d
    _, grad, _ = run_ours(lp, old, A, m, loss_type=loss_type, importance_sampling_level="sequence",
                          max_completion_length=6)
    n = m.sum(-1)
    for i in range(2):
        s = (d[i] * m[i]).sum().item() / n[i].item()
        r = math.exp(s)
        a = A[i].item()
        if loss_type == "sapo":
            tau = 1.0 if a > 0 else 1.05
            sig = 1 / (1 + math.exp(-tau * (r - 1)))
            dl_ds = -sig * (1 - sig) * 4 * a * r  # d/ds of -σ(τ(e^s - 1))·4/τ·A
        elif loss_type == "cispo":
            dl_ds = None  # ∂ℓ/∂lp_t = -min(r, 5)·A directly on each token, no mean
        else:
            dl_ds = -r * a
        # ℓ_i enters once for a sequence mean (grpo, sapo) and |o_i| times for a token sum, which cancels the
        # 1/|o_i| of the mean: ∂loss/∂lp_t = f'(s_i)·m_t·c
        c = {"grpo": 1 / (n[i].item() * 2), "sapo": 1 / (n[i].item() * 2), "dapo": 1 / m.sum().item(),
             "bnpo": 1 / m.sum().item(), "dr_grpo": 1 / (2 * 6), "luspo": 1 / 2, "cispo": 1 / m.sum().item()}[loss_type]
        for t in range(4):
            if loss_type == "cispo":
                expected = -min(r, 5.0) * a * m[i, t].item() * c
            else:
                expected = dl_ds * m[i, t].item() * c
            assert_close(grad[i, t].item(), expected, rel=1e-10, abs_=1e-14, what=f"{loss_type}[{i},{t}]")
            if m[i, t]:
                assert grad[i, t].item() != 0.0
            else:
                assert grad[i, t].item() == 0.0


def test_gspo_sequence_gradient_is_zero_when_the_row_is_clipped():
    old = torch.tensor([[-1.0, -1.0]], dtype=F64)
    lp = old + torch.tensor([[0.5, 0.5]], dtype=F64)  # r = e^0.5 > 1.2 with A > 0: clipped
    _, grad, m = run_ours(lp, old, torch.tensor([1.0], dtype=F64), torch.ones(1, 2, dtype=F64), loss_type="grpo",
                          importance_sampling_level="sequence")
    assert grad.abs().max().item() == 0.0
    assert m["clip_ratio/high_mean"].item() == 1.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_sequence_token_equals_sequence_when_advantage_is_per_row(loss_type):
    if loss_type == "clip_cov":
        pytest.skip("Clip-Cov zeroes single tokens' terms: at sequence level the others' terms still reach those "
                    "tokens through the mean, so the two levels differ by design")
    case = make_case(seed=5, B=4, T=5, sigma=0.15)
    kw = dict(loss_type=loss_type, max_completion_length=8, beta=0.04, ref_logps=case["ref"])
    seq_loss, seq_grad, _ = run_ours(case["lp"], case["old"], case["A"], case["m"], importance_sampling_level="sequence",
                                     generator=torch.Generator().manual_seed(0), **kw)
    tok_loss, tok_grad, _ = run_ours(case["lp"], case["old"], case["A"], case["m"],
                                     importance_sampling_level="sequence_token",
                                     generator=torch.Generator().manual_seed(0), **kw)
    assert_close(tok_loss, seq_loss, rel=1e-12, abs_=1e-15)
    assert_grid_close(tok_grad, seq_grad, rel=1e-10, abs_=1e-14)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_on_policy_every_ratio_is_one_and_gradient_is_minus_a_over_normaliser(loss_type, level):
    if loss_type == "clip_cov":
        pytest.skip("Clip-Cov switches off the gradient of sampled high-covariance tokens even on-policy "
                    "(test_cov_losses.py)")
    case = make_case(seed=3, B=3, T=4)
    lp, A, m = case["lp"], case["A"], case["m"]
    agg = dict(max_completion_length=6, num_items_in_batch=19, gradient_accumulation_steps=2, steps_per_generation=2,
               num_processes=2)
    loss, grad, metrics = run_ours(lp, None, A, m, loss_type=loss_type, importance_sampling_level=level, **agg)
    for i in range(3):
        for t in range(4):
            expected = -A[i].item() * m[i, t].item() / normaliser(loss_type, m, i, L=6, N=19, ga=2, spg=2, P=2)
            assert_close(grad[i, t].item(), expected, rel=1e-10, abs_=1e-14, what=f"[{i},{t}]")
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio"):
        if name in metrics:
            assert metrics[name].item() == 0.0, name
    if loss_type == "vespo":
        assert_close(metrics["vespo/phi_seq_mean"].item(), 1.0, rel=1e-15)
    # on-policy the value is the surrogate at r = 1: −A per token for the clip family
    if loss_type in CLIP_FAMILY:
        rows = [-A[i].item() * m[i].sum().item() for i in range(3)]
        expected = {
            "grpo": sum(-A[i].item() for i in range(3)) / 3 / 2,
            "bnpo": sum(rows) / m.sum().item() / 2,
            "dr_grpo": sum(rows) / (3 * 6) / 2,
            "dapo": sum(rows) / (19 / 2 * 2 / 2),
            "luspo": sum(rows) / 3 / 2,
        }[loss_type]
        assert_close(loss, expected, rel=1e-12)


def test_on_policy_old_none_equals_old_equal_to_lp():
    case = make_case(seed=8)
    for loss_type in LOSS_TYPES:
        a = run_ours(case["lp"], None, case["A"], case["m"], loss_type=loss_type)
        b = run_ours(case["lp"], case["lp"].clone(), case["A"], case["m"], loss_type=loss_type)
        assert_close(a[0], b[0], rel=1e-14, abs_=1e-15, what=loss_type)
        assert_grid_close(a[1], b[1], rel=1e-12, abs_=1e-15, what=loss_type)


def test_on_policy_cispo_gradient_with_small_cap_is_scaled():
    # TRL's default cap 0.2 would scale every on-policy gradient by 0.2; with ours (5.0) it is −A·m/N.
    case = make_case(seed=4)
    _, g_default, _ = run_ours(case["lp"], None, case["A"], case["m"], loss_type="cispo")
    _, g_small, _ = run_ours(case["lp"], None, case["A"], case["m"], loss_type="cispo", epsilon_high=0.2)
    assert_grid_close(g_small, 0.2 * g_default, rel=1e-12, abs_=1e-15)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_masked_tokens_get_zero_gradient(loss_type, level):
    case = make_case(seed=21, B=4, T=6, sigma=0.5, p_mask=0.4)
    m = case["m"]
    m[2] = 0.0  # an empty row too
    _, grad, _ = run_ours(case["lp"], case["old"], case["A"], m, loss_type=loss_type, importance_sampling_level=level,
                          beta=0.1, ref_logps=case["ref"], use_bias_correction_kl=True, sampler_ratio=case["rho_tok"],
                          entropies=case["ent"], top_entropy_quantile=0.8)
    assert torch.isfinite(grad).all()
    assert (grad[m == 0] == 0).all()


def test_clip_family_gradient_by_hand_token_level():
    # ratio inside the range: ∂ℓ/∂lp = −r·A; clipped (r > 1+ε with A>0, r < 1-ε with A<0): 0;
    # r < 1-ε with A>0 and r > 1+ε with A<0 are NOT clipped (pessimistic min): −r·A
    old = torch.full((2, 3), -1.0, dtype=F64)
    ratios = torch.tensor([[1.1, 1.5, 0.5], [0.9, 0.5, 1.5]], dtype=F64)
    lp = old + ratios.log()
    A = torch.tensor([2.0, -3.0], dtype=F64)
    _, grad, _ = run_ours(lp, old, A, torch.ones(2, 3, dtype=F64), loss_type="bnpo")
    expected = [[-1.1 * 2.0 / 6, 0.0, -0.5 * 2.0 / 6], [0.9 * 3.0 / 6, 0.0, 1.5 * 3.0 / 6]]
    assert_grid_close(grad, expected, rel=1e-12, abs_=1e-15)
    # two-sided clipping: with delta = 1.4, A<0 and r = 1.5 > delta: gradient 0
    _, grad, _ = run_ours(lp, old, A, torch.ones(2, 3, dtype=F64), loss_type="bnpo", delta=1.4)
    expected[1][2] = 0.0
    assert_grid_close(grad, expected, rel=1e-12, abs_=1e-15)


def test_gmpo_gradient_by_hand():
    # ℓ_i = -A·exp(mean d*); ∂/∂lp_t = -A·exp(mean d*)·1[d_t not clipped]/|o|, then /B
    old = torch.full((1, 3), -1.0, dtype=F64)
    d = torch.tensor([[0.5, -0.6, 0.1]], dtype=F64)
    _, grad, _ = run_ours(old + d, old, torch.tensor([1.0], dtype=F64), torch.ones(1, 3, dtype=F64), loss_type="gmpo",
                          epsilon=0.4)
    g = -math.exp((0.4 - 0.6 + 0.1) / 3) / 3
    assert_grid_close(grad, [[0.0, g, g]], rel=1e-12, abs_=1e-15)
    _, grad, _ = run_ours(old + d, old, torch.tensor([-1.0], dtype=F64), torch.ones(1, 3, dtype=F64),
                          loss_type="gmpo", epsilon=0.4)
    g = math.exp((0.5 - 0.4 + 0.1) / 3) / 3
    assert_grid_close(grad, [[g, 0.0, g]], rel=1e-12, abs_=1e-15)


def test_sapo_gradient_by_hand():
    # ∂/∂lp of −σ(τ(r−1))·(4/τ)·A = −4·σ'(τ(r−1))·r·A (τ cancels)
    old = torch.full((2, 1), -1.0, dtype=F64)
    r = [1.3, 0.8]
    lp = old + torch.tensor([[math.log(r[0])], [math.log(r[1])]], dtype=F64)
    A = torch.tensor([1.0, -1.0], dtype=F64)
    _, grad, _ = run_ours(lp, old, A, torch.ones(2, 1, dtype=F64), loss_type="sapo", sapo_temperature_neg=1.05)
    exp = []
    for ri, a, tau in zip(r, [1.0, -1.0], [1.0, 1.05]):
        s = 1 / (1 + math.exp(-tau * (ri - 1)))
        exp.append([-4 * s * (1 - s) * ri * a / 2])
    assert_grid_close(grad, exp, rel=1e-12, abs_=1e-15)


def test_sapo_float64_temperature_is_exact():
    # τ_neg = 1.05 must not pass through float32 (1.0499999523…): a float64 loss is exact to 1e-15.
    old = torch.tensor([[-1.0]], dtype=F64)
    lp = old + math.log(2.0)
    got = policy_loss(lp, old, torch.tensor([-1.0], dtype=F64), torch.ones(1, 1, dtype=F64), loss_type="sapo").loss
    expected = 1 / (1 + math.exp(-1.05)) * 4 / 1.05
    assert abs(got.item() - expected) <= 1e-15 * expected
