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

Before the truncation, the sampler's own reshaping of the logits is replayed too, as vLLM orders it: ``min_tokens``
(``min_new_tokens``) sets the stop tokens' logits to ``-inf`` at the completion's first positions, and the repetition
penalty ``r`` divides a positive logit (multiplies a negative one) of every token already in the row — the prompt's
tokens (not its padding) and the completion's so far — by ``r`` (on the logits divided by the temperature, which
keeps their signs, as on the raw ones).

Pure torch; shapes: ``R`` rows (token positions), ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingSupport:
    """What a sampler does to the distribution before it draws: the truncation ``top_k`` (0: off), ``top_p`` (1.0:
    off), ``min_p`` (None or 0: off), and the reshaping before it: ``repetition_penalty`` (1.0: off) and
    ``min_tokens`` (0: off) with the ``stop_ids`` it holds back."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, args, stop_ids=()) -> SamplingSupport:
        """A run's sampler: ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty`` (TRL's fields),
        ``generation_kwargs`` overriding them as they override the sampler's, and its ``min_new_tokens`` (transformers)
        or ``min_tokens`` (vLLM); ``stop_ids``: the tokens that end a completion (what ``min_tokens`` holds back)."""
        extra = dict(getattr(args, "generation_kwargs", None) or {})
        top_k = extra.get("top_k", args.top_k)
        top_p = extra.get("top_p", args.top_p)
        min_p = extra.get("min_p", args.min_p)
        penalty = extra.get("repetition_penalty", getattr(args, "repetition_penalty", 1.0))
        min_tokens = extra.get("min_new_tokens", extra.get("min_tokens")) or 0
        return cls(top_k=int(top_k or 0), top_p=1.0 if top_p is None else float(top_p),
                   min_p=None if min_p is None else float(min_p),
                   repetition_penalty=1.0 if penalty is None else float(penalty), min_tokens=int(min_tokens),
                   stop_ids=tuple(sorted(set(int(i) for i in stop_ids))))

    @property
    def truncates(self) -> bool:
        return bool(self.top_k and self.top_k > 0) or self.top_p < 1.0 or bool(self.min_p)

    @property
    def penalises(self) -> bool:
        """Whether the repetition penalty is on: the log-probs then need each row's tokens so far."""
        return self.repetition_penalty != 1.0

    @property
    def holds_stops(self) -> bool:
        """Whether ``min_tokens`` holds stop tokens back at some positions."""
        return self.min_tokens > 0 and bool(self.stop_ids)

    @property
    def only_holds_stops(self) -> bool:
        """Whether holding stop tokens back is all the sampler changes (:func:`held_stop_logps` then applies)."""
        return self.holds_stops and not (self.truncates or self.penalises)

    @property
    def reshapes(self) -> bool:
        """Whether the sampler's distribution differs from the softmax at the temperature at all."""
        return self.truncates or self.penalises or self.holds_stops


