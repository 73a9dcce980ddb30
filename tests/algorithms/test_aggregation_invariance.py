"""Family 3: the sum over micro-batches of one optimizer step equals the loss of the same data in one batch
(docs/algorithms.md §3; TRL PR #6024 is where the references got this wrong), and the DDP mean over ranks equals one
process.

Which splits this holds for, by design:
- ``dapo``, ``cispo``, ``vespo``: any split, the rows of any length, because the normaliser is the token count
  ``N`` of the whole generation batch (``num_items_in_batch``), rescaled by ``P`` and ``GA/spg``.
- ``grpo``, ``sapo``, ``gmpo``, ``dr_grpo``, ``luspo``: equal numbers of rows per micro-batch (each normalises by
  its own row count).
- ``bnpo``: micro-batches with equal *token* counts (it normalises by its own token count; that is the definition
  of BNPO, a local token mean). Rows of unequal length are used on purpose: the sum still matches.
"""

from __future__ import annotations

import pytest
import torch

from grpokit.algorithms import LOSSES, policy_loss

from ._common import BATCH_INDEPENDENT, LEVELS, assert_close, assert_grid_close, make_case

F64 = torch.float64
GLOBAL = tuple(n for n in BATCH_INDEPENDENT if LOSSES[n].aggregation == "global_token_mean")


def _full_kw(case):
    # every option that acts per row or per token must keep the equality (the entropy mask is batch-global
    # by definition and is left out: its quantile depends on the micro-batch)
    return dict(epsilon=0.15, epsilon_high=0.25, delta=1.6, beta=0.05, ref_logps=case["ref"], max_completion_length=9,
                off_policy_mask_threshold=0.01, sampler_logps=case["sampler_lp"], sampler_ratio=case["rho_tok"])


def _rows(kw, idx):
    out = {}
    for k, v in kw.items():
        out[k] = v[idx] if isinstance(v, torch.Tensor) else v
    return out


def _loss_and_grad(lp, old, A, m, **kw):
    x = lp.detach().clone().requires_grad_(True)
    loss = policy_loss(x, old, A, m, **kw).loss
    loss.backward()
    return loss.item(), x.grad


def _equal_token_mask(B, T, g):
    # rows of different lengths, but every consecutive pair holds the same number of tokens: T + 2 per pair
    m = torch.zeros(B, T, dtype=F64)
    for i in range(0, B, 2):
        a = int(torch.randint(2, T - 1, (1,), generator=g))
        m[i, :a] = 1
        m[i + 1, : T + 2 - a] = 1
    return m


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", BATCH_INDEPENDENT)
def test_gradient_accumulation_sum_equals_one_batch(loss_type, level, k):
    B, T = 8, 6
    case = make_case(seed=100 + k, B=B, T=T, sigma=0.3)
    lp, old, A = case["lp"], case["old"], case["A"]
    g = torch.Generator().manual_seed(k)
    # bnpo: every micro-batch (one or two row pairs) then holds the same number of tokens
    m = _equal_token_mask(B, T, g) if loss_type == "bnpo" else case["m"]
    case["rho_tok"] = torch.where(m.bool(), case["rho_tok"], torch.ones_like(m))
    kw = _full_kw(case)
    n_total = m.sum().item()
    whole_kw = dict(kw, num_items_in_batch=n_total) if loss_type in GLOBAL else kw
    whole_loss, whole_grad = _loss_and_grad(lp, old, A, m, loss_type=loss_type, importance_sampling_level=level,
                                            **whole_kw)

    total_loss, grad = 0.0, torch.zeros_like(lp)
    size = B // k
    for j in range(k):
        idx = slice(j * size, (j + 1) * size)
        micro_kw = _rows(kw, idx)
        micro_kw.update(gradient_accumulation_steps=k, steps_per_generation=k)
        if loss_type in GLOBAL:
            micro_kw["num_items_in_batch"] = n_total
        loss, g_part = _loss_and_grad(lp[idx], old[idx], A[idx], m[idx], loss_type=loss_type,
                                      importance_sampling_level=level, **micro_kw)
        total_loss += loss
        grad[idx] = g_part
    assert_close(total_loss, whole_loss, rel=1e-12, abs_=1e-14)
    assert_grid_close(grad, whole_grad, rel=1e-10, abs_=1e-14)


@pytest.mark.parametrize("loss_type", GLOBAL)
def test_global_token_mean_holds_for_unequal_micro_batches(loss_type):
    # dapo/cispo/vespo: micro-batches of different row counts and lengths still sum to the global token mean.
    case = make_case(seed=7, B=7, T=5, p_mask=0.4)
    lp, old, A, m = case["lp"], case["old"], case["A"], case["m"]
    n = m.sum().item()
    whole, whole_grad = _loss_and_grad(lp, old, A, m, loss_type=loss_type, num_items_in_batch=n)
    total, grad = 0.0, torch.zeros_like(lp)
    for idx in (slice(0, 1), slice(1, 5), slice(5, 7)):
        loss, gp = _loss_and_grad(lp[idx], old[idx], A[idx], m[idx], loss_type=loss_type, num_items_in_batch=n,
                                  gradient_accumulation_steps=3, steps_per_generation=3)
        total += loss
        grad[idx] = gp
    assert_close(total, whole, rel=1e-12)
    assert_grid_close(grad, whole_grad, rel=1e-10, abs_=1e-14)


