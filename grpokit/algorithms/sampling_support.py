"""The support a truncating sampler draws from, and a token's log-prob on it (docs/algorithms.md §5).

A sampler with ``top_k``, ``top_p`` or ``min_p`` draws token ``y`` from the distribution at temperature ``τ``
truncated to a kept set ``K`` and renormalised: ``p_K(y) = p(y) / S`` with ``S = Σ_{v∈K} p(v)``, ``p = softmax(z/τ)``.
An engine that reports those log-probs (vLLM's ``processed_logprobs``) gives ``log p(y) - log S``; a trainer that
computes ``log p(y)`` over the whole vocabulary then sees ``log S`` in every token's sampler ratio ``exp(old - lp_s)``,
a bias that is no mismatch at all (TRL #6789). Putting the trainer's log-prob on the same support,
``log p_K(y) = z_y/τ - logsumexp_{v∈K} z_v/τ``, removes it.

``K`` is computed from the trainer's own logits in vLLM's order (``vllm/v1/sample/sampler.py``): temperature, then
``min_p`` (keep ``p(v) ≥ min_p · max p``), then ``top_k`` (the ``k`` largest), then ``top_p`` (drop the least likely
tokens while their total mass is at most ``1 - top_p``; the most likely token always stays). The sampled token is
always in ``K``: where trainer and engine round differently at the edge of the set, the token the engine drew was in
its set.

Pure torch; shapes: ``R`` rows (token positions), ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingSupport:
    """The truncation of a sampler: ``top_k`` (0: off), ``top_p`` (1.0: off), ``min_p`` (None or 0: off)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None

    @classmethod
    def from_config(cls, args) -> SamplingSupport:
        """A run's sampler truncation: ``top_k``, ``top_p``, ``min_p`` (TRL's fields), ``generation_kwargs``
        overriding them as they override the sampler's."""
        extra = dict(getattr(args, "generation_kwargs", None) or {})
        top_k = extra.get("top_k", args.top_k)
        top_p = extra.get("top_p", args.top_p)
        min_p = extra.get("min_p", args.min_p)
        return cls(top_k=int(top_k or 0), top_p=1.0 if top_p is None else float(top_p),
                   min_p=None if min_p is None else float(min_p))

    @property
    def truncates(self) -> bool:
        return bool(self.top_k and self.top_k > 0) or self.top_p < 1.0 or bool(self.min_p)


def kept_tokens(scaled_logits: torch.Tensor, support: SamplingSupport) -> torch.Tensor:
    """(R, V) True for the tokens in the kept set ``K`` of each row of ``scaled_logits`` (logits already divided by
    the temperature), in vLLM's order: ``min_p``, ``top_k``, ``top_p``."""
    z = scaled_logits.float()
    keep = torch.ones_like(z, dtype=torch.bool)
    if support.min_p:
        probs = torch.softmax(z, dim=-1)
        keep &= probs >= support.min_p * probs.max(dim=-1, keepdim=True).values
    if support.top_k and 0 < support.top_k < z.shape[-1]:
        kth = torch.topk(z.masked_fill(~keep, float("-inf")), support.top_k, dim=-1).values[..., -1:]
        keep &= z >= kth
    if support.top_p < 1.0:
        masked = z.masked_fill(~keep, float("-inf"))
        sorted_z, order = torch.sort(masked, dim=-1)  # ascending
        cumulative = torch.softmax(sorted_z, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1.0 - support.top_p
        drop_sorted[..., -1] = False  # the most likely token stays
        keep &= ~torch.zeros_like(keep).scatter(-1, order, drop_sorted)
    return keep


def support_logps(scaled_logits: torch.Tensor, tokens: torch.Tensor, support: SamplingSupport) -> torch.Tensor:
    """(R,) ``log p_K(y) = z_y - logsumexp_{v ∈ K ∪ {y}} z_v`` for ``scaled_logits`` (R, V) = ``z/τ`` and the tokens
    ``y`` (R,) drawn; the whole vocabulary's log-softmax when ``support`` does not truncate."""
    z = scaled_logits.float()
    if not support.truncates:
        return torch.gather(torch.log_softmax(z, dim=-1), -1, tokens.unsqueeze(-1)).squeeze(-1)
    keep = kept_tokens(z, support).scatter(-1, tokens.unsqueeze(-1), True)
    lse = torch.logsumexp(z.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.gather(z, -1, tokens.unsqueeze(-1)).squeeze(-1) - lse
