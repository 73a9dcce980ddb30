"""Per-token log-probs and entropies of completion tokens.

Only the completion positions are projected to the vocabulary (``logits_to_keep``), and the log-softmax is
taken a few rows at a time so that at most one (rows, C, V) float32 block exists beside the model's logits.
"""

from __future__ import annotations

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` computes them, so a training forward sees the same
    positions the sampler saw."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logps_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, compute_entropy: bool = True,
    rows_per_chunk: int = 4, entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(z/τ)[token]`` and the entropy ``H = logsumexp(z/τ) - Σ p·z/τ`` per position.

    ``logits``: (B, C, V); ``tokens``: (B, C). Entropy is computed without gradient (it is a metric, and the
    input of the high-entropy mask) unless ``entropy_grad`` (an entropy bonus in the loss).
    """
    logps, ents = [], []
    for start in range(0, logits.shape[0], rows_per_chunk):
        z = logits[start:start + rows_per_chunk].float()
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)
        picked = torch.gather(z, -1, tokens[start:start + rows_per_chunk].unsqueeze(-1)).squeeze(-1)
        logps.append(picked - lse)
        if compute_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                p = torch.softmax(z, dim=-1)
                ents.append(lse - (p * z).sum(-1))
    logp = torch.cat(logps) if logps else logits.new_zeros(tokens.shape, dtype=torch.float32)
    ent = (torch.cat(ents) if ents else torch.zeros_like(logp)) if compute_entropy else None
    return logp, ent


def completion_logps(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    entropy_grad: bool = False,
    batch_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, C) of ``completion_ids`` given the prompts under ``model``, and entropies (B, C).

    Rows are processed ``batch_size`` at a time (all at once when None). Gradients flow when enabled by the
    caller.
    """
    c = completion_ids.shape[1]
    if c == 0:
        empty = completion_ids.new_zeros(completion_ids.shape, dtype=torch.float32)
        return empty, (empty.clone() if compute_entropy else None)
    step = batch_size or prompt_ids.shape[0]
    logps, ents = [], []
    for start in range(0, prompt_ids.shape[0], step):
        sl = slice(start, start + step)
        input_ids = torch.cat([prompt_ids[sl], completion_ids[sl]], 1)
        mask = torch.cat([prompt_mask[sl], completion_mask[sl]], 1)
        logits = _forward_logits(model, input_ids, mask, c + 1)[:, :-1]
        lp, ent = token_logps_and_entropy(logits, completion_ids[sl], temperature, compute_entropy,
                                          entropy_grad=entropy_grad)
        logps.append(lp)
        if ent is not None:
            ents.append(ent)
    return torch.cat(logps), (torch.cat(ents) if compute_entropy else None)


def _forward_logits(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, keep: int) -> torch.Tensor:
    kwargs = dict(input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False)
    try:
        logits = model(**kwargs, logits_to_keep=keep).logits
    except TypeError:  # a model without logits_to_keep
        logits = model(**kwargs).logits
    return logits[:, -keep:]
