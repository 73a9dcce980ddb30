"""Recording and replaying the experts a model's routers choose, by forward hooks on the routers (grpokit/moe/routers.py)
that exist for the span of one context only (a copy of the model made meanwhile carries none).

A recording is laid out like the batch's tokens: ``(rows, positions, layers, top_k)``, positions being the padded
prompt (left-padded) followed by the completion (right-padded), one index of :attr:`RouterSet.dtype` per slot and
:attr:`RouterSet.unrecorded` where a position was not routed by the recording pass (the completion's last token is
never fed back while generating; padding). A replayed forward routes such a token by its own router.

- :class:`RouteTap`: forwards over whole rows (the old log-probs' pass, the training forward): record the experts used,
  force recorded ones, and keep what the router itself would have chosen for the metrics.
- :class:`GenerationRoutes`: generation's forwards (a prefill, then one token a row per step, rows of a group sharing
  states in grpokit's decode loop), each call placed at its rows and positions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ..algorithms.routing import replayed_gate_weights, rerouted
from .routers import RouterSet


class RouteTap(contextlib.AbstractContextManager):
    """Hooks on every router while entered.

    ``forced`` (N, T, L, k): the experts each token of the forward must use (a recording; unrecorded slots route
    naturally). ``reference`` (N, T, L, k): a recording to compare the router's own choice with (the metrics).
    ``record``: keep the experts every call used (:meth:`recorded`). The forced and reference tensors must match the
    forwards' tokens row for row: each call of a router takes the next rows of them (a pass in row chunks), and
    after the last rows it starts over (gradient checkpointing recomputes the forward in the backward: the same
    experts are forced there)."""

    def __init__(self, routers: RouterSet, *, forced: torch.Tensor | None = None,
                 reference: torch.Tensor | None = None, record: bool = False):
        self.routers, self.record = routers, record
        self.forced = _flat(forced)
        self.reference = _flat(reference)
        self.calls: list[list[torch.Tensor]] = [[] for _ in routers.routers]
        self.used: list[torch.Tensor | None] = [None] * routers.layers
        """Per layer, the experts the first forward used (N·T, k), for the metrics."""
        self.differs: list[torch.Tensor | None] = [None] * routers.layers
        """Per layer, (N·T,) where the router's own choice differs from ``reference`` (first forward)."""
        self._cursor = {"forced": [0] * routers.layers, "reference": [0] * routers.layers}
        self._handles: list = []

    def __enter__(self) -> RouteTap:
        for router in self.routers.routers:
            self._handles.append(router.module.register_forward_hook(self._hook(router.layer, router.rule)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int, rule: str):
        def hook(module, args, output):
            logits, weights, experts = output
            if self.reference is not None and self.differs[layer] is None:
                reference = self._next(self.reference, layer, experts, "reference", strict=False)
                if reference is None:  # the metrics are best effort: a forward laid out otherwise goes unmeasured
                    self.reference = None
                    self.differs = [None] * self.routers.layers
                else:
                    self.differs[layer] = rerouted(experts, reference)
            if self.forced is not None:
                forced = self._next(self.forced, layer, experts, "forced").long()
                keep = (forced == self.routers.unrecorded).any(-1, keepdim=True)
                experts = torch.where(keep, experts, forced.to(experts.dtype))
                weights = replayed_gate_weights(logits, experts, rule, dtype=weights.dtype)
                output = (logits, weights, experts)
            if self.used[layer] is None:
                self.used[layer] = experts.detach().to(self.routers.dtype)
            if self.record:
                self.calls[layer].append(experts.detach().to(self.routers.dtype))
            return output
        return hook

    def _next(self, routes: torch.Tensor, layer: int, experts: torch.Tensor, what: str,
              strict: bool = True) -> torch.Tensor | None:
        """The rows of ``routes`` this call of router ``layer`` routes: the next ones after the previous call's (None,
        when not ``strict``, for a call they do not fit)."""
        cursors = self._cursor[what]
        start, tokens = cursors[layer], experts.shape[0]
        if start + tokens > routes.shape[0]:
            if not strict:
                return None
            raise RuntimeError(f"routing replay: router {layer} got {tokens} tokens, the {what} routes hold "
                               f"{routes.shape[0] - start} more: the forward is not laid out as the batch's rows")
        cursors[layer] = (start + tokens) % routes.shape[0]
        return routes[start:start + tokens, layer].to(experts.device)

    def recorded(self, rows: int, positions: int) -> torch.Tensor:
        """(rows, positions, L, k) the experts every recorded call used, the calls in order (row chunks of one
        pass)."""
        layers = [torch.cat(calls) if calls else None for calls in self.calls]
        tokens = rows * positions
        if any(t is None or t.shape[0] != tokens for t in layers):
            got = [None if t is None else t.shape[0] for t in layers]
            raise RuntimeError(f"routing recording: expected {tokens} tokens a layer ({rows} rows × {positions} "
                               f"positions), the routers saw {got}")
        return torch.stack(layers, 1).view(rows, positions, self.routers.layers, self.routers.top_k)


def recorded_forward(routers: RouterSet | None, rows: int, positions: int, forward: Callable[[], torch.Tensor], *,
                     record: list | None = None, force: torch.Tensor | None = None) -> torch.Tensor:
    """``forward()`` (a log-probs pass over ``rows`` whole rows of ``positions`` positions) for a model with
    ``routers``: the experts ``force`` (N, T, L, k) holds forced, and the experts it used appended to ``record`` (a
    list) as (N, T, L, k)."""
    if routers is None or (record is None and force is None):
        return forward()
    with RouteTap(routers, record=record is not None, forced=force) as tap:
        out = forward()
    if record is not None:
        record.append(tap.recorded(rows, positions))
    return out


def _flat(routes: torch.Tensor | None) -> torch.Tensor | None:
    return None if routes is None else routes.reshape(-1, routes.shape[-2], routes.shape[-1])


class GenerationRoutes(contextlib.AbstractContextManager):
    """The experts chosen while generating for ``rows`` rows of prompts ``prompt_len`` wide.

    Every forward of ``model``'s decoder is one call: its input's ``R`` rows of ``T_in`` tokens, whose attention mask
    is ``W`` columns wide, are the positions ``W - T_in ... W - 1`` of the rows. Which rows: those :meth:`expect` names
    for the next call (grpokit's decode loop: its live rows and the state each runs in), else every row (``R`` =
    ``rows``) or each group's rows (``R`` = ``rows / group``: a prompt prefilled once for its group)."""

    def __init__(self, model: torch.nn.Module, routers: RouterSet, rows: int):
        self.model, self.routers, self.rows = model, routers, rows
        self.calls: list[dict] = []
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._handles: list = []

    def expect(self, dest: torch.Tensor, source: torch.Tensor) -> None:
        """The next call's input row ``source[i]`` holds row ``dest[i]``."""
        self._pending = (dest, source)

    def __enter__(self) -> GenerationRoutes:
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model
        self._handles.append(decoder.register_forward_pre_hook(self._call, with_kwargs=True))
        for router in self.routers.routers:
            self._handles.append(router.module.register_forward_hook(self._router(router.layer)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _call(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        mask = kwargs.get("attention_mask")
        width = mask.shape[-1] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else ids.shape[1]
        self.calls.append({"rows": ids.shape[0], "tokens": ids.shape[1], "width": width, "map": self._pending,
                           "experts": [None] * self.routers.layers})
        self._pending = None

    def _router(self, layer: int):
        def hook(module, args, output):
            if self.calls:
                self.calls[-1]["experts"][layer] = output[2].detach().to(self.routers.dtype)
        return hook

    def routes(self, positions: int) -> torch.Tensor:
        """(rows, positions, L, k): each recorded call's experts at its rows and positions (positions beyond
        ``positions`` dropped), :attr:`RouterSet.unrecorded` where no call routed a position."""
        r = self.routers
        out = torch.full((self.rows, positions, r.layers, r.top_k), r.unrecorded, dtype=r.dtype)
        for call in self.calls:
            if any(e is None for e in call["experts"]):
                continue  # a forward that ran no router (none expected)
            n, t = call["rows"], call["tokens"]
            experts = torch.stack(call["experts"], 1).view(n, t, r.layers, r.top_k).cpu()
            dest, source = call["map"] if call["map"] is not None else _default_rows(self.rows, n)
            cols = torch.arange(call["width"] - t, call["width"])
            inside = cols < positions
            if not bool(inside.any()):
                continue
            placed = experts[source.cpu()][:, inside]
            out[dest.cpu().unsqueeze(1), cols[inside].unsqueeze(0)] = placed
        return out


def _default_rows(rows: int, called: int) -> tuple[torch.Tensor, torch.Tensor]:
    if called == rows:
        every = torch.arange(rows)
        return every, every
    if called and rows % called == 0:
        return torch.arange(rows), torch.arange(rows) // (rows // called)
    raise RuntimeError(f"routing recording: a generation forward over {called} rows cannot be placed among {rows}")