@pytest.mark.parametrize("loss_type", GLOBAL)
def test_steps_per_generation_splits_the_generation_batch_into_optimizer_steps(loss_type):
    # spg = 4, GA = 2: a generation batch of 4 micro-batches feeds two optimizer steps; each step's loss is its
    # tokens over N/2, i.e. (for equal token halves) the token mean of that half.
    case = make_case(seed=9, B=8, T=4, p_mask=0.0)
    lp, old, A, m = case["lp"], case["old"], case["A"], case["m"]
    n = m.sum().item()
    for half in (slice(0, 4), slice(4, 8)):
        expected, _ = _loss_and_grad(lp[half], old[half], A[half], m[half], loss_type=loss_type)
        step = 0.0
        for idx in (slice(half.start, half.start + 2), slice(half.start + 2, half.stop)):
            loss, _ = _loss_and_grad(lp[idx], old[idx], A[idx], m[idx], loss_type=loss_type, num_items_in_batch=n,
                                     gradient_accumulation_steps=2, steps_per_generation=4)
            step += loss
        assert_close(step, expected, rel=1e-12)  # N/P·GA/spg = 32·2/4 = 16 = this step's tokens


def test_bnpo_is_local_on_unequal_token_counts():
    # Documents why bnpo is excluded from the general invariance: its normaliser is the micro-batch's own tokens.
    case = make_case(seed=1, B=4, T=4, p_mask=0.0)
    m = case["m"].clone()
    m[0, 1:] = 0  # first micro-batch: 1 + 4 tokens; second: 8
    lp, old, A = case["lp"], case["old"], case["A"]
    whole, _ = _loss_and_grad(lp, old, A, m, loss_type="bnpo")
    parts = sum(_loss_and_grad(lp[s], old[s], A[s], m[s], loss_type="bnpo", gradient_accumulation_steps=2)[0]
                for s in (slice(0, 2), slice(2, 4)))
    assert abs(parts - whole) > 1e-6


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", BATCH_INDEPENDENT)
def test_ddp_mean_of_rank_gradients_equals_single_process(loss_type, level):
    # Two ranks, half the rows each. DDP all-reduces the *mean* of the ranks' gradients; the loss a run logs is
    # the mean over ranks too. With num_processes=2 and N over both ranks this equals the one-process value.
    B, T = 6, 5
    case = make_case(seed=42, B=B, T=T)
    lp, old, A = case["lp"], case["old"], case["A"]
    m = case["m"]
    if loss_type == "bnpo":  # equal token counts per rank
        m = torch.ones(B, T, dtype=F64)
        m[0, 3:] = 0
        m[4, 3:] = 0
    case["rho_tok"] = torch.where(m.bool(), case["rho_tok"], torch.ones_like(m))
    kw = _full_kw(case)
    n = m.sum().item()
    single_kw = dict(kw, num_items_in_batch=n) if loss_type in GLOBAL else kw
    whole, whole_grad = _loss_and_grad(lp, old, A, m, loss_type=loss_type, importance_sampling_level=level,
                                       **single_kw)
    losses, grad = [], torch.zeros_like(lp)
    for idx in (slice(0, 3), slice(3, 6)):
        rank_kw = _rows(kw, idx)
        rank_kw["num_processes"] = 2
        if loss_type in GLOBAL:
            rank_kw["num_items_in_batch"] = n
        loss, gp = _loss_and_grad(lp[idx], old[idx], A[idx], m[idx], loss_type=loss_type,
                                  importance_sampling_level=level, **rank_kw)
        losses.append(loss)
        grad[idx] = gp / 2  # the DDP all-reduce averages the two ranks' gradients
    assert_close(sum(losses) / 2, whole, rel=1e-12, abs_=1e-14)
    assert_grid_close(grad, whole_grad, rel=1e-10, abs_=1e-14)


@pytest.mark.parametrize("loss_type", BATCH_INDEPENDENT)
def test_ddp_with_gradient_accumulation(loss_type):
    # P = 2 ranks × GA = 2 micro-batches each, spg = 2: still the one-batch, one-process loss.
    B, T = 8, 4
    case = make_case(seed=77, B=B, T=T, p_mask=0.0 if loss_type == "bnpo" else 0.3)
    lp, old, A, m = case["lp"], case["old"], case["A"], case["m"]
    n = m.sum().item()
    whole, whole_grad = _loss_and_grad(lp, old, A, m, loss_type=loss_type,
                                       num_items_in_batch=n if loss_type in GLOBAL else None)
    total, grad = 0.0, torch.zeros_like(lp)
    for rank_rows in ((0, 1, 2, 3), (4, 5, 6, 7)):
        for micro in (rank_rows[:2], rank_rows[2:]):
            idx = slice(micro[0], micro[-1] + 1)
            loss, gp = _loss_and_grad(lp[idx], old[idx], A[idx], m[idx], loss_type=loss_type, num_processes=2,
                                      gradient_accumulation_steps=2, steps_per_generation=2,
                                      num_items_in_batch=n if loss_type in GLOBAL else None)
            total += loss / 2
            grad[idx] = gp / 2
    assert_close(total, whole, rel=1e-12, abs_=1e-14)
    assert_grid_close(grad, whole_grad, rel=1e-10, abs_=1e-14)
