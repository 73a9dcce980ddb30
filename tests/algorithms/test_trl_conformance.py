"""Family 4: conformance with TRL 1.16's ``GRPOTrainer._compute_loss`` and advantage formula.

TRL is called unbound on a stand-in ``self`` (see ``_trl_harness.py``), with float64 inputs, so the loss and
d loss / d logps must agree to 1e-6 relative wherever docs/algorithms.md follows TRL. Where it deliberately does not,
the test checks OUR documented behaviour instead (bottom of the file):
- ``use_bias_correction_kl`` at sequence level: ours multiplies by the token-level ratio (TRL issue #6586);
- CISPO with ``epsilon_high`` unset: ours caps at 5.0, TRL at ``epsilon`` (0.2);
- log-ratios beyond ±20: ours clamps before ``exp``, TRL does not;
- tied reward groups: ours gives exactly 0, TRL ≈ 0.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

pytest.importorskip("trl")

from grpokit.algorithms import compute_advantages  # noqa: E402

from ._common import assert_close, assert_grid_close, make_case, run_ours  # noqa: E402
from ._trl_harness import trl_advantages, trl_loss  # noqa: E402

F64 = torch.float64
TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
TRL_LEVELS = ("token", "sequence")
REL = 1e-6
# TRL picks the SAPO temperature with ``torch.where(A > 0, 1.0, 1.05)``: python floats, so a float32 tensor, and
# 1.05 becomes 1.0499999523 even in float64 (a 1e-6-level difference). Ours keeps the loss dtype. To compare at
# 1e-6 the conformance tests use float32-exact temperatures; test_trl_sapo_temperature_is_float32 documents it.
SAPO_NEG_F32 = float(torch.tensor(1.05, dtype=torch.float32))

OPTIONS = {
    "default": {},
    "eps_asym": dict(epsilon=0.1, epsilon_high=0.28),
    "delta": dict(epsilon=0.1, delta=1.2),
    "kl": dict(beta=0.04, ref_logps="ref"),
    "kl_bias_token": dict(beta=0.04, ref_logps="ref", use_bias_correction_kl=True),
    "entropy_mask": dict(top_entropy_quantile=0.4),
    "off_policy_mask_sampler": dict(off_policy_mask_threshold=0.0, sampler_logps="sampler_lp"),
    "off_policy_mask_old": dict(off_policy_mask_threshold=-0.02),
    "aggregation": dict(max_completion_length=9, num_items_in_batch=57, gradient_accumulation_steps=4,
                        steps_per_generation=2, num_processes=2),
    "vllm_token_ratio": dict(sampler_ratio="rho_tok"),
    "vllm_sequence_ratio": dict(sampler_ratio="rho_seq"),
    "hyperparameters": dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5,
                            sapo_temperature_pos=0.75, sapo_temperature_neg=1.25),
    "on_policy": dict(old=None),
    "everything": dict(epsilon=0.15, epsilon_high=0.3, delta=1.5, beta=0.02, ref_logps="ref",
                       top_entropy_quantile=0.7, off_policy_mask_threshold=0.01, sampler_logps="sampler_lp",
                       sampler_ratio="rho_tok", max_completion_length=8, num_items_in_batch=40,
                       gradient_accumulation_steps=2, steps_per_generation=2),
}


def _compare(case, loss_type, level, opts):
    kw = dict(opts)
    old = kw.pop("old", case["old"])
    for key in ("ref_logps", "sampler_ratio", "sampler_logps"):
        if isinstance(kw.get(key), str):
            kw[key] = case[kw[key]]
    if loss_type == "cispo" and kw.get("epsilon_high") is None:
        kw["epsilon_high"] = 4.0  # CISPO's unset cap is an intended difference (tested below)
    if loss_type == "sapo" and "sapo_temperature_neg" not in kw:
        kw["sapo_temperature_neg"] = SAPO_NEG_F32
    ours_loss, ours_grad, ours_metrics = run_ours(case["lp"], old, case["A"], case["m"], loss_type=loss_type,
                                                  importance_sampling_level=level, entropies=case["ent"], **kw)
    trl_kw = dict(kw)
    trl_kw["importance_sampling_ratio"] = trl_kw.pop("sampler_ratio", None)
    t_loss, t_x, t_metrics = trl_loss(case["lp"], old, case["A"], case["m"], loss_type=loss_type,
                                      importance_sampling_level=level, entropies=case["ent"], **trl_kw)
    assert_close(ours_loss, t_loss.item(), rel=REL, abs_=1e-12, what="loss")
    scale = max(1e-12, t_x.grad.abs().max().item())
    assert_grid_close(ours_grad, t_x.grad, rel=REL, abs_=REL * scale, what="grad")
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                 "clip_ratio/high_max", "cispo_clip_ratio", "vespo/phi_seq_mean", "kl", "entropy"):
        if name in t_metrics:
            assert name in ours_metrics, name
            if math.isnan(t_metrics[name]):
                assert math.isnan(ours_metrics[name].item()), name
            else:
                assert_close(ours_metrics[name].item(), t_metrics[name], rel=REL, abs_=1e-12, what=name)
    return ours_loss


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("level", TRL_LEVELS)
@pytest.mark.parametrize("loss_type", TRL_LOSS_TYPES)
def test_loss_and_gradient_match_trl(loss_type, level, option):
    if loss_type == "vespo" and option == "vllm_sequence_ratio":
        pytest.skip("a sequence-level ratio is rejected for VESPO by design (test_errors.py)")
    if level == "sequence" and option == "kl_bias_token":
        pytest.skip("intended difference (TRL issue #6586): see test_bias_corrected_kl_at_sequence_level_*")
    seed = zlib.crc32(f"{loss_type}/{level}/{option}".encode()) % 10_000
    case = make_case(seed=seed, B=6, T=7, sigma=0.3, p_mask=0.3)
    _compare(case, loss_type, level, OPTIONS[option])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("loss_type", TRL_LOSS_TYPES)
def test_random_batches_match_trl(loss_type, seed):
    # larger and more off-policy batches, both levels; some rows fully masked
    g = torch.Generator().manual_seed(seed)
    level = TRL_LEVELS[seed % 2]
    case = make_case(seed=1000 + seed, B=8, T=12, sigma=0.5, p_mask=0.35)
    case["m"][int(torch.randint(0, 8, (1,), generator=g))] = 0.0
    case["rho_tok"] = torch.where(case["m"].bool(), case["rho_tok"], torch.ones_like(case["m"]))
    opts = dict(beta=0.03, ref_logps="ref", epsilon_high=0.27, sampler_ratio="rho_tok",
                num_items_in_batch=float(case["m"].sum()) * 2, gradient_accumulation_steps=2, steps_per_generation=1)
    _compare(case, loss_type, level, opts)


@pytest.mark.parametrize("loss_type", ["gmpo", "not_a_loss"])
def test_trl_rejects_what_it_does_not_support_loss(loss_type):
    case = make_case(seed=0)
    with pytest.raises(ValueError):
        trl_loss(case["lp"], case["old"], case["A"], case["m"], loss_type=loss_type)


def test_trl_rejects_sequence_token_level():
    case = make_case(seed=0)
    with pytest.raises(ValueError, match="sequence"):
        trl_loss(case["lp"], case["old"], case["A"], case["m"], loss_type="grpo",
                 importance_sampling_level="sequence_token")


def test_vespo_reference_vector_matches_trl_gamma_weights():
    from trl.trainer.grpo_trainer import GRPOTrainer

    d = torch.tensor([[0, 0, 0, 0], [.1, .1, .1, 0], [.1, .1, .1, 0], [-.5, -.5, 0, 0], [.2, .2, .2, .2]], dtype=F64)
    m = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=F64)
    A = torch.tensor([[1.0], [1.0], [-1.0], [-1.0], [0.0]], dtype=F64)
    phi = GRPOTrainer.get_gamma_weights(A, d, m, None).squeeze(-1).tolist()
    assert phi == pytest.approx([1.000000, 0.637898, 1.221748, 0.176266, 0.125353], abs=1e-6)


def test_trl_sapo_temperature_is_float32():
    old = torch.tensor([[-1.0]], dtype=F64)
    lp = old + math.log(2.0)
    A = torch.tensor([-1.0], dtype=F64)
    m = torch.ones(1, 1, dtype=F64)
    theirs = trl_loss(lp, old, A, m, loss_type="sapo")[0].item()
    ours_f32 = run_ours(lp, old, A, m, loss_type="sapo", sapo_temperature_neg=SAPO_NEG_F32)[0]
    ours = run_ours(lp, old, A, m, loss_type="sapo")[0]
    assert_close(theirs, ours_f32, rel=1e-14)
    exact = 1 / (1 + math.exp(-1.05)) * 4 / 1.05
    assert_close(ours, exact, rel=1e-14)
    assert theirs != exact


# ----------------------------------------------------------------------------------------------------------------
# Intended differences: check our documented behaviour, and that TRL really differs there.
# ----------------------------------------------------------------------------------------------------------------


def test_bias_corrected_kl_at_sequence_level_uses_token_ratio_not_trls_sequence_ratio():
    case = make_case(seed=31, B=4, T=5, sigma=0.4)
    kw = dict(beta=0.5, ref_logps=case["ref"], use_bias_correction_kl=True, importance_sampling_level="sequence")
    A0 = torch.zeros(4, dtype=F64)  # isolate the KL term
    ours, _, metrics = run_ours(case["lp"], case["old"], A0, case["m"], loss_type="bnpo", **kw)
    theirs, _, _ = trl_loss(case["lp"], case["old"], A0, case["m"], loss_type="bnpo", **kw)
    lp, old, ref, m = case["lp"], case["old"], case["ref"], case["m"]
    x = ref - lp
    kl_token = (torch.exp(x) - x - 1) * torch.exp(lp - old)
    assert_close(ours, 0.5 * (kl_token * m).sum().item() / m.sum().item(), rel=1e-12)
    seq = ((lp - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)
    kl_seq = (torch.exp(x) - x - 1) * torch.exp(seq)
    assert_close(theirs.item(), 0.5 * (kl_seq * m).sum().item() / m.sum().item(), rel=1e-12)
    assert abs(ours - theirs.item()) > 1e-4
    # at token level the two agree
    kw["importance_sampling_level"] = "token"
    ours, _, _ = run_ours(case["lp"], case["old"], A0, case["m"], loss_type="bnpo", **kw)
    theirs, _, _ = trl_loss(case["lp"], case["old"], A0, case["m"], loss_type="bnpo", **kw)
    assert_close(ours, theirs.item(), rel=REL)


def test_cispo_unset_epsilon_high_is_five_not_trls_epsilon():
    case = make_case(seed=12, B=4, T=5, sigma=1.5)
    ours, ours_grad, _ = run_ours(case["lp"], case["old"], case["A"], case["m"], loss_type="cispo")
    five, five_grad, _ = run_ours(case["lp"], case["old"], case["A"], case["m"], loss_type="cispo", epsilon_high=5.0)
    assert ours == five
    assert torch.equal(ours_grad, five_grad)
    theirs, t_x, _ = trl_loss(case["lp"], case["old"], case["A"], case["m"], loss_type="cispo")
    ours_02, ours_02_grad, _ = run_ours(case["lp"], case["old"], case["A"], case["m"], loss_type="cispo",
                                        epsilon_high=0.2)
    assert_close(ours_02, theirs.item(), rel=REL)  # TRL's unset cap is epsilon = 0.2
    assert_grid_close(ours_02_grad, t_x.grad, rel=REL, abs_=1e-12)
    assert abs(ours - theirs.item()) > 1e-3


@pytest.mark.parametrize("loss_type", TRL_LOSS_TYPES)
def test_log_ratios_beyond_twenty_are_clamped(loss_type):
    # d = +30 on one token: ours treats it as 20 (finite everywhere); TRL exponentiates 30 directly.
    old = torch.full((2, 3), -40.0, dtype=F64)
    lp = old.clone()
    lp[0, 1] += 30.0
    lp[1, 0] -= 30.0
    A = torch.tensor([-1.0, 1.0], dtype=F64)
    m = torch.ones(2, 3, dtype=F64)
    kw = dict(epsilon_high=5.0) if loss_type == "cispo" else {}
    ours, grad, _ = run_ours(lp, old, A, m, loss_type=loss_type, **kw)
    assert math.isfinite(ours) and torch.isfinite(grad).all()
    lp_clamped = old + (lp - old).clamp(-20, 20)
    at_twenty, _, _ = run_ours(lp_clamped, old, A, m, loss_type=loss_type, **kw)
    if loss_type not in ("cispo", "vespo"):  # those two multiply lp itself, which we did not clamp
        assert_close(ours, at_twenty, rel=1e-12, abs_=1e-15)
    theirs, _, _ = trl_loss(lp, old, A, m, loss_type=loss_type, **kw)
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        # A<0 row: -min(r·A, clip·A) = r·|A| with r = e^30 in TRL, e^20 in ours
        assert theirs.item() > 1e3 * ours


# ----------------------------------------------------------------------------------------------------------------
# Advantages vs TRL's formula.
# ----------------------------------------------------------------------------------------------------------------

ADV_OPTIONS = [
    dict(scale_rewards="group"),
    dict(scale_rewards="batch"),
    dict(scale_rewards="none"),
    dict(scale_rewards=True),
    dict(scale_rewards=False),
    dict(scale_rewards="group", reward_weights=[0.7, -0.3, 2.0]),
    dict(scale_rewards="batch", reward_weights=[1.0, 0.5, 0.25]),
    dict(multi_objective_aggregation="normalize_then_sum"),
    dict(multi_objective_aggregation="normalize_then_sum", reward_weights=[2.0, 1.0, -1.0]),
]


@pytest.mark.parametrize("with_nan", [False, True])
@pytest.mark.parametrize("opts", ADV_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("G", [2, 4, 8])
def test_advantages_match_trl(G, opts, with_nan):
    g = torch.Generator().manual_seed(G * 17 + len(opts))
    N, K = 4 * G, 3
    rewards = torch.randn(N, K, generator=g, dtype=F64)
    if with_nan:
        rewards[1, 0] = torch.nan  # one function did not apply to this row
        rewards[2, 1:] = torch.nan
        rewards[N - 1, :] = torch.nan  # unscorable row: A = 0
    trl_opts = dict(opts)
    scale = trl_opts.get("scale_rewards", "group")
    trl_opts["scale_rewards"] = {True: "group", False: "none"}.get(scale, scale)
    ours = compute_advantages(rewards, G, **opts)
    theirs = trl_advantages(rewards, G, **trl_opts)
    assert ours.shape == (N,)
    assert_grid_close([ours.tolist()], [theirs.tolist()], rel=1e-6, abs_=1e-9)
    if with_nan:
        assert ours[N - 1].item() == 0.0


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_tied_groups_are_exactly_zero_where_trl_is_only_close(scale_rewards):
    # 0.1 + 0.2 = 0.30000000000000004 ≠ 0.3: a "tie" that differs by rounding
    rewards = torch.tensor([[0.1 + 0.2], [0.3], [0.3], [0.1 + 0.2], [1.0], [0.0], [0.5], [0.25]], dtype=F64)
    ours = compute_advantages(rewards, 4, scale_rewards=scale_rewards)
    theirs = trl_advantages(rewards, 4, scale_rewards=scale_rewards)
    assert ours[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    if scale_rewards == "group":
        assert theirs[:4].abs().max().item() > 0.0  # TRL: ±5.5e-17 / (std + 1e-4) ≠ 0
    assert theirs[:4].abs().max().item() < 1e-9
    # TRL's nanstd computes its Bessel factor count/(count-1) in float32: agreement is to ~1e-8 only
    assert_grid_close([ours[4:].tolist()], [theirs[4:].tolist()], rel=1e-6, abs_=1e-12)
