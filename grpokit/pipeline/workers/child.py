"""A rollout worker process (``python -m grpokit.pipeline.workers``): the sampling half of the pipeline —
generation, rewards, tools, environments, dynamic sampling, prompt skipping — with its own copy of the policy. The
learner's side is :mod:`grpokit.pipeline.workers.pool`.

Worker ``w`` of ``N`` produces generation batches ``w, w + N, w + 2N, ...``, from the first the learner needs. It owns
its share of the prompt stream: the rows of its batches (the dataloader's, by index) and, with dynamic sampling, a
refill stream of its own (every ``N``-th refill position of its rank's) with the filter's keep rate and GRESO's
streaks; each batch it sends carries that state as it was after the batch. It waits for weights recent enough for
the next batch (``max_staleness``), loads the newest publication (:class:`grpokit.pipeline.workers.weights.
WeightSlots`), produces the batch with its behaviour log-probs, and sends it.

Frames in (standard input, 8 bytes of length then a ``dill`` pickle): ``("init", spec)`` once, then
``("published", version, trainer_state)`` after the learner wrote weights, and ``("stop",)``. Frames out (on what
was standard output; standard output itself goes to standard error, so user code that prints cannot corrupt a
frame): ``("ready", pid)``, ``("batch", ProducedBatch)`` and ``("error", line, traceback)``. The worker ends at
``stop``, at the end of its input, and when the learner's process ends (``PR_SET_PDEATHSIG``, even on ``SIGKILL``);
it ignores ``SIGINT`` (a terminal's Ctrl-C reaches the whole group: the learner stops its workers itself). A thread
writes what it is doing, every 0.2 s, into its status slot (:class:`WorkerStatus`) for the learner's watchdog.
"""

from __future__ import annotations

import os
import select
import signal
import struct
import sys
import threading
import time
import traceback
from typing import Any

import torch

STATUS_BYTES = 512
"""Per worker: 8 bytes of the monotonic time it last progressed, then what it is doing (UTF-8, zero-padded)."""
_STAMP = struct.Struct("<d")


class WorkerStatus:
    """The status slots of ``n`` workers in one shared file: what each is doing and when it last progressed."""

    def __init__(self, shared, n: int):
        self.shared, self.n = shared, n

    def write(self, index: int, last_progress: float, doing: str) -> None:
        raw = doing.encode("utf-8", "replace")[:STATUS_BYTES - _STAMP.size]
        record = _STAMP.pack(last_progress) + raw + bytes(STATUS_BYTES - _STAMP.size - len(raw))
        self.shared.bytes[index * STATUS_BYTES:(index + 1) * STATUS_BYTES] = torch.frombuffer(bytearray(record),
                                                                                          dtype=torch.uint8)

    def read(self, index: int) -> tuple[float, str]:
        record = bytes(self.shared.bytes[index * STATUS_BYTES:(index + 1) * STATUS_BYTES].tolist())
        (stamp,) = _STAMP.unpack(record[:_STAMP.size])
        return stamp, record[_STAMP.size:].rstrip(b"\0").decode("utf-8", "replace")


class WorkerDriver:
    """The worker's :class:`grpokit.pipeline.driver.SamplingDriver`: its own copy of the policy, the learner's rollout
    backend and sampling settings, no collectives."""

    lockstep = False

    def __init__(self, sampler, backend, params, device, rank: int, world_size: int, trainer_state):
        self.sampler, self.backend, self.params = sampler, backend, params
        self.device, self.process_index, self.num_processes = device, rank, world_size
        self.trainer_state = trainer_state
        self.version = 0

    def generate(self, prompts, max_new_tokens=None):
        import copy

        params = self.params
        if max_new_tokens is not None:
            params = copy.copy(params)
            params.max_new_tokens = max_new_tokens
        return self.backend.generate(self.sampler, prompts.ids, prompts.mask, params, **prompts.backend_kwargs())

    def generation_batch(self):
        import contextlib

        enter = getattr(self.backend, "generation_batch", None)
        return contextlib.nullcontext() if enter is None else enter(self.sampler)

    def any_process(self, flag: bool) -> bool:
        return flag

    def continue_rows(self, histories, budgets, interrupt):
        """Partial rollouts: sample on from each history with the worker's copy of the policy."""
        from ...rollout.partial_decode import continue_rows

        return continue_rows(self.backend, self.sampler, histories, budgets, self.params, self.params.temperature,
                             self.device, interrupt)


