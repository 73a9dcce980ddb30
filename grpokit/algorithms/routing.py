"""Mixture-of-Experts routing: the gate weights of replayed experts, and the router metrics (docs/algorithms.md).

Routing replay. A token's top-k experts are chosen by its router; when the pass that sampled a token (or computed its
old log-probs) and the training forward choose different experts for it, its importance ratio measures two different
networks and swings far outside any clipping range. Routing Replay (Zheng et al., "Group Sequence Policy Optimization",
arXiv 2507.18071, §5: the experts activated under ``π_old`` are cached and replayed under ``π_θ``; verl's R2) and
Rollout Routing Replay (Ma et al., arXiv 2510.11370; verl's R3: the experts the rollout engine chose) force the
recorded experts ``E_t`` in the training forward. The gate weights over the forced experts come from the *current*
router logits ``z_t`` (so the router still gets a gradient), by the family's own rule:

- ``softmax`` (Qwen2-MoE and OLMoE as configured by default): ``w_t,e = softmax(z_t)_e`` for ``e ∈ E_t``;
- ``softmax_renormalised`` (Qwen3-MoE, Qwen3.5-MoE, Mixtral; any family with ``norm_topk_prob``):
  ``w_t,e = softmax(z_t)_e / Σ_{e'∈E_t} softmax(z_t)_e'``, which is also GPT-OSS's softmax over its top-k logits,
  ``softmax(z_t[E_t])`` (the same numbers up to rounding: computed here in float32).

Pure torch; shapes: ``T`` tokens, ``E`` experts, ``k`` experts a token.
"""

from __future__ import annotations

import torch

from ..validation import refusal

GATE_RULES = ("softmax", "softmax_renormalised")


def replayed_gate_weights(logits: torch.Tensor, experts: torch.Tensor, rule: str,
                          dtype: torch.dtype | None = None) -> torch.Tensor:
    """(T, k) the gate weights of the experts ``experts`` (T, k) from router logits ``logits`` (T, E) by ``rule``
    (:data:`GATE_RULES`), in ``dtype`` (default: the logits'). Differentiable in ``logits``."""
    if rule not in GATE_RULES:
        raise refusal("rule", rule, f"expected one of {GATE_RULES}")
    weights = torch.gather(torch.softmax(logits, dim=-1, dtype=torch.float), -1, experts.long())
    if rule == "softmax_renormalised":
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(dtype or logits.dtype)


def rerouted(chosen: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """(T,) True where a token's expert *set* differs: ``set(chosen[t]) != set(recorded[t])`` for (T, k) index
    tensors (the order of the k experts does not matter)."""
    return (chosen.long().sort(-1).values != recorded.long().sort(-1).values).any(-1)


def expert_load(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) the share of the (token, slot) assignments of ``experts`` (T, k) each expert receives (sums to 1; zeros
    for no token)."""
    counts = torch.bincount(experts.reshape(-1).long(), minlength=num_experts)[:num_experts].float()
    return counts / counts.sum().clamp_min(1.0)


def load_imbalance(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``E · max_e load_e``: 1 when every expert receives the same share, ``E`` when one receives everything (the
    max-to-mean load ratio of the expert-parallel literature). 0 for no token."""
    return expert_load(experts, num_experts).max() * num_experts


def ratio_std(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The standard deviation (population) of the importance ratio ``exp(log_ratio)`` over the tokens where ``mask``
    is True; NaN for none. ``log_ratio`` is clamped to ±20 first, as every log-ratio of the loss is."""
    r = torch.exp(log_ratio.float()[mask].clamp(-20.0, 20.0))
    if r.numel() == 0:
        return r.new_tensor(float("nan"))
    return (r - r.mean()).pow(2).mean().sqrt()
