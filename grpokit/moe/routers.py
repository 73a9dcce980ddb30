"""A Mixture-of-Experts model's routers: found by what they do, each with the rule its gate weights follow.

transformers 5 gives every MoE family it ships a router module of its own whose forward takes the tokens' hidden
states (T, D) and returns ``(router_logits (T, E), gate_weights (T, k), experts (T, k))``; the MoE block then runs
the experts it names with those weights. Routing replay and the router metrics hook exactly there. A router is
recognised by that contract, checked on a probe input: its weights must follow one of
:data:`grpokit.algorithms.routing.GATE_RULES` from its logits and experts, so a family whose gate does something else
(group-limited routing, score-correction biases) is not recognised rather than replayed wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..algorithms.routing import GATE_RULES, replayed_gate_weights


@dataclass(frozen=True)
class Router:
    module: torch.nn.Module
    layer: int
    """Its place among the model's routers, in module order (the layer order)."""
    rule: str
    """How its gate weights follow from its logits and experts (:data:`GATE_RULES`)."""


@dataclass(frozen=True)
class RouterSet:
    """Every router of a model, in layer order; ``top_k`` experts a token among ``num_experts``."""

    routers: tuple[Router, ...]
    top_k: int
    num_experts: int

    @property
    def layers(self) -> int:
        return len(self.routers)

    @property
    def dtype(self) -> torch.dtype:
        """How a recorded expert index is stored: one byte up to 255 experts, else two."""
        return torch.uint8 if self.num_experts < 255 else torch.int16

    @property
    def unrecorded(self) -> int:
        """The value of an expert index that was not recorded (that token routes by its own router)."""
        return unrecorded_index(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """What a token's recording costs: ``layers × top_k`` indices of :attr:`dtype`."""
        return self.layers * self.top_k * (1 if self.dtype == torch.uint8 else 2)


def unrecorded_index(dtype: torch.dtype) -> int:
    """The index that marks an unrecorded slot in a recording of ``dtype``."""
    return 255 if dtype == torch.uint8 else -1


def _candidate(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith(("TopKRouter", "TopkRouter")) and isinstance(getattr(module, "weight", None), torch.Tensor)


@torch.no_grad()
def gate_rule(module: torch.nn.Module) -> str | None:
    """The rule the router's gate weights follow (:data:`GATE_RULES`), found by running it on a probe input; None when
    its output is not ``(logits, weights, experts)`` or its weights follow none of them."""
    weight = module.weight
    if weight.dim() != 2 or not weight.dtype.is_floating_point or weight.device.type == "meta":
        return None
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(5, weight.shape[1], generator=generator).to(device=weight.device, dtype=weight.dtype)
    try:
        out = module(probe)
    except Exception:  # noqa: BLE001 - a module that only looks like a router
        return None
    if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
        return None
    logits, weights, experts = out
    if logits.shape != (5, weight.shape[0]) or experts.shape != weights.shape or experts.dtype.is_floating_point:
        return None
    rtol = 1e-4 if weights.dtype in (torch.float32, torch.float64) else 2e-2  # bf16 / fp16 routers round
    for rule in GATE_RULES:
        expected = replayed_gate_weights(logits, experts, rule, dtype=weights.dtype)
        if torch.allclose(expected.float(), weights.float(), rtol=rtol, atol=1e-6):
            return rule
    return None


def find_routers(model: torch.nn.Module) -> RouterSet | None:
    """The model's routers (any PEFT/DDP wrapper around it), or None for a model without any; a ValueError naming the
    module when a router-like module does not follow a known rule, or routers disagree on ``top_k`` / the number of
    experts."""
    modules = [(name, m) for name, m in model.named_modules() if _candidate(m)]
    if not modules:
        return None
    routers, shapes = [], set()
    for layer, (name, module) in enumerate(modules):
        rule = gate_rule(module)
        if rule is None:
            raise ValueError(f"{name} ({type(module).__name__}) is a Mixture-of-Experts router whose gate grpokit "
                             f"does not recognise (expected weights following one of {GATE_RULES}): routing replay "
                             "and the router metrics cannot be used with this model")
        routers.append(Router(module, layer, rule))
        shapes.add((int(getattr(module, "top_k", 0)) or None, int(module.weight.shape[0])))
    if len(shapes) != 1 or next(iter(shapes))[0] is None:
        raise ValueError(f"the model's routers disagree on (top_k, experts): {sorted(shapes, key=str)}; routing "
                         "replay needs one shape")
    top_k, num_experts = next(iter(shapes))
    return RouterSet(tuple(routers), top_k, num_experts)


def has_routers(model: torch.nn.Module) -> bool:
    """Whether the model holds router modules (cheap: no probe)."""
    return any(_candidate(m) for m in model.modules())
