"""Drawing tokens on a CPU: transformers' warpers and one inverse-CDF draw per row, the distribution computed once per
decode state.

``torch.multinomial`` on a CPU draws one exponential per vocabulary entry (for 32 rows × 49k tokens, a good part of
a decode step of SmolLM2-135M); one uniform per row and a search in the cumulative probabilities costs a small
fraction of that (benchmarks/RESULTS.md, 'Measurements behind design choices'). Two
more things keep the draw cheap where a confident policy makes it the larger part of a step:

* *once per state*: rows that share a history (:mod:`grpokit.rollout.decode`) have the same distribution; it is
  warped, normalised and summed once for them, and each row draws its own uniform in it;
* *top-k first*: with ``top_k`` set, only the ``k`` kept tokens go through softmax, top-p, min-p and the cumulative
  sum (their logits in vocabulary order, so a uniform picks the token the whole-vocabulary sum would), not the whole
  vocabulary with ``-inf`` elsewhere; where the k-th largest logit ties with others outside the ``k`` (transformers
  keeps every token ≥ it) the whole vocabulary is used.

The distribution is transformers' exactly (its own warper classes in its order: temperature, top-k, top-p, min-p);
the random stream is ours: one ``torch.rand`` per row, in row order.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .base import SamplingParams

#: generation keyword arguments the fast sampler leaves to ``generate`` (processors that run in both of its modes)
SAMPLER_SAFE_EXTRA = {"min_new_tokens", "min_length", "suppress_tokens", "begin_suppress_tokens", "bad_words_ids",
                      "no_repeat_ngram_size", "cache_implementation"}


class InverseCDFSampler(LogitsProcessor):
    """Sampling with transformers' warpers (temperature, top-k, top-p, min-p, in its order) and one token drawn per row
    by inverse-CDF on the float64 cumulative probabilities.

    :meth:`draw` gives the tokens (the decode loop's use); called as a logits processor (the last one of a greedy
    ``generate``) it returns the drawn token as the only finite score, so that greedy's argmax picks it."""

    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float | None = None):
        self.recorded: list[torch.Tensor] | None = None
        """When a list: each call as a logits processor appends the drawn tokens' log-probs (:meth:`draw`)."""
        self.temperature = TemperatureLogitsWarper(temperature) if temperature != 1.0 else None
        self.top_k = int(top_k or 0)
        self.after_top_k = LogitsProcessorList()
        if top_p < 1.0:
            self.after_top_k.append(TopPLogitsWarper(top_p=top_p))
        if min_p is not None:
            self.after_top_k.append(MinPLogitsWarper(min_p=min_p))

    def distribution(self, input_ids: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(probs, tokens)``: each row's warped distribution over ``tokens`` (R, K), the kept top-k tokens in
        vocabulary order, or over the whole vocabulary when ``tokens`` is None."""
        if self.temperature is not None:
            scores = self.temperature(input_ids, scores)
        tokens = None
        if 0 < self.top_k < scores.shape[-1]:
            values, tokens = scores.topk(self.top_k, dim=-1)
            if bool(((scores >= values[:, -1:]).sum(-1) > self.top_k).any()):  # a tie at the k-th: keep them all
                scores, tokens = TopKLogitsWarper(top_k=self.top_k)(input_ids, scores), None
            else:
                tokens, order = tokens.sort(-1)
                scores = values.gather(-1, order)
        if self.after_top_k:
            scores = self.after_top_k(input_ids, scores)
        return torch.softmax(scores.float(), dim=-1), tokens

    def draw(self, input_ids: torch.Tensor, scores: torch.Tensor, owner: torch.Tensor | None = None,
             with_logps: bool = False):
        """One token per row. ``scores`` (S, V): one distribution per row, or with ``owner`` (N,) one per *state*,
        ``owner[i]`` the state of row ``i`` (rows of a state draw independently from it); ``input_ids``: the
        sequences of the rows of ``scores``. ``with_logps``: ``(tokens, logps)``, each token's log-prob under the
        distribution it was drawn from (after every warper, renormalised over what they kept: what vLLM reports as
        ``processed_logprobs``)."""
        probs, tokens = self.distribution(input_ids, scores)
        cdf = probs.double().cumsum_(-1)
        last = cdf.shape[-1] - 1
        if owner is None:
            u = torch.rand(cdf.shape[0], 1, dtype=torch.float64, device=cdf.device) * cdf[:, -1:]
            picked = torch.searchsorted(cdf, u, right=True).clamp_(max=last)
            drawn = (picked if tokens is None else tokens.gather(-1, picked)).squeeze(1)
            return (drawn, probs.gather(-1, picked).squeeze(1).log()) if with_logps else drawn
        n = owner.shape[0]
        u = torch.rand(n, dtype=torch.float64, device=cdf.device) * cdf[owner, -1]
        rank = _rank_within(owner, cdf.shape[0])  # each state's rows in columns 0, 1, ...
        targets = torch.zeros(cdf.shape[0], int(rank.max()) + 1, dtype=torch.float64, device=cdf.device)
        targets[owner, rank] = u
        picked = torch.searchsorted(cdf, targets, right=True).clamp_(max=last)[owner, rank]
        drawn = picked if tokens is None else tokens[owner, picked]
        return (drawn, probs[owner, picked].log()) if with_logps else drawn

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        token, logps = self.draw(input_ids, scores, with_logps=True)
        if self.recorded is not None:
            self.recorded.append(logps)
        return torch.full_like(scores, float("-inf")).scatter_(1, token.unsqueeze(1), 0.0)


def _rank_within(owner: torch.Tensor, n_states: int) -> torch.Tensor:
    """For each row, how many rows before it (in row order) have its state."""
    order = torch.sort(owner, stable=True).indices
    counts = torch.bincount(owner, minlength=n_states)
    starts = counts.cumsum(0) - counts
    rank = torch.empty_like(owner)
    rank[order] = torch.arange(owner.shape[0], device=owner.device) - starts[owner[order]]
    return rank


def fast_sampler(params: SamplingParams, device: torch.device) -> InverseCDFSampler | None:
    """The :class:`InverseCDFSampler` for ``params`` on a CPU (where ``torch.multinomial`` is slow), when nothing in
    ``params.extra`` needs ``generate``'s own sampling mode; else None."""
    if device.type != "cpu" or not params.do_sample or set(params.extra) - SAMPLER_SAFE_EXTRA:
        return None
    return InverseCDFSampler(params.temperature, params.top_k, params.top_p, params.min_p)
