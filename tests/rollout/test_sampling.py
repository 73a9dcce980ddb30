"""The CPU sampler (grpokit/rollout/sampling.py): the distribution once per decode state, the top-k tokens alone
through the warpers and the cumulative sum, and the draws those shortcuts give equal to the plain whole-vocabulary
inverse-CDF draw, row by row, for the same random stream."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpokit.rollout.sampling import InverseCDFSampler, _rank_within

SETTINGS = [dict(temperature=0.9, top_k=50), dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9),
            dict(temperature=1.3, top_k=8, min_p=0.05), dict(temperature=0.9, top_p=0.8)]


def whole_vocabulary_draw(scores, temperature, top_k=0, top_p=1.0, min_p=None):
    """The reference: transformers' warpers on every token, softmax, the float64 cumulative sum over the whole
    vocabulary, one uniform per row scaled by the total, the first entry past it."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p is not None:
        warpers.append(MinPLogitsWarper(min_p))
    probs = torch.softmax(warpers(None, scores.clone()).float(), -1)
    cdf = probs.double().cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, dtype=torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[1] - 1).squeeze(1), probs


@pytest.mark.parametrize("kwargs", SETTINGS)
def test_draws_equal_the_whole_vocabulary_draw_row_by_row(kwargs):
    torch.manual_seed(0)
    scores = torch.randn(64, 3000) * 3
    torch.manual_seed(1)
    expected, probs = whole_vocabulary_draw(scores, **kwargs)
    torch.manual_seed(1)
    got = InverseCDFSampler(**kwargs).draw(None, scores.clone())
    assert torch.equal(got, expected)
    assert (probs.gather(1, got[:, None]) > 0).all()


@pytest.mark.parametrize("kwargs", SETTINGS)
def test_rows_of_a_state_draw_as_if_each_had_its_distribution(kwargs):
    """One distribution per state and ``owner`` mapping rows to states (unsorted, states of 1-4 rows, one of none):
    the tokens equal drawing from the distribution repeated for every row, with the same random stream."""
    torch.manual_seed(0)
    states = torch.randn(5, 3000) * 3
    owner = torch.tensor([2, 0, 2, 1, 2, 0, 4, 2, 1])  # state 3 has no row left
    sampler = InverseCDFSampler(**kwargs)
    torch.manual_seed(7)
    got = sampler.draw(None, states.clone(), owner)
    torch.manual_seed(7)
    expected = sampler.draw(None, states[owner].clone())
    assert torch.equal(got, expected)
    torch.manual_seed(7)
    assert torch.equal(got, whole_vocabulary_draw(states[owner], **kwargs)[0])


def test_the_rows_of_a_state_draw_independently_from_its_distribution():
    """Many rows of one state: their tokens' frequencies are the warped distribution (total variation < 0.02 over
    40 000 rows), none outside the top-k."""
    torch.manual_seed(0)
    state = torch.randn(1, 40) * 2
    owner = torch.zeros(40_000, dtype=torch.long)
    drawn = InverseCDFSampler(0.8, top_k=6).draw(None, state.clone(), owner)
    exact = torch.softmax(TopKLogitsWarper(6)(None, TemperatureLogitsWarper(0.8)(None, state.clone())), -1)[0]
    freq = torch.bincount(drawn, minlength=40).double() / len(drawn)
    assert (freq[exact == 0] == 0).all()
    assert 0.5 * (freq - exact.double()).abs().sum() < 0.02


def test_a_tie_at_the_kth_logit_keeps_every_tied_token_as_transformers_does():
    """top_k 2 with logits [3, 2, 2, 2, 0, ...]: transformers keeps the four tokens ≥ the second largest; so do the
    draws (each of the tied tokens drawn), and they equal the whole-vocabulary draw."""
    scores = torch.full((2000, 10), -1.0)
    scores[:, :4] = torch.tensor([3.0, 2.0, 2.0, 2.0])
    torch.manual_seed(3)
    got = InverseCDFSampler(1.0, top_k=2).draw(None, scores.clone())
    torch.manual_seed(3)
    assert torch.equal(got, whole_vocabulary_draw(scores, 1.0, top_k=2)[0])
    assert set(got.tolist()) == {0, 1, 2, 3}


def test_fewer_finite_logits_than_k():
    """Tokens masked to -inf (end of sequence before min_new_tokens) among the top k: never drawn."""
    scores = torch.full((500, 30), float("-inf"))
    scores[:, [4, 9, 17]] = torch.tensor([1.0, 0.5, 0.0])
    torch.manual_seed(0)
    got = InverseCDFSampler(0.9, top_k=10).draw(None, scores.clone())
    assert set(got.tolist()) == {4, 9, 17}


def test_rank_within_counts_earlier_rows_of_the_same_state():
    owner = torch.tensor([2, 0, 2, 1, 2, 0])
    assert _rank_within(owner, 3).tolist() == [0, 0, 1, 0, 2, 1]
