"""Forwards outside the training step when training shards the weights (FSDP2, FSDP1, DeepSpeed ZeRO-3).

Under sharding, every forward of the model gathers each layer's weights from all ranks, so two rules hold:

1. every rank must run the same number of forwards, in the same order. Rollouts end at different lengths on
   different ranks, and the prompt-sharing shortcuts (one prefill per group) depend on each rank's rows;
   so under sharding ``generate`` runs with ``synced_gpus=True`` (a finished rank keeps stepping until all are
   done) and the shortcuts are off, unless the full weights were gathered first (below);
2. a weight is only whole inside its module's forward: code that uses ``lm_head.weight`` after the forward
   (grpokit's chunked log-prob head) would see a shard. :func:`sharding_kind` tells ``logprobs`` to use the
   model's own logits instead.

Gathering for generation (TRL's ``ds3_gather_for_generation``, default True, here for FSDP2 as well): every
rank materialises the full weights once for the rollout, so its forwards need no communication, ranks may stop
at different lengths and the prefill can be shared; memory: one full copy of the weights per rank while
generating. ``False`` keeps only shards (for models that do not fit whole on one device), at the cost of one
gather per layer per generated token.

What each sharding does here:

- FSDP2 (``fully_shard``, accelerate ``fsdp_version: 2``): gathered with the public ``unshard()`` of every FSDP
  module, kept whole across forwards with ``set_reshard_after_forward(False)``, then resharded and the previous
  setting restored. Tested on CPU with two gloo processes (tests/distributed).
- FSDP1 (``FullyShardedDataParallel``): not gathered (its ``summon_full_params`` forbids the forwards generation
  needs); the root's own parameters are summoned and generation runs in lockstep.
- DeepSpeed ZeRO-3: not gathered (DeepSpeed's hooks re-partition every parameter after each module's forward,
  and removing them needs its private API); generation runs in lockstep. ZeRO-1/2 keep whole weights: nothing
  to do.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


def sharding_kind(model: torch.nn.Module) -> str | None:
    """``"fsdp2"``, ``"fsdp1"``, ``"zero3"`` when ``model`` (or a module inside it) holds sharded weights, else
    None. Accepts wrapped (DeepSpeed engine, FSDP1) and unwrapped models."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        FSDPModule = FullyShardedDataParallel = None
    if FSDPModule is not None:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                return "fsdp2"
            if isinstance(m, FullyShardedDataParallel):
                return "fsdp1"
    first = next(model.parameters(), None)  # ZeRO-3 partitions every parameter: each carries a ds_id
    return "zero3" if first is not None and hasattr(first, "ds_id") else None


@dataclass
class GenerationWeights:
    model: torch.nn.Module
    """The module to call ``generate`` on."""
    lockstep: bool
    """True when every forward communicates: all ranks must run the same forwards (``synced_gpus``)."""


@contextmanager
def weights_for_generation(model: torch.nn.Module, unwrapped: torch.nn.Module, gather: bool
                           ) -> Iterator[GenerationWeights]:
    """The model to generate with, and how, given the trainer's (possibly wrapped) ``model`` and its
    ``unwrapped`` module; see the module docstring. Collective under sharding: every rank must enter."""
    kind = sharding_kind(model)
    if kind is None:
        yield GenerationWeights(unwrapped, lockstep=False)
    elif kind == "fsdp2":
        if gather:
            with _fsdp2_unsharded(model):
                yield GenerationWeights(unwrapped, lockstep=False)
        else:
            yield GenerationWeights(unwrapped, lockstep=True)
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, recurse=False, writeback=False):
            yield GenerationWeights(unwrapped, lockstep=True)
    else:
        yield GenerationWeights(unwrapped, lockstep=True)


@contextmanager
def full_weights(model: torch.nn.Module) -> Iterator[None]:
    """Every parameter whole on every rank inside the block, for reading them (pushing weights to a vLLM engine);
    no forward may run inside. Collective under sharding: every rank must enter."""
    kind = sharding_kind(model)
    if kind == "fsdp2":
        with _fsdp2_unsharded(model):
            yield
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, recurse=True, writeback=False):
            yield
    elif kind == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            yield
    else:
        yield


@contextmanager
def _fsdp2_unsharded(model: torch.nn.Module) -> Iterator[None]:
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    saved = [_reshard_setting(m) for m in units]
    try:
        for m in units:  # the same order on every rank: the all-gathers pair up
            m.unshard()
            m.set_reshard_after_forward(False, recurse=False)
        yield
    finally:
        for m, setting in zip(units, saved):
            m.reshard()
            _restore_reshard_setting(m, setting)


def _reshard_setting(unit) -> tuple:
    """FSDP2 has a setter for reshard-after-forward but no getter: read the per-group value it sets."""
    state = unit._get_fsdp_state()
    return state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups]


def _restore_reshard_setting(unit, setting: tuple) -> None:
    state = unit._get_fsdp_state()
    state._auto_reshard_after_forward = setting[0]
    for group, info in zip(state._fsdp_param_groups, setting[1]):
        group.post_forward_mesh_info = info
