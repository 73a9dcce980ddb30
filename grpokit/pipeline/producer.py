"""Rollouts generated ahead of the learner, with bounded staleness (``max_staleness`` > 0).

The producer owns a copy of the policy (the transformers backend) or an engine with its own weights (vLLM), and
generates generation batch ``k`` with weights at least ``v(k) - max_staleness`` optimizer steps old, where ``v(k)``
is the optimizer step at which the learner starts training on batch ``k``. The learner publishes its weights every
``weight_sync_steps`` optimizer steps. Every produced batch records the version that generated it and the
generating policy's per-token log-probs, which the loss uses as its behaviour log-probs (the off-policy correction
each loss defines: PPO's clipped ratio, VESPO's sequence weight, ...).

Two modes (``staleness_mode``):

- ``"bounded"``: a background thread generates as far ahead as the bound allows, with the newest weights published,
  overlapping generation with training (what asynchronous RL frameworks do).
- ``"exact"``: batch ``k`` is generated, in the learner's thread when it is needed, with exactly the weights of
  version ``max(0, v(k) - max_staleness)`` (kept as snapshots): a deterministic, exact staleness, for studying its
  effect.

The producer drives the same :class:`grpokit.pipeline.RolloutPipeline` as the synchronous trainer, through its own
driver (:class:`SamplerDriver`): it runs the sampling half (scoring, dynamic sampling) and the learner finishes each
batch it takes. The thread that samples owns the pipeline's state (the refill position, the keep rate, the prompt
skipper); every produced batch carries a copy of that state as it was after the batch, and a checkpoint holds the copy
of the last batch the learner took: a resumed run produces the batches it had not trained on yet, from the same state.

Metrics (TRL's async names where TRL has them): ``sample/staleness_mean``, ``sample/staleness_max``,
``sample/staleness_<v>_total`` (how many batches were consumed at staleness ``v``), ``sample/dropped_stale_total``
(always 0: the producer never generates beyond the bound, so nothing has to be dropped), ``perf/rollout_wait_s``
(the learner waiting for rollouts) and ``perf/producer_idle_s`` (the producer waiting for weights).
"""

from __future__ import annotations

import contextlib
import copy
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..bounds.watchdog import stage
from ..forward.logprobs import completion_logps
from ..moe import find_routers, recorded_forward
from ..rollout.base import Generation, PromptBatch
from ..rollout.partial_decode import Continued, continue_rows
from .driver import LearnerDriver
from .partial import PartialWeights, check_partial
from .prompts import BatchRows
from .samples import ScoredSamples
from .stats import RolloutStats

STALENESS_MODES = ("bounded", "exact")


@dataclass
class ProducedBatch:
    index: int
    """The generation batch's index since the start of training."""
    version: int
    """The optimizer step of the weights that generated it."""
    samples: ScoredSamples
    """Its scored samples (dynamic sampling already applied)."""
    behaviour_logps: torch.Tensor | None
    """(N, C) the generating policy's log-probs of the completion tokens."""
    behaviour_routes: torch.Tensor | None = None
    """(N, P + C, L, k) the experts a Mixture-of-Experts policy's forward used for them (``routing_replay="old"``)."""
    behaviour_support_logps: torch.Tensor | None = None
    """(N, C) the generating policy's log-probs under the sampler's own distribution (its truncation, penalty and
    ``min_tokens`` replayed): the policy side of the sampler mismatch, where the sampler is a copy in another
    precision whose distribution reshapes."""
    stats: RolloutStats = field(default_factory=RolloutStats)
    """What producing it measured; the learner adds what finishing it measures."""
    pipeline_state: dict[str, Any] = field(default_factory=dict)
    """The pipeline's state right after producing it (what a checkpoint taken once the learner has it holds)."""
    producer_idle_s: float = 0.0
    """A rollout worker's time waiting for weights so far (:mod:`grpokit.pipeline.workers`)."""
    token_versions: torch.Tensor | None = None
    """(N, C) partial rollouts: the version that sampled each completion token (-1 at padding); :attr:`version` is
    then the oldest of them."""


