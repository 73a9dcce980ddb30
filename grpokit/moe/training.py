"""What a run does with a Mixture-of-Experts policy: the router's load-balancing loss (TRL's ``router_aux_loss_coef``),
routing replay (``routing_replay``) and the router metrics. docs/algorithms.md, "Mixture-of-Experts".

- ``"none"``: every forward routes by its own router; the generation's routes are recorded all the same, for the
  metrics.
- ``"old"`` (R2): the experts the old log-probs' forward used (the batch reused across optimizer steps, a sampler that
  is not the trainer, or the asynchronous producer's behaviour pass) are forced in the training forward. A batch
  trained exactly on-policy has no old pass: its training forward is that pass.
- ``"rollout"`` (R3): the experts chosen while generating are forced in the training forward, and in the old
  log-probs' forward where there is one (as verl does), so the policy ratio ``π_θ / π_old`` compares two forwards
  that route alike.

Forced experts get their gate weights from the current router (``grpokit.algorithms.routing.replayed_gate_weights``),
so the router keeps learning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ..algorithms.routing import load_imbalance, ratio_std
from ..config import ROUTING_REPLAY_MODES
from ..forward.sharding import sharding_kind
from ..validation import refusal
from .recording import RouteTap
from .routers import RouterSet, find_routers, has_routers

__all__ = ["ROUTING_REPLAY_MODES", "MoeRouting", "router_aux_loss_coef"]


def _text_config(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(base, "config", None)
    return base, (cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg)


def router_aux_loss_coef(model, args) -> float:
    """The MoE load-balancing loss coefficient, as TRL: ``router_aux_loss_coef``, or the model config's when None;
    0 (off) for a model that does not return router logits. A coefficient set for a dense model is an error."""
    base, text = _text_config(model)
    is_moe = hasattr(text, "output_router_logits")
    coef = args.router_aux_loss_coef
    if coef is None:
        coef = float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)
    elif coef != 0.0 and not is_moe:
        raise refusal("router_aux_loss_coef", coef, f"{type(base).__name__} is not a Mixture-of-Experts model that "
                      "returns router logits; leave it None")
    return float(coef) if is_moe else 0.0


class MoeRouting:
    """A run's routers and its ``routing_replay``; checked when the trainer is made (before training starts).

    ``no_recording``: why the run's sampler does not record the experts it chooses ("" when it does: grpokit's
    transformers backend; vLLM, a ``rollout_func`` and the tool loop do not)."""

    def __init__(self, model: torch.nn.Module, args, *, no_recording: str = ""):
        self.mode = args.routing_replay
        self.aux_loss_coef = router_aux_loss_coef(model, args)
        base, _ = _text_config(model)
        self.routers: RouterSet | None = None
        if has_routers(model):
            try:
                self.routers = find_routers(model)
            except ValueError:
                if self.mode != "none":
                    raise
        if self.mode != "none" and self.routers is None:
            raise refusal("routing_replay", self.mode, f"{type(base).__name__} is not a Mixture-of-Experts model with "
                          "routers grpokit recognises; leave it 'none'")
        if self.mode == "rollout" and no_recording:
            raise refusal("routing_replay", "rollout", "it does not record the experts it routes to; use "
                          "routing_replay='old'", when=f"with {no_recording}")
        self.records_generation = self.routers is not None and not no_recording
        self._tap: RouteTap | None = None

    @contextlib.contextmanager
    def training_forward(self, model: torch.nn.Module, batch) -> Iterator[None]:
        """Around a micro-batch's forward and backward (a recomputed forward gets the same experts): the experts
        ``routing_replay`` forces, and what the router would choose, kept for :meth:`record_metrics`."""
        if self.routers is None:
            yield
            return
        if self.mode != "none" and sharding_kind(model) is not None:
            raise refusal("routing_replay", self.mode, "train with DDP or on one process, or leave it 'none'",
                          when=f"with {sharding_kind(model)} sharded weights yet")
        if self.mode == "rollout" and batch.sampler_routes is None:
            raise RuntimeError("routing_replay='rollout': this batch holds no recording of the sampler's experts (its "
                               "generation did not record them); nothing would be replayed")
        forced = {"old": batch.old_routes, "rollout": batch.sampler_routes}.get(self.mode)
        reference = batch.sampler_routes if batch.sampler_routes is not None else batch.old_routes
        self._tap = RouteTap(self.routers, forced=forced, reference=reference)
        try:
            with self._tap:
                yield
        finally:
            self._tap = None

    def record_metrics(self, logps: torch.Tensor, batch, record: Callable[[str, float | torch.Tensor], None]) -> None:
        """The router metrics of the training forward just run (none outside :meth:`training_forward`), over the
        positions whose hidden state gives a completion token's log-prob (position ``P - 1 + t`` predicts completion
        token ``t``):

        - ``moe/rerouted_share`` (and ``.../layer_<i>``): the share of those tokens whose top-k expert set under the
          training forward's own router differs from the sampler's recording (else the old pass's), averaged over the
          layers; ``moe/rerouted_any_layer``: the share that differs in at least one layer;
        - ``moe/ratio_std/rerouted`` and ``moe/ratio_std/kept``: the spread (std) of the training/inference ratio
          ``π_θ / π_sampler`` (a sampler that reports its log-probs) over tokens re-routed in some layer and over the
          others; ``moe/policy_ratio_std/...`` the same of the policy ratio ``π_θ / π_old`` (where old log-probs
          are computed);
        - ``moe/load_imbalance``: ``E · max_e load_e`` of the experts the forward used, averaged over the layers."""
        tap = self._tap
        if tap is None or tap.used[0] is None:
            return
        r = self.routers
        n, c = batch.completion_ids.shape
        width = batch.prompt_ids.shape[1] + c
        if any(u is None or u.shape[0] != n * width for u in tap.used):
            return  # a forward not laid out as the batch's rows goes unmeasured
        valid = batch.loss_mask.bool()
        picks = (torch.arange(c, device=valid.device) + width - c - 1).expand(n, c)[valid]  # predicting positions
        rows = torch.arange(n, device=valid.device).unsqueeze(1).expand(n, c)[valid]
        flat = (rows * width + picks).cpu()
        imbalance = [load_imbalance(used[flat], r.num_experts) for used in tap.used]
        record("moe/load_imbalance", torch.stack(imbalance).mean())
        if any(d is None for d in tap.differs) or flat.numel() == 0:
            return
        differs = torch.stack([d.cpu()[flat] for d in tap.differs], 1)  # (tokens, L)
        record("moe/rerouted_share", differs.float().mean())
        record("moe/rerouted_any_layer", differs.any(1).float().mean())
        for layer in range(r.layers):
            record(f"moe/rerouted_share/layer_{layer:02d}", differs[:, layer].float().mean())
        any_layer = differs.any(1)
        for prefix, behaviour in (("moe/ratio_std", batch.sampler_logps), ("moe/policy_ratio_std", batch.old_logps)):
            if behaviour is None:
                continue
            log_ratio = (logps.detach() - behaviour)[valid].cpu()
            for name, where in (("rerouted", any_layer), ("kept", ~any_layer)):
                spread = ratio_std(log_ratio, where)
                if not torch.isnan(spread):
                    record(f"{prefix}/{name}", spread)


def route_recording_absent(rollout, rollout_func, multiturn, model=None) -> str:
    """Why the run's sampler cannot record a Mixture-of-Experts policy's experts ("" when it can: grpokit's
    transformers backend generating every completion in one call)."""
    from ..rollout.transformers_backend import TransformersRollout

    if rollout_func is not None:
        return "a rollout_func"
    if multiturn is not None:
        return "tools or an environment_factory"
    from ..vision.detection import is_vlm

    if model is not None and is_vlm(model):  # (a VLM's generation with images is not laid out as its rows yet)
        return "a vision-language model"
    if type(rollout).__name__ == "VLLMRollout":  # vLLM can (enable_return_routed_experts); grpokit's client does not ask
        return "use_vllm=True (grpokit does not ask vLLM for the experts it routes to yet)"
    return "" if isinstance(rollout, TransformersRollout) else f"the {type(rollout).__name__} rollout backend"

