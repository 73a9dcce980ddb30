"""The rollout pipeline: from a generation batch's dataset rows to the batch the loss takes.

    rows ──> sample and score ──> filter ──> finish ──> RolloutBatch + RolloutStats
             (scoring.py)        (filtering.py)  (finishing.py)

The first two stages are the *sampling half*: local to a process, they run in whichever thread samples (the learner's,
or the asynchronous producer's). Finishing makes collectives and needs the current policy, so it runs in the
learner's thread. Everything the stages need from outside comes through a :class:`grpokit.pipeline.driver.RolloutDriver`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..batch import RolloutBatch
from ..bounds.watchdog import stage
from .driver import FinishingDriver, RolloutDriver, SamplingDriver
from .filtering import GroupFilter
from .finishing import BatchFinisher
from .partial import PartialRollouts
from .prompt_stream import PromptStream
from .prompts import PromptOrder
from .samples import ScoredSamples
from .scoring import RolloutScorer
from .stats import RolloutStats

if TYPE_CHECKING:
    from ..algorithms.sampling_support import SamplingSupport
    from .producer import AsyncRollouts


class RolloutPipeline:
    """One run's rollout side. ``group_filter``: dynamic sampling (None when off); ``order``: the run's
    :class:`PromptOrder` (None for a dataset read as a stream); ``producer``: set by :meth:`run_ahead` for
    asynchronous rollouts (:class:`grpokit.pipeline.producer.AsyncRollouts`).

    State: the refill stream's (position, skipped-prompt streaks), the filter's (keep rate) and partial rollouts' groups
    in flight, saved and restored through
    :meth:`state_dict` / :meth:`load_state_dict` (a checkpoint part). With a producer, the producer's thread owns the
    live state and :meth:`state_dict` gives the copy that came with the last batch the learner took."""

    checkpoint_file = "grpokit_state_{process}.json"

    def __init__(self, scorer: RolloutScorer, finisher: BatchFinisher, group_filter: GroupFilter | None = None,
                 order: PromptOrder | None = None, reward_process=None, prompts: PromptStream | None = None,
                 support: SamplingSupport | None = None):
        self.scorer, self.finisher, self.filter, self.order = scorer, finisher, group_filter, order
        self.support = support
        """What the sampler does to its distribution (:class:`grpokit.algorithms.sampling_support.SamplingSupport`),
        replayed where the behaviour policy's log-probs are taken (a producer's) and compared with the sampler's."""
        self.prompts = prompts
        """Dynamic sampling's refill stream, with GRESO's skipping (set with ``group_filter``)."""
        self.reward_process = reward_process
        """The process the scorer's reward functions run in (``reward_process=True``: grpokit/rewards/process.py),
        stopped with the pipeline (:meth:`stop`); scoring after that starts it again."""
        self.bounds = scorer.bounds
        """The time bounds on user code and the run's stop flag (grpokit/bounds/user_calls.py)."""
        self.producer: AsyncRollouts | None = None
        self.partial = PartialRollouts(scorer, scorer.args) \
            if getattr(getattr(scorer, "args", None), "partial_rollouts", False) else None
        """Partial rollouts' groups in flight (``partial_rollouts=True``), owned by the thread or worker that
        samples."""
        self._taken_state: dict | None = None
        self.loaded_state: dict | None = None
        """The state a checkpoint gave (:meth:`load_state_dict`), as it was; None for a fresh run."""

    # -- stages ------------------------------------------------------------------------------------------------------
    def sample(self, rows: list[dict], driver: SamplingDriver, mode: str = "train") -> tuple[ScoredSamples, RolloutStats]:
        """The sampling half: one scored completion per row, groups without reward spread replaced (dynamic sampling,
        training only), inside the driver's generation-batch context (the LoRA merge, once)."""
        stats = RolloutStats()
        with driver.generation_batch():
            if mode == "train" and self.filter is not None:
                return self._fill(rows, driver, stats), stats
            return self.scorer(rows, driver, stats), stats

    def _fill(self, rows: list[dict], driver: SamplingDriver, stats: RolloutStats) -> ScoredSamples:
        """Dynamic sampling: the batch's rows less the prompts GRESO skips, and as many refill prompts as the last
        batch's keep rate says will be dropped, in a first round; then rounds of refill prompts until the batch holds
        enough groups with reward spread or the rounds run out (every process runs as many rounds as the one that
        needs most, when they generate in lockstep)."""
        fill, stream = self.filter.start(len(rows)), self.prompts
        rows = stream.skip(rows)
        batch = self.scorer(rows + stream.draw(self.filter.first_round(fill) - len(rows) // fill.g), driver, stats)
        while True:
            keep = self.filter.keep(batch)
            stream.observe(batch, keep)
            fill.add(batch, keep)
            short = driver.any_process(fill.short) if driver.lockstep else fill.short
            if not short or not self.filter.rounds_left(fill):
                break
            batch = self.scorer(stream.draw(self.filter.next_round(fill)), driver, stats)
        samples = self.filter.finish(fill, stats)
        stream.record(stats)
        return samples

    def finish(self, samples: ScoredSamples, stats: RolloutStats, driver: FinishingDriver, mode: str = "train",
               behaviour_logps=None, behaviour_routes=None,
               behaviour_support_logps=None) -> tuple[RolloutBatch, RolloutStats]:
        """The finishing stage (the learner's thread): advantages over every process, masks, log-probs, metrics."""
        with stage("finishing"):  # its collectives are where other ranks wait for one stuck in user code (watchdog)
            return self.finisher(samples, driver, mode, stats, behaviour_logps=behaviour_logps,
                                 behaviour_routes=behaviour_routes,
                                 behaviour_support_logps=behaviour_support_logps), stats

    def next_batch(self, rows: list[dict], driver: RolloutDriver) -> tuple[RolloutBatch, RolloutStats]:
        """The next training batch: from ``rows`` (the dataloader's generation batch), or, with a producer, the next
        batch it produced from the same prompt order (``rows`` are then not used)."""
        if self.producer is None:
            samples, stats = self.sample(rows, driver)
            return self.finish(samples, stats, driver)
        produced = self.producer.next_batch(driver.version, driver.process_index == 0)
        self._taken_state = produced.pipeline_state
        return self.finish(produced.samples, produced.stats, driver, behaviour_logps=produced.behaviour_logps,
                           behaviour_routes=produced.behaviour_routes,
                           behaviour_support_logps=produced.behaviour_support_logps)

    def evaluation_batch(self, rows: list[dict], driver: RolloutDriver) -> tuple[RolloutBatch, RolloutStats]:
        samples, stats = self.sample(rows, driver, mode="eval")
        return self.finish(samples, stats, driver, mode="eval")

    # -- asynchronous rollouts ---------------------------------------------------------------------------------------
    def run_ahead(self, producer: AsyncRollouts, start: Callable[[], None]) -> None:
        """From now on, training batches come from ``producer``: the pipeline's state is copied (what a checkpoint
        holds until the learner takes a batch: ``producer.initial_state()``), then ``start()`` starts the producer's
        thread, which owns the live state from that moment (copying it after the thread started would read it while
        that thread writes it)."""
        self.producer = producer
        self._taken_state = producer.initial_state()
        start()

    def stop(self) -> None:
        """Stop the producer (the state stays the copy of the last batch taken: what a later checkpoint holds), then
        the reward process, if the rewards run in one."""
        if self.producer is not None:
            self.producer.close()
            self.producer = None
        if self.reward_process is not None:
            self.reward_process.close()

    # -- state ---------------------------------------------------------------------------------------------------------
    def sampling_state_dict(self) -> dict:
        """The sampling half's live state (read in the thread that samples): the refill stream's and the filter's."""
        state = {} if self.filter is None else {**self.prompts.state_dict(), **self.filter.state_dict()}
        return state if self.partial is None else {**state, **self.partial.state_dict()}

    def state_dict(self) -> dict | None:
        """What a checkpoint holds: the state after the last batch the learner took (None: no state)."""
        if self.filter is None and self.partial is None:
            return None
        return self._taken_state if self._taken_state is not None else self.sampling_state_dict()

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's state. One written by rollout workers (``rollout_workers``: each worker's own) is kept for
        the workers (:attr:`loaded_state`), and refused by a run without them."""
        self._taken_state, self.loaded_state = None, state
        if "worker_states" in state:
            if not self.scorer.args.rollout_workers:
                raise ValueError(f"rollout_workers=0 does not match the checkpoint, written with rollout_workers="
                                 f"{len(state['worker_states'])}: each worker's prompt stream was saved; resume with "
                                 f"rollout_workers={len(state['worker_states'])}")
            self._taken_state = state
            return
        if state.get("partial_in_flight") and self.partial is None:
            raise ValueError(f"partial_rollouts=False does not match the checkpoint, written with partial_rollouts="
                             f"True and {len(state['partial_in_flight'])} groups in flight (not trained yet); resume "
                             "with partial_rollouts=True")
        if self.partial is not None:
            self.partial.load_state_dict(state)
        if self.filter is not None:
            self.prompts.load_state_dict(state)
            self.filter.load_state_dict(state)
