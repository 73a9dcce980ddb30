"""The pipeline's filtering stage: DAPO's dynamic sampling (arXiv 2503.14476 §3.2) — which groups a round keeps and
how large each round is (:class:`GroupFilter`), the groups one batch gathers (:class:`GroupFill`). The prompts beyond
the batch, GRESO's skipping included, are the prompt stream's (:mod:`grpokit.pipeline.prompt_stream`); the loop of
rounds is :meth:`grpokit.pipeline.RolloutPipeline.sample`.

A group whose completions all scored alike has zero advantage and teaches nothing; drop it and sample more prompts
until the generation batch is full of groups with reward spread, for at most a few extra rounds. GRESO
(:mod:`grpokit.pipeline.prompt_skipping`) skips, before generating, prompts on a streak of such groups.

The decision is per group and deterministic (:func:`grpokit.algorithms.dynamic_sampling_keep`), and every group lives
on the rank that generated it, so under data parallelism every rank agrees on which groups are kept without talking
to the others; only sharded generation in lockstep needs the ranks to run the same number of rounds (the driver's
``any_process``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..algorithms.advantages import dynamic_sampling_keep
from .samples import ScoredSamples
from .stats import RolloutStats

MIN_KEEP_RATE = 0.1
"""The keep rate a round is sized by is taken as at least this (a batch that kept nothing asks for 10× what is
missing, within the round cap)."""


@dataclass
class FillStats:
    rounds: int
    """Generation rounds used, the first included."""
    generated_groups: int
    dropped_groups: int
    """Groups without reward spread among those generated."""
    unfilled_groups: int
    """Groups without reward spread that stayed in the batch because the rounds ran out."""

    @property
    def keep_rate(self) -> float:
        """The share of generated groups that had reward spread."""
        return 1.0 - self.dropped_groups / max(1, self.generated_groups)


def first_round_groups(need: int, last_keep_rate: float | None, max_round_factor: float) -> int:
    """How many groups the first round of a batch generates: the batch's own ``need`` and, when the last batch kept
    only ``last_keep_rate`` of what it generated, as many more as that rate says will be dropped, up to
    ``max_round_factor`` times ``need`` in all. One call then does what the first two rounds did (each generation
    call pays a fixed cost, the sequential decoding loop, whatever its size); with ``max_round_factor`` 1, or before
    any batch was seen, the first round is the batch alone."""
    if last_keep_rate is None or max_round_factor <= 1:
        return need
    cap = max(need, math.floor(need * max_round_factor))
    return min(cap, max(need, math.ceil(need / max(MIN_KEEP_RATE, last_keep_rate))))


def next_round_groups(need: int, kept: int, generated: int, max_round_factor: float) -> int:
    """How many groups the next round generates: the groups still missing, scaled up by the share of groups dropped
    so far (at least :data:`MIN_KEEP_RATE` kept), at most ``max_round_factor`` times ``need`` (one large round
    generates faster than several small ones; kept groups beyond the batch are discarded), at least one."""
    round_cap = max(1, math.floor(need * max_round_factor))
    keep_rate = max(MIN_KEEP_RATE, kept / max(1, generated))
    return max(1, min(round_cap, math.ceil(max(0, need - kept) / keep_rate)))


class GroupFill:
    """The groups one generation batch has gathered, round by round: those with reward spread (kept) and those
    without (dropped, used only when the rounds run out, so that the batch keeps its shape: they carry no
    gradient)."""

    def __init__(self, num_generations: int, need: int):
        self.g, self.need = num_generations, need
        self.kept: list[ScoredSamples] = []
        self.dropped: list[ScoredSamples] = []
        self.rounds = self.generated = 0

    def add(self, samples: ScoredSamples, keep: list[bool]) -> None:
        """A round's samples, whole groups of ``num_generations`` rows, and which groups had spread."""
        g = self.g
        self.rounds += 1
        self.generated += len(keep)
        for j, spread in enumerate(keep):
            (self.kept if spread else self.dropped).append(samples.select(list(range(j * g, (j + 1) * g))))

    @property
    def short(self) -> bool:
        return len(self.kept) < self.need

    def stats(self) -> FillStats:
        return FillStats(rounds=self.rounds, generated_groups=self.generated, dropped_groups=len(self.dropped),
                         unfilled_groups=max(0, self.need - len(self.kept)))

    def samples(self, pad_id: int) -> ScoredSamples:
        """``need`` groups: the kept ones first, in the order they came, then dropped ones for what is missing."""
        chosen = self.kept[:self.need]
        return ScoredSamples.concat(chosen + self.dropped[:self.need - len(chosen)], pad_id)


class GroupFilter:
    """Which groups of a round have reward spread (:func:`grpokit.algorithms.dynamic_sampling_keep`) and how many
    groups each round generates. Its state — the last batch's keep rate, which sizes the next batch's first round —
    changes only in :meth:`finish`, in the thread that samples, and is checkpointed with the pipeline's. The loop
    that draws rounds is :meth:`grpokit.pipeline.RolloutPipeline.sample`; the prompts come from
    :class:`grpokit.pipeline.prompt_stream.PromptStream`."""

    def __init__(self, args, reward_weights: torch.Tensor, pad_id: int):
        self.num_generations = args.num_generations
        self.max_extra_rounds = args.dynamic_sampling_max_rounds
        self.max_round_factor = args.dynamic_sampling_oversample
        self.reward_weights, self.pad_id = reward_weights, pad_id
        self.last_keep_rate: float | None = None

    def start(self, rows: int) -> GroupFill:
        """The fill of a generation batch of ``rows`` rows."""
        return GroupFill(self.num_generations, rows // self.num_generations)

    def first_round(self, fill: GroupFill) -> int:
        """Groups the first round generates (:func:`first_round_groups`)."""
        return first_round_groups(fill.need, self.last_keep_rate, self.max_round_factor)

    def keep(self, samples: ScoredSamples) -> list[bool]:
        """Per group of ``num_generations`` rows, whether its rewards have spread."""
        g = self.num_generations
        if len(samples) % g:
            raise ValueError(f"dynamic sampling needs whole groups on every process: {len(samples)} rows is not a "
                             f"multiple of num_generations={g} (make per_device_train_batch_size × steps_per_generation "
                             "a multiple)")
        return dynamic_sampling_keep(samples.rewards, self.num_generations,
                                     self.reward_weights.to(samples.rewards.device)).tolist()

    def rounds_left(self, fill: GroupFill) -> bool:
        return fill.rounds <= self.max_extra_rounds

    def next_round(self, fill: GroupFill) -> int:
        """Groups the next round generates (:func:`next_round_groups`)."""
        return next_round_groups(fill.need, len(fill.kept), fill.generated, self.max_round_factor)

    def finish(self, fill: GroupFill, stats: RolloutStats) -> ScoredSamples:
        """The batch the fill holds; its keep rate kept for the next batch's first round, and the share of generated
        groups dropped, the rounds used and what stayed unfilled added to ``stats``."""
        result = fill.stats()
        self.last_keep_rate = result.keep_rate
        stats.add("dynamic_sampling/filtered_frac", result.dropped_groups / max(1, result.generated_groups))
        stats.add("dynamic_sampling/rounds", float(result.rounds))
        stats.add("dynamic_sampling/unfilled_frac", result.unfilled_groups / max(1, fill.need))
        return fill.samples(self.pad_id)

    def state_dict(self) -> dict:
        return {"last_keep_rate": self.last_keep_rate}

    def load_state_dict(self, state: dict) -> None:
        self.last_keep_rate = state.get("last_keep_rate")
