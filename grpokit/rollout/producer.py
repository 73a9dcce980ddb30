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
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

STALENESS_MODES = ("bounded", "exact")


@dataclass
class ProducedBatch:
    index: int
    """The generation batch's index since the start of training."""
    version: int
    """The optimizer step of the weights that generated it."""
    samples: Any
    """Its :class:`grpokit.rollout.sample.ScoredSamples` (dynamic sampling already applied)."""
    behaviour_logps: torch.Tensor | None
    """(N, C) the generating policy's log-probs of the completion tokens."""
    logs: dict[str, Any] = field(default_factory=dict)
    """What was logged while producing it (metrics, reward-function logs), recorded by the learner on consumption."""


class GenerationBatchSource:
    """The rows of generation batch ``k`` on this process, in the order the trainer's sampler would give them
    (:class:`grpokit.data.GroupRepeatSampler`: ``prompts_per_batch`` prompts per batch, each ``num_generations``
    times, shuffled per epoch with ``seed + epoch``; process ``rank`` takes its contiguous share)."""

    def __init__(self, dataset, num_generations: int, prompts_per_batch: int, rows_per_process: int, shuffle: bool,
                 seed: int, rank: int = 0):
        self.dataset = dataset
        self.g = num_generations
        self.p = prompts_per_batch
        self.rows_per_process = rows_per_process
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.batches_per_epoch = len(dataset) // prompts_per_batch

    def rows(self, k: int) -> list[dict]:
        epoch, j = divmod(k, self.batches_per_epoch)
        n = len(self.dataset)
        order = (torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
                 if self.shuffle else list(range(n)))
        block = [i for i in order[j * self.p:(j + 1) * self.p] for _ in range(self.g)]
        mine = block[self.rank * self.rows_per_process:(self.rank + 1) * self.rows_per_process]
        return [dict(self.dataset[i]) for i in mine]


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
