"""What crosses between a learner and whatever samples, as declared protocols: what sampling needs
(:class:`SamplingDriver`; :class:`ContinuingDriver` for partial rollouts), what finishing needs
(:class:`FinishingDriver`), both (:class:`RolloutDriver`), what the asynchronous producer needs from the learner
(:class:`LearnerDriver`), a weight source (:class:`WeightSource`) and a producer (:class:`Producer`).

The learner (:class:`grpokit.trainer_driver.TrainerDriver`, the trainer's side) offers all of it; the asynchronous
producer's driver (:class:`grpokit.pipeline.producer.SamplerDriver`) offers the sampling half only — its own copy of
the policy to generate with, no collectives — because it runs in a thread of its own and the learner finishes what it
produced.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from ..rollout.base import Generation, PromptBatch


class SamplingDriver(Protocol):
    """What the sampling half (scoring, dynamic sampling) needs: it runs in whichever thread samples."""

    device: torch.device
    """Where prompts and completions are put for the model."""
    process_index: int
    num_processes: int
    lockstep: bool
    """Every process must run the same generation calls (sharded weights generating together): dynamic sampling then
    asks :meth:`any_process` whether to run another round."""
    trainer_state: Any
    """What reward functions receive as ``trainer_state`` (TRL's ``TrainerState``)."""

    @property
    def version(self) -> int:
        """The policy version: optimizer steps taken so far."""
        ...

    # -- the sampling half (any thread) ------------------------------------------------------------------------------
    def generate(self, prompts: PromptBatch, max_new_tokens: int | None = None) -> Generation:
        """One completion per row of ``prompts``, sampled with the run's sampling settings (``max_new_tokens``
        overrides the completion budget: the tool loop's later turns)."""
        ...

    def generation_batch(self) -> AbstractContextManager:
        """A context around every generation call of one generation batch (the LoRA merge, once)."""
        ...

    def any_process(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (sharded generation in lockstep: every process runs as many dynamic
        sampling rounds as the one that needs most)."""
        ...


class ContinuingDriver(SamplingDriver, Protocol):
    """What partial rollouts (:mod:`grpokit.pipeline.partial`) need besides the sampling half: continuing completions
    from their histories with the sampler's weights as they are now (the producer's driver, a worker's)."""

    def continue_rows(self, histories: list[list[int]], budgets: list[int],
                      interrupt: Callable[[torch.Tensor], bool] | None) -> Any:
        """:func:`grpokit.rollout.partial_decode.continue_rows` with the run's backend, sampler and settings: per
        row, the tokens and log-probs sampled on from its history (prompt and completion so far, token ids) within
        its budget of new tokens, and whether it ended."""
        ...


class FinishingDriver(Protocol):
    """What the finishing stage needs: the learner's log-probs and the collectives (the learner's thread)."""

    device: torch.device
    process_index: int
    num_processes: int

    def policy_logps(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                     completion_mask: torch.Tensor, vision=None, record_routes: list | None = None,
                     force_routes: torch.Tensor | None = None, support=None,
                     on_support: list | None = None) -> torch.Tensor:
        """(N, C) the current policy's log-probs of the completion tokens, without gradient (``vision``: the rows'
        image tensors, for a batch with images). A Mixture-of-Experts policy's forward (``grpokit.moe``) forces the
        experts ``force_routes`` holds (N, P + C, L, k: ``routing_replay="rollout"``), and appends those it used to
        ``record_routes`` (a list: ``routing_replay="old"``). ``on_support``: a list that receives (N, C) the same
        tokens' log-probs on a truncating sampler's support ``support``
        (:class:`grpokit.algorithms.sampling_support.SamplingSupport`), from the same forward."""
        ...

    def reference_logps(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                        completion_mask: torch.Tensor, vision=None) -> torch.Tensor:
        """(N, C) the reference policy's log-probs of the completion tokens (``beta != 0``)."""
        ...

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor`` concatenated along dim 0, in process order."""
        ...

    def sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        ...

    def gather_objects(self, obj: Any) -> list:
        """Every process's ``obj``, in process order."""
        ...

    def stop_together(self, cause: str | None) -> None:
        """Raise :class:`grpokit.bounds.user_calls.RunStopped` on every process when any process carries a stop ``cause``."""
        ...


class RolloutDriver(SamplingDriver, FinishingDriver, Protocol):
    """Both halves: what a driver of the whole pipeline offers (the trainer's ``TrainerDriver``)."""


class LearnerDriver(RolloutDriver, Protocol):
    """What the asynchronous producer (:class:`grpokit.pipeline.producer.AsyncRollouts`) needs from the learner beyond
    :class:`RolloutDriver`: the policy to copy and snapshot, whether the engine holds weights of its own, pushing
    weights to it, and generation with a given copy of the policy. The trainer's implementation is
    ``grpokit.trainer_driver.TrainerDriver``; ``tests/test_codebase.py`` checks that the producer reads nothing of
    the learner that is not declared here."""

    @property
    def holds_weights(self) -> bool:
        """The rollout engine holds weights of its own (vLLM): the producer pushes weights instead of copying them."""
        ...

    def policy(self) -> torch.nn.Module:
        """The trained policy, unwrapped (what the producer copies and snapshots)."""
        ...

    def push_weights(self) -> None:
        """Give an engine holding its own weights the current ones."""
        ...

    def generate_with(self, model: torch.nn.Module | None, prompts: PromptBatch,
                      max_new_tokens: int | None = None) -> Generation:
        """Sample with ``model`` (the producer's copy; None: an engine holding its own weights) and the run's
        settings."""
        ...

    def sampler_setup(self) -> tuple[Any, Any]:
        """The rollout backend and the run's sampling settings (:class:`grpokit.rollout.base.SamplingParams`): what a
        rollout worker process generates with, around its own copy of the policy."""
        ...


class WeightSource(Protocol):
    """Where a sampler's weights come from: a snapshot of the learner's trained weights, and loading one into the
    sampler (the producer's copy of the policy)."""

    def snapshot(self) -> dict[str, torch.Tensor]:
        ...

    def load(self, snapshot: dict[str, torch.Tensor]) -> None:
        ...


class Producer(Protocol):
    """What the learner drives a producer of generation batches with (:class:`grpokit.pipeline.producer.RolloutProducer`):
    start it, publish weights after an optimizer step, take batch ``k``, close it."""

    def start(self) -> None:
        ...

    def publish(self, version: int, push: Callable[[], None] | None = None) -> None:
        ...

    def take(self, k: int) -> Any:
        ...

    def close(self) -> None:
        ...