class Worker:
    def __init__(self, spec: dict[str, Any]):
        from ..producer import produce_batch
        from ..rollout_pipeline import RolloutPipeline
        from .shared import SharedFile, load_shared
        from .weights import WeightSlots

        self.spec, self.produce_batch = spec, produce_batch
        torch.set_num_threads(spec["threads"])
        sys.path[:0] = [p for p in spec["sys_path"] if p not in sys.path]
        arena = SharedFile.attach(spec["arena_fd"], spec["arena_bytes"])
        parts = load_shared(spec["blob"], arena, spec["offsets"], private=True)
        arena.close()
        self.args, self.rows = parts["args"], parts["rows"]
        self.sampler = parts["sampler"].eval().requires_grad_(False)
        prompts = parts["prompts"]
        if prompts is not None:  # this worker's share of its rank's refill stream
            n, w = spec["workers"], spec["index"]
            prompts.rank, prompts.world_size = prompts.rank * n + w, prompts.world_size * n
        self.pipeline = RolloutPipeline(parts["scorer"], None, parts["filter"], parts["order"], prompts=prompts,
                                        support=parts["support"])
        if spec["state"]:
            self.pipeline.load_state_dict(spec["state"])
        self.slots = WeightSlots.attach(spec["slots_layout"], spec["slots_fd"])
        self.params = dict(self.sampler.named_parameters())
        self.driver = WorkerDriver(self.sampler, parts["backend"], parts["params"], torch.device(spec["device"]),
                                   spec["rank"], spec["world_size"], spec["trainer_state"])
        self.loaded, self.published = spec["version"], spec["published"]  # the arena's weights; the newest slot's
        self.driver.version = self.loaded
        self.idle_s = 0.0

    def start_of(self, k: int) -> int:
        return (k * self.spec["generate_every"]) // self.spec["gradient_accumulation_steps"]

    def run(self, inp, out) -> None:
        from ...rewards.process_child import write_frame

        s = self.spec
        k = s["first"]
        while True:
            needed = max(0, self.start_of(k) - s["max_staleness"])
            t0 = time.perf_counter()
            if not self._receive(inp, block=False):
                return
            while self.published < needed:
                if not self._receive(inp, block=True):
                    return
            self.idle_s += time.perf_counter() - t0
            self.refresh()
            batch = self.produce_batch(self.pipeline, self.rows, self.driver, self.sampler, self.args, k,
                                       self.loaded, weights=self, oldest=needed,
                                       ahead=(k + s["workers"], max(0, self.start_of(k + s["workers"]) -
                                                                    s["max_staleness"])))
            batch.producer_idle_s = self.idle_s
            write_frame(out, ("batch", batch))
            k += s["workers"]

    # -- weights (partial rollouts also ask between two tokens: grpokit.pipeline.partial.PartialWeights) ------------
    def newer(self) -> bool:
        return max(self.slots.versions()) > self.loaded

    def refresh(self) -> int:
        """The newest complete publication into the worker's copy of the policy; its version."""
        version = self.slots.read(self.params, newer_than=self.loaded)
        if version is not None:
            self.loaded = version
        self.driver.version = self.loaded
        return self.loaded

    def _receive(self, inp, block: bool) -> bool:
        """Read the learner's frames (all that are waiting; with ``block``, at least one); False at stop."""
        from ...rewards.process_child import read_frame

        fd = inp.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], None if block else 0)
            if not ready:
                return True
            frame = read_frame(inp)
            if frame is None or frame[0] == "stop":
                return False
            _, version, trainer_state = frame
            self.published = max(self.published, version)
            self.driver.trainer_state = trainer_state
            block = False


def _report_status(status: WorkerStatus, index: int) -> None:
    from ...bounds.watchdog import BOARD

    while True:
        threads = {name: stages for name, stages in BOARD.snapshot().items()}
        doing = "; ".join(" > ".join(label for label, _ in stages) + f" for {stages[-1][1]:.0f} s"
                          for stages in threads.values()) or "waiting for weights"
        status.write(index, BOARD.last_progress, doing)
        time.sleep(0.2)


def main() -> int:
    from ...rewards.process_child import _end_with_the_parent, read_frame, write_frame
    from .shared import SharedFile

    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _end_with_the_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inp = sys.stdin.buffer
    frame = read_frame(inp)
    if frame is None or frame[0] != "init":
        return 1
    spec = frame[1]
    try:
        worker = Worker(spec)
        status = WorkerStatus(SharedFile.attach(spec["status_fd"], spec["status_bytes"]), spec["workers"])
        threading.Thread(target=_report_status, args=(status, spec["index"]), daemon=True,
                         name="grpokit-worker-status").start()
    except BaseException as e:  # noqa: BLE001 - the learner stops the run with it, in one line
        write_frame(out, ("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return 1
    write_frame(out, ("ready", os.getpid()))
    try:
        worker.run(inp, out)
    except BrokenPipeError:
        return 0
    except BaseException as e:  # noqa: BLE001
        try:
            write_frame(out, ("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        except BrokenPipeError:
            pass
        return 1
    return 0
