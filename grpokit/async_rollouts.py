"""The trainer's side of asynchronous rollouts (``max_staleness`` > 0, :mod:`grpokit.rollout.producer`): the sampler's
copy of the policy, what producing a generation batch means, publishing weights after optimizer steps, and what the
learner logs when it takes a batch.

Metrics (TRL's async names where TRL has them): ``sample/staleness_mean``, ``sample/staleness_max``,
``sample/staleness_<v>_total`` (how many batches were consumed at staleness ``v``), ``sample/dropped_stale_total``
(always 0: the producer never generates beyond the bound, so nothing has to be dropped), ``perf/rollout_wait_s``
(the learner waiting for rollouts) and ``perf/producer_idle_s`` (the producer waiting for weights).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from .logprobs import completion_logps
from .rollout.producer import GenerationBatchSource, ProducedBatch, RolloutProducer
from .watchdog import stage


class AsyncRollouts:
    def __init__(self, trainer):
        self.trainer = trainer
        self.producer: RolloutProducer | None = None
        self.sampler: torch.nn.Module | None = None
        self._waited = self._idle = 0.0

    # -- lifecycle --------------------------------------------------------------------------------------------------
    def start(self, state) -> None:
        """At train begin (a resume included): a fresh sampler from the current weights, producing from the next
        generation batch the learner will need."""
        self.close()
        t, a = self.trainer, self.trainer.args
        unwrapped = t.accelerator.unwrap_model(t.model)
        holds = getattr(t.rollout, "holds_weights", False)
        if not holds:
            self.sampler = copy.deepcopy(unwrapped).eval().requires_grad_(False)
        every = t._rollouts.generate_every
        source = GenerationBatchSource(t.train_dataset, a.num_generations, a.generation_batch_size // a.num_generations,
                                       a.per_device_train_batch_size * a.steps_per_generation,
                                       bool(a.shuffle_dataset), a.seed, rank=a.process_index)
        first = math.ceil(state.global_step * a.gradient_accumulation_steps / every)
        self.producer = RolloutProducer(
            produce=lambda k, version: self._produce(source.rows(k), k, version),
            load=None if holds else self._load, snapshot=self._snapshot,
            start_of=lambda k: (k * every) // a.gradient_accumulation_steps,
            max_staleness=a.max_staleness, mode=a.staleness_mode, first_index=first, version=state.global_step)
        self._next_index = first
        self.producer.start()

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None
        self.sampler = None

    # -- weights ----------------------------------------------------------------------------------------------------
    def _trainable(self) -> dict[str, torch.Tensor]:
        unwrapped = self.trainer.accelerator.unwrap_model(self.trainer.model)
        return {n: p for n, p in unwrapped.named_parameters() if p.requires_grad}

    def _snapshot(self) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {n: p.detach().clone() for n, p in self._trainable().items()}

    def _load(self, snapshot: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            params = dict(self.sampler.named_parameters())
            for name, value in snapshot.items():
                params[name].copy_(value)

    def after_step(self, state) -> None:
        """After an optimizer step: publish the weights every ``weight_sync_steps`` steps."""
        if self.producer is None or state.global_step % self.trainer.args.weight_sync_steps:
            return
        t = self.trainer
        push = None
        if getattr(t.rollout, "holds_weights", False):
            from .sharding import full_weights

            wrapped = t.model_wrapped if t.model_wrapped is not None else t.model

            def push():
                with full_weights(wrapped):
                    t.rollout.sync_weights(t.accelerator.unwrap_model(t.model))
        self.producer.publish(state.global_step, push)

    # -- producing (in the producer's thread in bounded mode) --------------------------------------------------------
    def _produce(self, rows: list[dict], k: int, version: int) -> ProducedBatch:
        t, a = self.trainer, self.trainer.args
        logs: dict[str, Any] = {"metrics": [], "reward_metrics": {}}
        model = self.sampler if self.sampler is not None else t.accelerator.unwrap_model(t.model)
        def generate(ids, mask, max_new_tokens=None):
            params = t._sampling_params("train")
            if max_new_tokens is not None:
                params.max_new_tokens = max_new_tokens
            return t.rollout.generate(model, ids, mask, params)

        def score(some_rows):
            return t._score_rows(some_rows, "train", generate=generate, logs=logs)

        if a.dynamic_sampling:
            samples = t._sample_informative(rows, score, lambda name, value: logs["metrics"].append((name, value)))
        else:
            samples = score(rows)
        behaviour = samples.generation.sampler_logps
        if self.sampler is not None:
            device = t.accelerator.device
            with torch.no_grad():
                behaviour, _ = completion_logps(
                    self.sampler, samples.prompt_ids.to(device), samples.prompt_mask.to(device),
                    samples.generation.completion_ids.to(device), samples.generation.completion_mask.to(device),
                    temperature=a.temperature, compute_entropy=False, batch_size=a.per_device_train_batch_size)
        return ProducedBatch(index=k, version=version, samples=samples, behaviour_logps=behaviour, logs=logs)

    # -- the learner taking a batch ---------------------------------------------------------------------------------
    def next_batch(self):
        """The next generation batch for the learner, with its staleness logged."""
        t = self.trainer
        with stage("waiting for rollouts"):  # grpokit/watchdog.py: the producer thread marks its own stages
            batch = self.producer.take(self._next_index)
        self._next_index += 1
        staleness = t.state.global_step - batch.version
        if staleness > t.args.max_staleness:  # cannot happen: the producer waits for recent enough weights
            raise RuntimeError(f"generation batch {batch.index} is {staleness} versions old, beyond max_staleness="
                               f"{t.args.max_staleness}")
        for name, value in batch.logs["metrics"]:
            t.record_metric(name, value)
        for name, values in batch.logs["reward_metrics"].items():
            t._pending_reward_metrics[name].extend(values)
        t.record_metric("sample/staleness_mean", float(staleness))
        t.record_metric("sample/staleness_max", float(staleness))
        if t.accelerator.is_main_process:  # counts of generation batches, each shared by every process
            t.record_metric(f"sample/staleness_{staleness}_total", 1.0)
            t.record_metric("sample/dropped_stale_total", 0.0)
        waited, idle = self.producer.learner_wait_s, self.producer.producer_idle_s
        t.record_metric("perf/rollout_wait_s", waited - self._waited)
        t.record_metric("perf/producer_idle_s", idle - self._idle)
        self._waited, self._idle = waited, idle
        return t._finish_batch(batch.samples, "train", behaviour_logps=batch.behaviour_logps)
