"""Rollout workers (``rollout_workers: N``): the learner's side.

:class:`RolloutWorkers` is the asynchronous producer (:class:`grpokit.pipeline.producer.AsyncRollouts`) with its
sampling half moved into ``N`` worker processes (:mod:`grpokit.pipeline.workers.child`); finishing — advantages
across ranks, the learner's log-probs — stays with the learner. :class:`WorkerPool` starts the workers, publishes
weights to them after optimizer steps (:mod:`grpokit.pipeline.workers.weights`), takes generation batch ``k`` from
worker ``k mod N``, and survives faults:

- a worker that dies (``SIGKILL``, the out-of-memory killer, a crash in C code) is started again from the state of
  the last batch the learner took from it, and samples again the batches it held: no prompt lost, none trained twice;
  a worker that keeps dying (``MAX_RESTARTS`` times in a row without a batch) stops the run in one line;
- a worker that fails at start (a reward function whose module the worker cannot import, no memory) stops the run
  with its error in one line, not a hang;
- the learner waiting for a worker marks the stage ``waiting for rollouts`` with the worker's pid and what it is
  doing (read from its status slot), and counts the worker's progress as the run's, so the stall watchdog
  (``stall_timeout_s``) says which worker stopped answering and where;
- the workers are stopped with the pipeline on every exit path: the end of training, an exception, SIGINT or
  SIGTERM (the trainer stops the pipeline), the interpreter's exit (``atexit``), and a ``SIGKILL`` of the trainer
  (each worker asks the kernel to end it with its parent).

What crosses into a worker is pickled with ``dill`` (the pipeline's sampling half: the scorer with the reward
functions, tools and environment factory, dynamic sampling's filter and stream; the dataset; the rollout backend and
sampling settings), with every tensor — the policy's weights, a reward model's — put in shared memory instead of the
pickle (:func:`grpokit.pipeline.workers.shared.dump_shared`). User code that cannot cross is refused when the
trainer is made (:func:`grpokit.pipeline.workers.crossing.check_crossing`).
"""

from __future__ import annotations

import atexit
import copy
import math
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from ...bounds.watchdog import BOARD, stage
from ...rewards.process import _status
from ...rewards.process_child import HEADER, write_frame
from ...validation import refusal
from ..partial import check_partial
from ..producer import AsyncRollouts, ProducedBatch
from .child import STATUS_BYTES, WorkerStatus
from .shared import SharedFile, dump_shared
from .weights import WeightSlots

START_TIMEOUT_S = 600.0
"""How long a worker may take to start (imports, unpickling, copying the policy) before the run stops: a hang guard,
far above the seconds it takes."""
MAX_RESTARTS = 3
"""A worker that dies this many times in a row without producing a batch stops the run."""
POLL_S = 0.5
LAUNCHER_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_PROCESS_INDEX"}
"""What torchrun and accelerate tell a rank, kept from its workers."""


class RolloutWorkerError(RuntimeError):
    """A rollout worker could not start, failed, or kept dying (one line: which, and why)."""


class _Worker:
    """One worker process and the learner's reading end of its output."""

    def __init__(self, index: int, proc: subprocess.Popen):
        self.index, self.proc, self.pid = index, proc, proc.pid
        self.buffer = bytearray()
        self.restarts = 0  # in a row, without a batch
        self.seen_progress = 0.0

    def send(self, message: Any) -> bool:
        try:
            write_frame(self.proc.stdin, message)
            return True
        except (BrokenPipeError, ValueError, OSError):
            return False

    def read(self, deadline: float | None, on_poll: Callable[[], None]) -> Any:
        """The next frame, or None when the worker's output ended (it died); raises TimeoutError past ``deadline``."""
        import dill

        fd = self.proc.stdout.fileno()
        while True:
            if len(self.buffer) >= HEADER.size:
                (size,) = HEADER.unpack(self.buffer[:HEADER.size])
                if len(self.buffer) >= HEADER.size + size:
                    payload = bytes(self.buffer[HEADER.size:HEADER.size + size])
                    del self.buffer[:HEADER.size + size]
                    return dill.loads(payload)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], POLL_S)
            if not ready:
                on_poll()
                continue
            chunk = os.read(fd, 1 << 22)
            if not chunk:
                return None
            self.buffer += chunk

    def stop(self, grace_s: float = 5.0) -> None:
        self.send(("stop",))
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def how_it_ended(self) -> str:
        return _status(self.proc.wait())