@dataclass
class RowContext:
    """Where each of ``R`` token positions is — row ``rows[i]`` of the batch, completion position ``positions[i]`` —
    and what the rows hold: what the repetition penalty and ``min_tokens`` need to replay a sampler's distribution."""

    prompt_ids: torch.Tensor
    """(B, P) left-padded prompts."""
    prompt_mask: torch.Tensor
    """(B, P) 1 for prompt tokens."""
    completion_ids: torch.Tensor
    """(B, C) the completions."""
    rows: torch.Tensor
    """(R,) each position's row."""
    positions: torch.Tensor
    """(R,) each position's index in its completion."""

    @classmethod
    def of(cls, prompt_ids, prompt_mask, completion_ids, valid: torch.Tensor) -> RowContext:
        """The positions ``valid`` (B, C) marks, in the order ``x[valid]`` takes them."""
        rows, positions = valid.nonzero(as_tuple=True)
        return cls(prompt_ids, prompt_mask, completion_ids, rows, positions)

    def seen(self, block: slice, vocab: int) -> torch.Tensor:
        """(R_block, V) True for the tokens already in each position's row: its prompt's (padding aside) and its
        completion's before it."""
        rows, positions = self.rows[block], self.positions[block]
        prompt = self.prompt_ids[rows].masked_fill(self.prompt_mask[rows] == 0, vocab)
        completion = self.completion_ids[rows]
        before = torch.arange(completion.shape[1], device=completion.device) < positions.unsqueeze(1)
        ids = torch.cat([prompt, completion.masked_fill(~before, vocab)], 1).clamp(0, vocab)
        seen = torch.zeros(rows.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
        return seen.scatter_(1, ids, True)[:, :vocab]


def reshaped_logits(scaled_logits: torch.Tensor, support: SamplingSupport, context: RowContext | None = None,
                    block: slice = slice(None), tokens: torch.Tensor | None = None) -> torch.Tensor:
    """(R, V) float32 ``scaled_logits`` (the logits divided by the temperature) with the sampler's reshaping before
    its truncation: the repetition penalty on the tokens seen, and stop tokens at ``-inf`` before ``min_tokens``
    (``context``, its rows ``block``: needed when either is on; the two commute). ``tokens`` (R,), the ones drawn, are
    never held back: the sampler drew them, so they were in its set (where trainer and engine disagree on the stop
    tokens)."""
    z = scaled_logits.float()
    if not (support.penalises or support.holds_stops):
        return z
    if context is None:
        raise ValueError("the repetition penalty and min_tokens need each position's row (a RowContext)")
    if support.penalises:
        r = support.repetition_penalty
        z = torch.where(context.seen(block, z.shape[-1]), torch.where(z > 0, z / r, z * r), z)
    if support.holds_stops:
        drawn = torch.gather(z, -1, tokens.unsqueeze(-1)) if tokens is not None else None
        early = (context.positions[block] < support.min_tokens).nonzero()
        stops = torch.tensor(support.stop_ids, device=z.device)
        z = z.clone()
        z[early, stops[stops < z.shape[-1]].unsqueeze(0)] = float("-inf")
        if drawn is not None:
            z.scatter_(-1, tokens.unsqueeze(-1), drawn)
    return z


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


def support_logps(scaled_logits: torch.Tensor, tokens: torch.Tensor, support: SamplingSupport,
                  context: RowContext | None = None, block: slice = slice(None)) -> torch.Tensor:
    """(R,) ``log p_K(y) = z_y - logsumexp_{v ∈ K ∪ {y}} z_v`` for ``scaled_logits`` (R, V) = ``z/τ`` and the tokens
    ``y`` (R,) drawn, ``z`` first reshaped as the sampler did (:func:`reshaped_logits`, with ``context`` and its
    rows ``block``); the whole vocabulary's log-softmax when ``support`` neither truncates nor reshapes."""
    z = reshaped_logits(scaled_logits, support, context, block, tokens)
    if not support.truncates:
        return torch.gather(torch.log_softmax(z, dim=-1), -1, tokens.unsqueeze(-1)).squeeze(-1)
    keep = kept_tokens(z, support).scatter(-1, tokens.unsqueeze(-1), True)
    lse = torch.logsumexp(z.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.gather(z, -1, tokens.unsqueeze(-1)).squeeze(-1) - lse


HELD_STOP_MAX_MASS = 0.5
""":func:`held_stop_logps` trusts ``1 - q`` computed from float32 log-probs up to this held-back mass ``q``; a position
where the stop tokens held more than that gets its value from the whole row instead."""


def held_stop_logps(logps: torch.Tensor, drawn_logits: torch.Tensor, stop_logits: torch.Tensor, tokens: torch.Tensor,
                    stop_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p'(y)`` for a sampler whose only change to ``softmax(z)`` is holding the stop tokens ``S`` back (at the
    positions before ``min_tokens``), from the log-prob ``log p(y)`` the trainer already has and the logits of ``y`` and
    of ``S`` alone — no pass over the vocabulary:

    ``log p'(y) = log p(y) - log(1 - q)``, ``q = Σ_{s ∈ S, s ≠ y} p(s)``, ``p(s) = exp(z_s - lse)``,
    ``lse = z_y - log p(y)``.

    A drawn stop token stays in the set (the sampler drew it). ``logps`` (R,): ``log p(y)`` (float32, from the full
    softmax); ``drawn_logits`` (R,): ``z_y``; ``stop_logits`` (R, |S|): ``z_s`` (all already divided by the
    temperature); ``tokens`` (R,) ``y``; ``stop_ids`` (|S|,). Returns the values (R,) and a mask (R,) of the positions
    where ``q`` exceeds :data:`HELD_STOP_MAX_MASS`, whose ``1 - q`` the float32 ``log p(y)`` cannot give exactly: the
    caller computes those from the whole row."""
    lse = drawn_logits.double() - logps.double()
    held = (stop_logits.double() - lse.unsqueeze(-1)).exp()
    held = held.masked_fill(stop_ids.unsqueeze(0) == tokens.unsqueeze(-1), 0.0)
    q = held.sum(-1)
    unsure = q > HELD_STOP_MAX_MASS
    values = logps.double() - torch.log1p(-q.clamp(max=HELD_STOP_MAX_MASS))
    return values.to(logps.dtype), unsure
