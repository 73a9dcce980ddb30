"""The trainer's side of the rollout pipeline: :class:`TrainerDriver` offers what
:class:`grpokit.pipeline.driver.RolloutDriver` declares, from a ``GRPOTrainer``'s public parts (its model, accelerator,
rollout backend, reference model, arguments and state), and the weights the asynchronous producer copies."""

from __future__ import annotations

import contextlib

import torch
from accelerate.utils import gather_object

from .bounds.process_group import any_process, stop_together
from .bounds.watchdog import stage
from .forward.logprobs import completion_logps
from .forward.sharding import full_weights, sharding_kind, weights_for_generation
from .moe import recorded_forward
from .rollout.base import Generation, PromptBatch, SamplingParams


def sampling_params(args) -> SamplingParams:
    """The run's sampling settings (TRL's field names; ``generation_kwargs`` override them)."""
    return SamplingParams(
        max_new_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, do_sample=True,
        extra=dict(args.generation_kwargs or {}) | ({"cache_implementation": args.cache_implementation}
                                                     if args.cache_implementation else {}),
    )


class TrainerDriver:
    """The learner's driver. It owns one piece of state: the optimizer step whose weights a sampler holding its own
    copy (vLLM) was last given (``synced_step``)."""

    def __init__(self, trainer):
        self.trainer = trainer
        # a sampler with its own weights starts from the trainer's checkpoint (colocate) or not (a server may hold
        # another run's weights, or the base of a resumed run): then the first generation gives it the weights
        self.synced_step = 0 if getattr(trainer.rollout, "starts_in_sync", True) else None

    # -- what the trainer is ------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.trainer.accelerator.device

    @property
    def process_index(self) -> int:
        return self.trainer.accelerator.process_index

    @property
    def num_processes(self) -> int:
        return self.trainer.accelerator.num_processes

    @property
    def trainer_state(self):
        return self.trainer.state

    @property
    def version(self) -> int:
        return self.trainer.state.global_step

    @property
    def lockstep(self) -> bool:
        return self.num_processes > 1 and sharding_kind(self._wrapped()) is not None

    @property
    def holds_weights(self) -> bool:
        return getattr(self.trainer.rollout, "holds_weights", False)

    def _wrapped(self) -> torch.nn.Module:
        t = self.trainer
        return t.model_wrapped if t.model_wrapped is not None else t.model

    def policy(self) -> torch.nn.Module:
        """The trained policy, unwrapped (what the producer copies and snapshots)."""
        return self.trainer.accelerator.unwrap_model(self.trainer.model)

    # -- sampling --------------------------------------------------------------------------------------------------
    def generate(self, prompts: PromptBatch, max_new_tokens: int | None = None) -> Generation:
        """Sample one completion per row with the current policy: an engine with its own copy of the weights (vLLM)
        gets them pushed first when they changed; otherwise the trainer's model generates (sharded weights gathered
        as ``ds3_gather_for_generation`` says)."""
        t = self.trainer
        wrapped, unwrapped = self._wrapped(), self.policy()
        params = self._params(max_new_tokens)
        if self.synced_step != t.state.global_step:  # the weights changed since the sampler last saw them
            with full_weights(wrapped) if self.holds_weights else contextlib.nullcontext():
                t.rollout.sync_weights(unwrapped, step=t.state.global_step)
            self.synced_step = t.state.global_step
        if self.holds_weights:
            return t.rollout.generate(unwrapped, prompts.ids, prompts.mask, params, **prompts.backend_kwargs())
        with weights_for_generation(wrapped, unwrapped, gather=t.args.ds3_gather_for_generation) as weights:
            params.lockstep = weights.lockstep
            return t.rollout.generate(weights.model, prompts.ids, prompts.mask, params, **prompts.backend_kwargs())

    def generate_with(self, model: torch.nn.Module | None, prompts: PromptBatch,
                      max_new_tokens: int | None = None) -> Generation:
        """Sample with ``model`` (the producer's copy; None: an engine holding its own weights) and the run's
        settings."""
        return self.trainer.rollout.generate(model if model is not None else self.policy(), prompts.ids,
                                             prompts.mask, self._params(max_new_tokens), **prompts.backend_kwargs())

    def sampler_setup(self) -> tuple:
        """The rollout backend and the run's sampling settings, for a rollout worker process."""
        return self.trainer.rollout, self._params(None)

    def _params(self, max_new_tokens: int | None) -> SamplingParams:
        params = sampling_params(self.trainer.args)
        params.record_routes = self.trainer.moe.records_generation
        if max_new_tokens is not None:
            params.max_new_tokens = max_new_tokens
        return params

    def generation_batch(self):
        """The backend's ``generation_batch`` context around every generation call of one batch (the LoRA merge,
        once, for the default backend), where the weights are not sharded; log-probs are computed after it, on the
        restored weights."""
        enter = getattr(self.trainer.rollout, "generation_batch", None)
        if enter is None or sharding_kind(self._wrapped()) is not None:
            return contextlib.nullcontext()
        return enter(self.policy())

    def push_weights(self) -> None:
        """Give an engine holding its own weights (vLLM) the current ones unless it holds them already: when the
        producer starts (a server may hold another run's weights; a resumed run's colocated engine, the base
        model's) and after the steps it publishes, between its batches."""
        step = self.trainer.state.global_step
        if self.synced_step == step:
            return
        with full_weights(self._wrapped()):
            self.trainer.rollout.sync_weights(self.policy(), step=step)
        self.synced_step = step

    # -- log-probs -------------------------------------------------------------------------------------------------
    def policy_logps(self, prompt_ids, prompt_mask, completion_ids, completion_mask, vision=None,
                     record_routes: list | None = None, force_routes: torch.Tensor | None = None,
                     support=None, on_support: list | None = None) -> torch.Tensor:
        a = self.trainer.args
        return recorded_forward(
            self.trainer.moe.routers, prompt_ids.shape[0], prompt_ids.shape[1] + completion_ids.shape[1],
            lambda: completion_logps(self.trainer.model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                     temperature=a.temperature, compute_entropy=False,
                                     batch_size=a.per_device_train_batch_size, vision=vision, support=support,
                                     on_support=on_support)[0],
            record=record_routes, force=force_routes)

    def reference_logps(self, prompt_ids, prompt_mask, completion_ids, completion_mask, vision=None) -> torch.Tensor:
        t = self.trainer
        kwargs = dict(temperature=t.args.temperature, compute_entropy=False,
                      batch_size=t.args.per_device_train_batch_size, vision=vision)
        if t.ref_model is not None:
            return completion_logps(t.ref_model, prompt_ids, prompt_mask, completion_ids, completion_mask, **kwargs)[0]
        model = self.policy()
        with model.disable_adapter():  # PEFT: the base model is the reference
            return completion_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, **kwargs)[0]

    # -- collectives -----------------------------------------------------------------------------------------------
    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.trainer.accelerator.gather(tensor)

    def sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.trainer.accelerator.reduce(tensor, reduction="sum")

    def gather_objects(self, obj) -> list:
        return gather_object(obj)

    def any_process(self, flag: bool) -> bool:
        with stage("waiting for other ranks"):  # dynamic sampling's next round: a rollout's collective (watchdog)
            return any_process(flag, self.device)

    def stop_together(self, cause: str | None) -> None:
        stop_together(cause, self.device)
