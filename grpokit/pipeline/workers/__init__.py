"""Rollout workers (``rollout_workers: N``): the pipeline's sampling half in processes of their own.

- :mod:`.pool`: the learner's side (:class:`RolloutWorkers`, :class:`WorkerPool`): start, publish, take, restart, close;
- :mod:`.child`: a worker process's side (``python -m grpokit.pipeline.workers``: :mod:`.__main__`);
- :mod:`.weights`: weights published through shared memory, never read half-written (:class:`WeightSlots`);
- :mod:`.shared`: anonymous shared memory as tensors, and pickling with tensors kept out of the pickle;
- :mod:`.crossing`: what must cross into a worker, checked before the model loads (:func:`check_crossing`).
"""

from .crossing import check_crossing, why_not_crossing
from .pool import RolloutWorkerError, RolloutWorkers, WorkerPool

__all__ = ["RolloutWorkerError", "RolloutWorkers", "WorkerPool", "check_crossing", "why_not_crossing"]
