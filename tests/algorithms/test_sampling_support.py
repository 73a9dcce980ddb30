"""The truncated-support log-probs (grpokit/algorithms/sampling_support.py) on a fixed distribution by hand, each
filter and their order, and against transformers' own warpers applied in vLLM's order; the mismatch suite's new modes
and metrics by hand."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpokit.algorithms.importance import sampler_importance_ratio, sampler_mismatch_metrics
from grpokit.algorithms.sampling_support import (
    RowContext,
    SamplingSupport,
    held_stop_logps,
    kept_tokens,
    reshaped_logits,
    support_logps,
)

P = torch.tensor([[0.5, 0.25, 0.15, 0.1]])
Z = torch.log(P)  # softmax(Z) = P


def lp(support: SamplingSupport, token: int, z: torch.Tensor = Z) -> float:
    return support_logps(z, torch.tensor([token]), support).item()


@pytest.mark.parametrize("support, kept, token, expected", [
    (SamplingSupport(), [0, 1, 2, 3], 1, 0.25),
    (SamplingSupport(top_k=2), [0, 1], 1, 0.25 / 0.75),
    (SamplingSupport(top_p=0.7), [0, 1], 0, 0.5 / 0.75),  # the tail 0.1 + 0.15 = 0.25 ≤ 0.3 goes
    (SamplingSupport(top_p=0.8), [0, 1, 2], 2, 0.15 / 0.9),  # only 0.1 ≤ 0.2 goes
    (SamplingSupport(min_p=0.4), [0, 1], 1, 0.25 / 0.75),  # keep p ≥ 0.4 · 0.5
    (SamplingSupport(min_p=0.25), [0, 1, 2], 0, 0.5 / 0.9),
    (SamplingSupport(top_k=2), [0, 1], 3, 0.1 / 0.85),  # a drawn token outside the trainer's set counts as kept
    # vLLM's order: min_p keeps {0, 1, 2}, top_k {0, 1}, then top_p on those renormalised (2/3, 1/3) drops 1/3 ≤ 0.4
    (SamplingSupport(top_k=2, top_p=0.6, min_p=0.25), [0], 0, 1.0),
])
def test_support_logps_by_hand(support, kept, token, expected):
    assert kept_tokens(Z, support)[0].nonzero().flatten().tolist() == kept
    assert lp(support, token) == pytest.approx(math.log(expected), abs=1e-6)


def test_temperature_comes_first():
    """At τ = 2 the distribution is p^(1/2), renormalised: top-2 keeps 0.3701 + 0.2617 of it."""
    tempered = P.sqrt() / P.sqrt().sum()
    kept = tempered[0, :2].sum()
    assert lp(SamplingSupport(top_k=2), 0, Z / 2.0) == pytest.approx(math.log(tempered[0, 0] / kept), abs=1e-6)


@pytest.mark.parametrize("support", [SamplingSupport(top_k=7), SamplingSupport(top_p=0.8), SamplingSupport(min_p=0.05),
                                     SamplingSupport(top_k=20, top_p=0.9, min_p=0.02)])
def test_against_transformers_warpers_in_vllms_order(support):
    torch.manual_seed(0)
    logits = torch.randn(64, 300) * 3
    tokens = torch.randint(0, 300, (64,))
    scores = TemperatureLogitsWarper(0.7)(None, logits.clone())
    if support.min_p:
        scores = MinPLogitsWarper(support.min_p)(None, scores)
    if support.top_k:
        scores = TopKLogitsWarper(support.top_k)(None, scores)
    if support.top_p < 1:
        scores = TopPLogitsWarper(support.top_p)(None, scores)
    reference = torch.log_softmax(scores, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    inside = torch.isfinite(reference)  # drawn tokens a real sampler could have drawn
    assert inside.sum() > 0
    got = support_logps(logits / 0.7, tokens, support)
    torch.testing.assert_close(got[inside], reference[inside], atol=1e-5, rtol=0)


def _one_row(completion, prompt=(9, 1), prompt_mask=(0, 1)) -> RowContext:
    """One row — a prompt whose first token (9) is padding, then ``completion`` — at each completion position."""
    c = len(completion)
    return RowContext(torch.tensor([prompt]), torch.tensor([prompt_mask]), torch.tensor([completion]),
                      torch.zeros(c, dtype=torch.long), torch.arange(c))


def test_repetition_penalty_and_min_tokens_by_hand():
    """Logits (2, -1, 0.5, 0), penalty 2, min_tokens 2 with stop token 3. Position 0 has seen the prompt's token 1
    (token 9 is padding): -1 · 2 = -2, and the stop token is held back; position 1 has seen 2 as well: 0.5 / 2;
    position 2 may stop."""
    z = torch.tensor([[2.0, -1.0, 0.5, 0.0]] * 3)
    support = SamplingSupport(repetition_penalty=2.0, min_tokens=2, stop_ids=(3,))
    context = _one_row([2, 3, 0])
    got = reshaped_logits(z, support, context)
    inf = float("inf")
    torch.testing.assert_close(got, torch.tensor([[2.0, -2.0, 0.5, -inf], [2.0, -2.0, 0.25, -inf],
                                                  [2.0, -2.0, 0.25, 0.0]]))
    at = support_logps(z, torch.tensor([0, 2, 3]), support, context)
    expected = [2 - math.log(math.exp(2) + math.exp(-2) + math.exp(0.5)),
                0.25 - math.log(math.exp(2) + math.exp(-2) + math.exp(0.25)),
                0.0 - math.log(math.exp(2) + math.exp(-2) + math.exp(0.25) + 1)]
    assert at.tolist() == pytest.approx(expected, abs=1e-6)
    # a stop token drawn where the replay holds stops back was in the sampler's set: its value stays (finite)
    drawn = support_logps(z[:1], torch.tensor([3]), support, context, slice(0, 1))
    assert drawn.item() == pytest.approx(0.0 - math.log(math.exp(2) + math.exp(-2) + math.exp(0.5) + 1), abs=1e-6)
    with pytest.raises(ValueError, match="RowContext"):
        support_logps(z, torch.tensor([0, 2, 3]), support)


def test_held_stop_logps_from_the_stop_logits_alone_by_hand():
    """Logits (2, -1, 0.5, 0), stops {2, 3} held back: ``log p'(y) = log p(y) - log(1 - p(2) - p(3))``, a drawn stop
    keeping its own mass; equal to the whole row's replay (support_logps); a position where the stops hold more than
    half the mass is flagged for the whole row."""
    z = torch.tensor([2.0, -1.0, 0.5, 0.0])
    logp = torch.log_softmax(z, -1)
    stops = torch.tensor([2, 3])
    tokens = torch.tensor([0, 1, 3])
    values, unsure = held_stop_logps(logp[tokens], z[tokens], z[stops].expand(3, 2), tokens, stops)
    total = math.exp(2) + math.exp(-1) + math.exp(0.5) + 1
    expected = [2 - math.log(math.exp(2) + math.exp(-1)), -1 - math.log(math.exp(2) + math.exp(-1)),
                0 - math.log(math.exp(2) + math.exp(-1) + 1)]  # the drawn stop 3 stays in the set
    assert values.tolist() == pytest.approx(expected, abs=1e-6)
    assert not unsure.any()
    support = SamplingSupport(min_tokens=5, stop_ids=(2, 3))
    whole = torch.cat([support_logps(z[None], tokens[i:i + 1], support, _one_row([int(tokens[i])]), slice(0, 1))
                       for i in range(3)])
    torch.testing.assert_close(values, whole, rtol=0, atol=1e-6)
    assert (math.exp(0.5) + 1) / total < 0.5
    peaked = torch.tensor([0.0, -1.0, 3.0, 3.0])  # the stops hold 0.93 of the mass
    _, unsure = held_stop_logps(torch.log_softmax(peaked, -1)[:1], peaked[:1], peaked[stops][None], tokens[:1], stops)
    assert unsure.tolist() == [True]


def test_repetition_penalty_against_transformers_processor_with_top_k():
    """Each position's distribution as transformers' processors make it from the row so far (the prompt without its
    padding, then the completion before the position): repetition penalty, temperature, top-k."""
    generator = torch.Generator().manual_seed(1)
    vocab, c = 50, 12
    prompt, mask = torch.tensor([[0, 0, 5, 7, 7, 11]]), torch.tensor([[0, 0, 1, 1, 1, 1]])
    logits = torch.randn(c, vocab, generator=generator) * 2
    logits[:, :12] += 3  # a few likely tokens, so that the completion repeats some
    completion, reference = torch.zeros(1, c, dtype=torch.long), []
    for t in range(c):  # drawn as a sampler would, each position from the row so far
        so_far = torch.cat([prompt[0, 2:], completion[0, :t]]).unsqueeze(0)
        scores = RepetitionPenaltyLogitsProcessor(1.4)(so_far, logits[t:t + 1].clone())
        scores = TopKLogitsWarper(8)(None, TemperatureLogitsWarper(0.8)(None, scores))
        dist = torch.log_softmax(scores, -1)[0]
        completion[0, t] = torch.multinomial(dist.exp(), 1, generator=generator).item()
        reference.append(dist[completion[0, t]])
    reference = torch.stack(reference)
    assert len(set(completion[0].tolist()) & {7, 11, 5}) or len(set(completion[0].tolist())) < c  # repeats occur
    support = SamplingSupport(top_k=8, repetition_penalty=1.4)
    context = RowContext(prompt, mask, completion, torch.zeros(c, dtype=torch.long), torch.arange(c))
    got = support_logps(logits / 0.8, completion[0], support, context)
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)
    plain = support_logps(logits / 0.8, completion[0], SamplingSupport(top_k=8))
    assert (plain - reference).abs().max() > 0.05  # without the penalty replayed the two differ


def test_the_run_s_settings_and_generation_kwargs_make_the_support():
    from types import SimpleNamespace

    args = SimpleNamespace(top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.1,
                           generation_kwargs={"min_new_tokens": 4, "top_k": 20})
    support = SamplingSupport.from_config(args, stop_ids=[2, 0, 2])
    assert support == SamplingSupport(top_k=20, repetition_penalty=1.1, min_tokens=4, stop_ids=(0, 2))
    assert support.reshapes and support.penalises and support.holds_stops
    vllm = SamplingSupport.from_config(SimpleNamespace(top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0,
                                                       generation_kwargs={"min_tokens": 3}), stop_ids=[2])
    assert vllm.min_tokens == 3 and vllm.reshapes and not vllm.truncates
    assert not SamplingSupport(min_tokens=3).reshapes  # no stop tokens known: nothing held back


def test_icepop_is_a_two_sided_token_band():
    old = torch.log(torch.tensor([[1.0, 1.0, 1.0, 1.0]]))
    sampler = torch.log(torch.tensor([[1.0, 0.4, 3.0, 0.1]]))  # ratios 1, 2.5, 1/3, 10
    rho = sampler_importance_ratio(old, sampler, torch.ones(1, 4), "icepop", 0.5, 5.0)
    torch.testing.assert_close(rho, torch.tensor([[1.0, 2.5, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="'icepop' needs both bounds"):
        sampler_importance_ratio(old, sampler, torch.ones(1, 4), "icepop", None, 5.0)


def test_sequence_geometric_mask_is_length_normalised():
    """Row 0: token ratios 2 and 2 (geometric mean 2, product 4); row 1: 2 over one valid token of two."""
    d = math.log(2.0)
    old = torch.tensor([[d, d], [d, 5.0]])
    sampler = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    rho = sampler_importance_ratio(old, sampler, mask, "sequence_geometric_mask", None, 3.0)
    torch.testing.assert_close(rho, torch.tensor([[2.0], [2.0]]))
    product = sampler_importance_ratio(old, sampler, mask, "sequence_mask", None, 3.0)
    torch.testing.assert_close(product, torch.tensor([[0.0], [2.0]]))  # the product, 4, falls outside


def test_mismatch_metrics_by_hand():
    old = torch.log(torch.tensor([[1.0, 2.0, 0.5, 1.0]]))
    sampler = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    m = sampler_mismatch_metrics(old, sampler, mask, rho=torch.tensor([[1.0, 0.0, 0.5, 1.0]]))
    d = torch.log(torch.tensor([1.0, 2.0, 0.5]))
    assert m["mismatch_kl_k1"].item() == pytest.approx((-d).mean().item())
    assert m["mismatch_kl_k3"].item() == pytest.approx((d.exp() - d - 1).mean().item())
    assert m["importance_sampling_ratio/p50"].item() == pytest.approx(1.0)
    assert m["masked_token_frac"].item() == pytest.approx(1 / 3)
    assert m["masked_sequence_frac"].item() == 0.0
    all_masked = sampler_mismatch_metrics(old, sampler, mask, rho=torch.zeros(1, 1))
    assert all_masked["masked_sequence_frac"].item() == 1.0 and all_masked["masked_token_frac"].item() == 1.0