class RolloutProducer:
    """See the module docstring. ``produce(k, version)`` does the work for batch ``k`` with the sampler's current
    weights (it is the trainer's); ``load(snapshot)`` puts published weights into the sampler (None for an engine
    that received them at publication); ``start_of(k)`` is the optimizer step at which batch ``k`` starts training."""

    def __init__(self, produce: Callable[[int, int], ProducedBatch], load: Callable[[dict], None] | None,
                 snapshot: Callable[[], dict], start_of: Callable[[int], int], max_staleness: int, mode: str,
                 first_index: int, version: int):
        if mode not in STALENESS_MODES:
            raise ValueError(f"staleness_mode={mode!r} is not supported; allowed: {', '.join(STALENESS_MODES)}")
        self._produce, self._load, self._snapshot, self._start_of = produce, load, snapshot, start_of
        self.max_staleness, self.mode = max_staleness, mode
        self._next = first_index  # the next batch to produce
        self._published = version  # newest version published
        self._loaded = version  # the version the sampler holds
        self._snapshots: dict[int, dict] = {}
        self._cond = threading.Condition()
        self._queue: queue.Queue[ProducedBatch | BaseException] = queue.Queue()
        self._stop = False
        self._busy = False  # the thread is generating (an engine's weights must not change meanwhile)
        self._thread: threading.Thread | None = None
        self.producer_idle_s = 0.0
        self.learner_wait_s = 0.0

    # -- the learner's side -------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.mode == "bounded" and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="grpokit-rollout-producer", daemon=True)
            self._thread.start()

    def needed_version(self, k: int) -> int:
        return max(0, self._start_of(k) - self.max_staleness)

    def publish(self, version: int, push: Callable[[], None] | None = None) -> None:
        """The learner's weights at ``version``: snapshot them for the sampler (or ``push`` them into an engine that
        holds its own weights, while the producer is between batches)."""
        with self._cond:
            if self._load is not None:
                self._snapshots[version] = self._snapshot()
                self._prune()
            elif push is not None:
                while self._busy:
                    self._cond.wait()
                push()
                self._loaded = version
            self._published = version
            self._cond.notify_all()

    def take(self, k: int) -> ProducedBatch:
        """Batch ``k`` (blocking until it is produced); the learner's waiting time is counted."""
        t0 = time.perf_counter()
        if self.mode == "exact":
            batch = self._produce_now(k)
        else:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise RuntimeError(f"the rollout producer failed: {type(item).__name__}: {item}") from item
            batch = item
        self.learner_wait_s += time.perf_counter() - t0
        if batch.index != k:
            raise RuntimeError(f"rollout producer out of step: produced batch {batch.index}, the learner needs {k}")
        return batch

    # -- partial rollouts: the producer's thread, between two tokens ---------------------------------------------------
    def newer(self) -> bool:
        """Weights newer than the sampler's were published (a :class:`grpokit.pipeline.partial.PartialWeights`)."""
        return self._load is not None and self._published > self._loaded

    def refresh(self) -> int:
        """The newest published weights into the sampler; their version."""
        with self._cond:
            return self._use(self._published)

    def ready(self) -> int:
        """How many produced batches wait for the learner."""
        return self._queue.qsize()

    def close(self) -> None:
        """Stop the thread after the batch it is generating (if any)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- producing ----------------------------------------------------------------------------------------------------
    def _produce_now(self, k: int) -> ProducedBatch:
        with self._cond:
            version = self._use(self.needed_version(k))
        self._next = k + 1
        return self._produce(k, version)

    def _use(self, needed: int) -> int:
        """Put the weights for a batch that needs at least version ``needed`` into the sampler; returns their
        version. Exact: version ``needed`` itself. Bounded: the newest published. Called holding the lock."""
        if self._load is None:  # the engine holds whatever was pushed last
            return self._loaded
        target = needed if self.mode == "exact" else self._published
        if target != self._loaded:
            if target not in self._snapshots:
                raise RuntimeError(f"weights of version {target} were not published (weight_sync_steps must be 1 "
                                   "for staleness_mode='exact')")
            self._load(self._snapshots[target])
            self._loaded = target
            self._prune()
        return self._loaded

    def _prune(self) -> None:
        """Drop snapshots no future batch can need."""
        keep_from = min(self._loaded, self.needed_version(self._next)) if self.mode == "exact" else self._published
        for v in [v for v in self._snapshots if v < keep_from]:
            del self._snapshots[v]

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    k = self._next
                    needed = self.needed_version(k)
                    t0 = time.perf_counter()
                    while not self._stop and self._published < needed:
                        self._cond.wait()
                    self.producer_idle_s += time.perf_counter() - t0
                    if self._stop:
                        return
                    version = self._use(needed)
                    self._next = k + 1
                    self._busy = True
                try:
                    self._queue.put(self._produce(k, version))
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
        except BaseException as e:  # the learner raises it on its next take()
            self._queue.put(e)


class SamplerDriver:
    """The producer's :class:`grpokit.pipeline.driver.SamplingDriver`: generation with the
    producer's copy of the policy (``sampler``; None for an engine holding its own weights), no collectives and no
    LoRA merge (the copy is the producer's own)."""

    lockstep = False

    def __init__(self, learner: LearnerDriver, sampler: torch.nn.Module | None):
        self.learner, self.sampler = learner, sampler
        self.device, self.trainer_state = learner.device, learner.trainer_state
        self.process_index, self.num_processes = learner.process_index, learner.num_processes

    @property
    def version(self) -> int:
        return self.learner.version

    def generate(self, prompts: PromptBatch, max_new_tokens: int | None = None) -> Generation:
        return self.learner.generate_with(self.sampler, prompts, max_new_tokens)

    def generation_batch(self):
        return contextlib.nullcontext()

    def continue_rows(self, histories: list[list[int]], budgets: list[int], interrupt) -> Continued:
        """Partial rollouts: sample on from each history with the producer's copy of the policy."""
        backend, params = self.learner.sampler_setup()
        return continue_rows(backend, self.sampler, histories, budgets, params, params.temperature, self.device,
                             interrupt)


class AsyncRollouts:
    """The learner's side of asynchronous rollouts: the producer's copy of the policy, what producing generation batch
    ``k`` means (the sampling half of ``pipeline`` on the rows the dataloader would give, then the generating policy's
    log-probs), publishing weights after optimizer steps, and the staleness metrics of each batch the learner takes.
    ``learner``: the trainer's :class:`grpokit.pipeline.driver.LearnerDriver`. It is the producer's
    :class:`grpokit.pipeline.driver.WeightSource` (:meth:`snapshot`, :meth:`load`)."""

    def __init__(self, pipeline, learner: LearnerDriver, dataset, args):
        self.pipeline, self.learner, self.args = pipeline, learner, args
        self.rows = BatchRows(dataset, pipeline.order, args.num_generations,
                              args.per_device_train_batch_size * args.steps_per_generation, rank=args.process_index)
        self.producer: RolloutProducer | None = None
        self.sampler: torch.nn.Module | None = None
        self._waited = self._idle = 0.0
        self._next_index = 0

    def start(self, global_step: int, generate_every: int) -> None:
        """At train begin (a resume included): a fresh sampler from the current weights, producing from the next
        generation batch the learner will need, from the pipeline's state as it is now (loaded from a checkpoint)."""
        self.close()
        a = self.args
        holds = self.learner.holds_weights
        if holds:  # the engine gets the weights it will start from (on every rank: a push may be a collective)
            self.learner.push_weights()
        else:
            self.sampler = copy.deepcopy(self.learner.policy()).eval().requires_grad_(False)
        first = math.ceil(global_step * a.gradient_accumulation_steps / generate_every)
        driver = SamplerDriver(self.learner, self.sampler)
        if a.partial_rollouts:
            check_partial(self.pipeline, self.learner.policy(), *self.learner.sampler_setup())
        self.producer = RolloutProducer(
            produce=lambda k, version: self._produce(driver, k, version),
            load=None if holds else self.load, snapshot=self.snapshot,
            start_of=lambda k: (k * generate_every) // a.gradient_accumulation_steps,
            max_staleness=a.max_staleness, mode=a.staleness_mode, first_index=first, version=global_step)
        self._next_index = first
        self.producer.start()

    def initial_state(self) -> dict:
        """What a checkpoint holds until the learner takes a batch: a copy of the pipeline's state now."""
        return copy.deepcopy(self.pipeline.sampling_state_dict())

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None
        self.sampler = None

    # -- weights ----------------------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, torch.Tensor]:
        """The learner's trained weights now (a :class:`grpokit.pipeline.driver.WeightSource`)."""
        with torch.no_grad():
            return {n: p.detach().clone() for n, p in self.learner.policy().named_parameters() if p.requires_grad}

    def load(self, snapshot: dict[str, torch.Tensor]) -> None:
        """Published weights into the producer's copy of the policy."""
        with torch.no_grad():
            params = dict(self.sampler.named_parameters())
            for name, value in snapshot.items():
                params[name].copy_(value)

    def after_step(self, global_step: int) -> None:
        """After an optimizer step: publish the weights every ``weight_sync_steps`` steps."""
        if self.producer is None or global_step % self.args.weight_sync_steps:
            return
        self.producer.publish(global_step, self.learner.push_weights if self.learner.holds_weights else None)

    # -- producing (in the producer's thread in bounded mode) ---------------------------------------------------------
    def _produce(self, driver: SamplerDriver, k: int, version: int) -> ProducedBatch:
        producer = self.producer
        return produce_batch(self.pipeline, self.rows, driver, self.sampler, self.args, k, version, weights=producer,
                             oldest=producer.needed_version(k), ahead=(k + 1, producer.needed_version(k + 1)))

    # -- the learner taking a batch ---------------------------------------------------------------------------------
    def next_batch(self, version: int, is_main_process: bool) -> ProducedBatch:
        """The next generation batch for the learner (at policy ``version``), with its staleness in its stats."""
        with stage("waiting for rollouts"):  # grpokit/bounds/watchdog.py: the producer thread marks its own stages
            batch = self.producer.take(self._next_index)
        self._next_index += 1
        staleness = version - batch.version
        if staleness > self.args.max_staleness:  # cannot happen: the producer waits for recent enough weights
            raise RuntimeError(f"generation batch {batch.index} is {staleness} versions old, beyond max_staleness="
                               f"{self.args.max_staleness}")
        stats = batch.stats
        stats.add("sample/staleness_mean", float(staleness))
        stats.add("sample/staleness_max", float(staleness))
        if batch.token_versions is not None:  # partial rollouts: the age of every completion token
            ages = (version - batch.token_versions[batch.token_versions >= 0]).float()
            stats.add("sample/token_staleness_mean", ages.mean() if ages.numel() else 0.0)
            stats.add("sample/token_staleness_max", ages.max() if ages.numel() else 0.0)
        if is_main_process:  # counts of generation batches, each shared by every process
            stats.add(f"sample/staleness_{staleness}_total", 1.0)
            stats.add("sample/dropped_stale_total", 0.0)
        waited, idle = self.producer.learner_wait_s, self.producer.producer_idle_s
        stats.add("perf/rollout_wait_s", waited - self._waited)
        stats.add("perf/producer_idle_s", idle - self._idle)
        self._waited, self._idle = waited, idle
        return batch


def produce_batch(pipeline, rows_of: Callable[[int], list[dict]], driver, sampler: torch.nn.Module | None, args,
                  k: int, version: int, weights: PartialWeights | None = None, oldest: int = 0,
                  ahead: tuple[int, int] | None = None) -> ProducedBatch:
    """Generation batch ``k`` produced ahead of the learner with ``sampler`` (the producer's copy of the policy at
    ``version``; None: an engine holding its own weights, whose sampler log-probs are the behaviour's): the sampling
    half of ``pipeline`` on ``rows_of(k)``, then the generating policy's log-probs of the completions (a
    Mixture-of-Experts sampler's forward routing as the loss's will; none with ``max_staleness=0``, where the batch
    trains at the version that generated it and the learner's own log-probs are the behaviour's), and the pipeline's
    state after it. With partial rollouts (:mod:`grpokit.pipeline.partial`) the groups in flight join, ``weights``
    gives newer weights as they are published, every token's log-prob comes with it from the version that sampled it
    (none older than ``oldest``), and ``ahead`` (the producer's next batch, the oldest version it allows) is admitted
    early when it can be."""
    if pipeline.partial is not None:
        stats = RolloutStats()
        part = pipeline.partial.produce(k, rows_of, driver, weights, oldest, stats, ahead)
        versions = part.token_versions[part.token_versions >= 0]
        return ProducedBatch(index=k, version=int(versions.min()) if versions.numel() else version,
                             samples=part.samples, behaviour_logps=part.behaviour_logps, stats=stats,
                             pipeline_state=copy.deepcopy(pipeline.sampling_state_dict()),
                             token_versions=part.token_versions)
    samples, stats = pipeline.sample(rows_of(k), driver)
    behaviour, routes, on_support = samples.generation.sampler_logps, None, None
    if sampler is not None and args.max_staleness > 0:  # (at 0 the batch trains at its own version: on-policy)
        device, gen = driver.device, samples.generation
        replay = args.routing_replay
        routes = [] if replay == "old" else None
        force = torch.cat([gen.prompt_routes, gen.completion_routes], 1) \
            if replay == "rollout" and gen.prompt_routes is not None else None
        support = pipeline.support
        on_support = [] if gen.sampler_logps is not None and support is not None and support.reshapes else None
        with torch.no_grad(), stage("behaviour log-probs"):
            behaviour = recorded_forward(
                find_routers(sampler) if replay != "none" else None, len(samples),
                samples.prompt_ids.shape[1] + gen.completion_ids.shape[1],
                lambda: completion_logps(
                    sampler, samples.prompt_ids.to(device), samples.prompt_mask.to(device),
                    gen.completion_ids.to(device), gen.completion_mask.to(device),
                    temperature=args.temperature, compute_entropy=False,
                    batch_size=args.per_device_train_batch_size,
                    vision=samples.vision.to(device) if samples.vision is not None else None,
                    support=support, on_support=on_support)[0],
                record=routes, force=force)
    return ProducedBatch(index=k, version=version, samples=samples, behaviour_logps=behaviour, stats=stats,
                         pipeline_state=copy.deepcopy(pipeline.sampling_state_dict()),
                         behaviour_routes=routes[0] if routes else None,
                         behaviour_support_logps=on_support[0] if on_support else None)