class WorkerPool:
    """``n`` worker processes producing generation batches; see the module docstring. It is a
    :class:`grpokit.pipeline.driver.Producer` (start, publish, take, close)."""

    def __init__(self, n: int, spec: dict[str, Any], payload: dict[str, Any], trainable: Callable[[], dict],
                 trainer_state: Callable[[], Any], states: list, first_index: int, version: int):
        self.n, self.spec = n, spec
        self.trainable, self.trainer_state = trainable, trainer_state
        self.blob, self.arena, self.offsets = dump_shared(payload, "policy")
        self.slots = WeightSlots.create(trainable())
        self.status = WorkerStatus(SharedFile.create(n * STATUS_BYTES, "status"), n)
        self.states = list(states)  # per worker: its state after the last batch the learner took from it
        self.first_index, self.version, self.published = first_index, version, version
        self.workers: list[_Worker | None] = [None] * n
        self.idle_s = [0.0] * n
        self.learner_wait_s = 0.0
        self.restarts_total = 0
        atexit.register(self.close)

    @property
    def producer_idle_s(self) -> float:
        """The workers' time waiting for weights, summed (as far as their batches reported it)."""
        return sum(self.idle_s)

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if w is not None]

    # -- lifetime ------------------------------------------------------------------------------------------------------
    def start(self) -> None:
        for w in range(self.n):
            first = self.first_index + (w - self.first_index) % self.n  # its first batch: k ≡ w (mod n)
            self._spawn(w, first)
        for w in range(self.n):
            self._await_ready(self.workers[w])

    def _spawn(self, index: int, first: int) -> None:
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
        env["PYTHONUNBUFFERED"] = "1"  # (a worker is no rank: a launcher's variables would make it try to join)
        proc = subprocess.Popen([sys.executable, "-m", "grpokit.pipeline.workers"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, start_new_session=True,
                                pass_fds=(self.arena.fd, self.slots.shared.fd, self.status.shared.fd))
        worker = _Worker(index, proc)
        self.workers[index] = worker
        spec = dict(self.spec, index=index, first=first, version=self.version, published=self.published,
                    state=self.states[index], trainer_state=self._state_copy(), blob=self.blob,
                    offsets=self.offsets, arena_fd=self.arena.fd, arena_bytes=self.arena.nbytes,
                    slots_fd=self.slots.shared.fd, slots_layout=self.slots.layout,
                    status_fd=self.status.shared.fd, status_bytes=self.status.shared.nbytes, sys_path=list(sys.path))
        worker.send(("init", spec))

    def _await_ready(self, worker: _Worker) -> None:
        try:
            with stage("starting a rollout worker", worker=worker.index, pid=worker.pid):
                frame = worker.read(time.monotonic() + START_TIMEOUT_S, lambda: None)
        except TimeoutError:
            frame = ("error", f"it did not start within {START_TIMEOUT_S:g} s", "")
        if frame is not None and frame[0] == "ready":
            return
        why = frame[1] if frame is not None else f"it ended ({worker.how_it_ended()})"
        self.close()
        raise RolloutWorkerError(f"rollout worker {worker.index} (pid {worker.pid}) could not start: {why}")

    def close(self) -> None:
        """Stop every worker (a graceful stop, then SIGKILL after 5 s) and free the shared memory."""
        workers, self.workers = [w for w in self.workers if w is not None], [None] * self.n
        for w in workers:
            w.stop()
        for shared in (self.arena, self.slots, self.status.shared):
            shared.close()
        atexit.unregister(self.close)

    # -- weights -------------------------------------------------------------------------------------------------------
    def publish(self, version: int, push: Callable[[], None] | None = None) -> None:
        """The learner's trained tensors after an optimizer step, into the older slot; then each worker is told."""
        with stage("publishing weights"):
            self.slots.write(version, self.trainable())
        self.published = version
        state = self._state_copy()
        for w in self.workers:
            if w is not None:
                w.send(("published", version, state))  # a dead worker is started again when its batch is taken

    def _state_copy(self):
        state = copy.copy(self.trainer_state())
        if hasattr(state, "log_history"):
            state.log_history = []  # what reward functions need, not the run's whole log
        return state

    # -- batches -------------------------------------------------------------------------------------------------------
    def take(self, k: int) -> ProducedBatch:
        """Batch ``k`` from worker ``k mod n`` (blocking until it is produced; a dead worker is started again)."""
        t0 = time.perf_counter()
        w = k % self.n
        while True:
            worker = self.workers[w]
            with stage("waiting for rollouts", worker=w, pid=worker.pid, doing=_Doing(self.status, w)):
                frame = worker.read(None, lambda watched=worker: self._watch(watched))
            if frame is None:
                self._restart(worker, k)
                continue
            if frame[0] == "error":
                raise RolloutWorkerError(f"rollout worker {w} (pid {worker.pid}) failed: {frame[1]}")
            break
        batch: ProducedBatch = frame[1]
        self.learner_wait_s += time.perf_counter() - t0
        if batch.index != k:
            raise RolloutWorkerError(f"rollout worker {w} out of step: it produced batch {batch.index}, the learner "
                                     f"needs {k}")
        worker.restarts = 0
        self.idle_s[w] = batch.producer_idle_s
        self.states[w] = batch.pipeline_state
        batch.pipeline_state = self.composite_state()
        batch.stats.add("rollout/worker_restarts_total", float(self.restarts_total))
        self.restarts_total = 0
        return batch

    def composite_state(self) -> dict:
        """What a checkpoint holds: every worker's state after the last batch the learner took from it."""
        return {"rollout_workers": self.n, "worker_states": copy.deepcopy(self.states)}

    def _watch(self, worker: _Worker) -> None:
        """While the learner waits: the worker's progress is the run's (the stall watchdog)."""
        stamp, _ = self.status.read(worker.index)
        if stamp > worker.seen_progress:
            worker.seen_progress = stamp
            BOARD.progress()

    def _restart(self, worker: _Worker, k: int) -> None:
        how = worker.how_it_ended()
        worker.restarts += 1
        self.restarts_total += 1
        if worker.restarts > MAX_RESTARTS:
            raise RolloutWorkerError(f"rollout worker {worker.index} ended {worker.restarts} times in a row while "
                                     f"producing batch {k} (last: {how}); the run stops")
        import logging

        logging.getLogger("grpokit").warning(
            "grpokit: rollout worker %d (pid %d) ended (%s) while producing batch %d; it is started again and samples "
            "that batch again", worker.index, worker.pid, how, k)
        worker.stop(grace_s=0)
        restarts = worker.restarts
        self._spawn(worker.index, k)
        self.workers[worker.index].restarts = restarts
        self._await_ready(self.workers[worker.index])


class _Doing:
    """What a worker is doing, read from its status slot when the watchdog describes the stage."""

    def __init__(self, status: WorkerStatus, index: int):
        self.status, self.index = status, index

    def __str__(self) -> str:
        try:
            return self.status.read(self.index)[1] or "starting"
        except (RuntimeError, ValueError):
            return "unknown"


def worker_threads(n: int) -> int:
    """Each worker's torch threads: the CPU's cores shared among the learner and ``n`` workers (one at least). More
    would oversubscribe the cores while workers generate beside the learner's step (measured on 2 cores: two threads
    in one worker beside the learner's two made a step several times slower; benchmarks/RESULTS.md, 'Measurements
    behind design choices')."""
    return max(1, (os.cpu_count() or 1) // (n + 1))


class RolloutWorkers(AsyncRollouts):
    """:class:`grpokit.pipeline.producer.AsyncRollouts` with the sampling half in ``rollout_workers`` processes:
    publishing, staleness accounting and the batch the learner takes are the same; the producer is a
    :class:`WorkerPool`."""

    def start(self, global_step: int, generate_every: int) -> None:
        self.close()
        a, p = self.args, self.pipeline
        n = a.rollout_workers
        first = math.ceil(global_step * a.gradient_accumulation_steps / generate_every)
        backend, params = self.learner.sampler_setup()
        scorer = copy.copy(p.scorer)
        scorer.rollout_func_owner = None  # a rollout_func is refused with workers; the trainer never crosses
        policy = self.learner.policy()
        from ...vision.detection import is_vlm

        if is_vlm(policy):
            raise refusal("rollout_workers", n, "its images are not carried into worker processes yet; use "
                          "rollout_workers=0", when="with a vision-language model")
        if a.partial_rollouts:
            check_partial(p, policy, backend, params)
        payload = {"args": a, "rows": self.rows, "sampler": policy, "backend": backend, "params": params,
                   "scorer": scorer, "filter": p.filter, "prompts": p.prompts, "order": p.order, "support": p.support}
        spec = {"workers": n, "rank": a.process_index, "world_size": a.world_size, "device": str(self.learner.device),
                "threads": worker_threads(n), "max_staleness": a.max_staleness,
                "generate_every": generate_every, "gradient_accumulation_steps": a.gradient_accumulation_steps}
        self.producer = WorkerPool(n, spec, payload, trainable=self._trainable,
                                   trainer_state=lambda: self.learner.trainer_state,
                                   states=self.initial_states(), first_index=first, version=global_step)
        self._next_index = first
        self.producer.start()

    def initial_states(self) -> list:
        """Each worker's state to start from: a checkpoint's, or none (a fresh stream)."""
        n = self.args.rollout_workers
        saved = self.pipeline.loaded_state
        if not saved:
            return [None] * n
        states = saved.get("worker_states")
        if states is None:
            raise ValueError(f"rollout_workers={n} does not match the checkpoint, written with rollout_workers=0: "
                             "its one prompt stream cannot be split among workers; resume with rollout_workers=0")
        if len(states) != n:
            raise ValueError(f"rollout_workers={n} does not match the checkpoint, written with rollout_workers="
                             f"{len(states)}: each worker's prompt stream was saved; resume with rollout_workers="
                             f"{len(states)}")
        return list(states)

    def initial_state(self) -> dict:
        return {"rollout_workers": self.args.rollout_workers, "worker_states": self.initial_states()}

    def _trainable(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.learner.policy().named_parameters() if p.requires_grad}

    def snapshot(self) -> dict[str, torch.Tensor]:
        return self._trainable()

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None
