"""The pipeline's filtering stage: DAPO's dynamic sampling (arXiv 2503.14476 §3.2) and GRESO's prompt skipping,
one object with one state (:class:`GroupFilter`).

A group whose completions all scored alike has zero advantage and teaches nothing; drop it and sample more prompts
until the generation batch is full of groups with reward spread, for at most a few extra rounds. GRESO
(:mod:`grpokit.pipeline.prompt_skipping`) skips, before generating, prompts on a streak of such groups.

The decision is per group and deterministic (:func:`grpokit.algorithms.dynamic_sampling_keep`), and every group lives
on the rank that generated it, so under data parallelism every rank agrees on which groups are kept without talking
to the others; only sharded generation in lockstep needs the ranks to run the same number of rounds
(``any_rank_short``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..algorithms.advantages import dynamic_sampling_keep, total_reward
from .prompt_skipping import PromptSkipper
from .prompts import PROMPT_SKIP_SEED_OFFSET, PromptOrder
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


def fill_with_informative_groups(
    first: ScoredSamples,
    sample_more: Callable[[int], ScoredSamples],
    num_generations: int,
    reward_weights: torch.Tensor,
    max_extra_rounds: int,
    pad_id: int,
    any_rank_short: Callable[[bool], bool] | None = None,
    max_round_factor: float = 1.0,
    need: int | None = None,
    on_round: Callable[[ScoredSamples, list[bool]], None] | None = None,
) -> tuple[ScoredSamples, FillStats]:
    """Keep ``first``'s groups with reward spread and add groups from ``sample_more(n_groups)`` (each call generates
    and scores ``n_groups`` fresh prompts × ``num_generations``) until there are ``need`` groups (default: as many as
    ``first`` has; ``first`` may hold more, generated ahead as :func:`first_round_groups` says) or
    ``max_extra_rounds`` rounds were drawn; each round asks for the groups still missing, scaled up by the share
    of groups dropped so far, and at most ``max_round_factor`` times ``need`` (one large round generates faster
    than several small ones; kept groups beyond the batch are discarded). When the rounds run out, dropped groups
    fill the rest (they carry no gradient), so the batch keeps its shape. ``any_rank_short(short)`` (when given)
    makes every rank run the same rounds; ``on_round(batch, keep)`` (when given) sees each round's groups and which
    had spread."""
    g = num_generations
    if len(first) % g:
        raise ValueError(f"dynamic sampling needs whole groups on every process: {len(first)} rows is not a multiple "
                         f"of num_generations={g} (make per_device_train_batch_size × steps_per_generation a multiple)")
    need = len(first) // g if need is None else need
    round_cap = max(1, math.floor(need * max_round_factor))
    kept: list[ScoredSamples] = []
    dropped: list[ScoredSamples] = []
    n_kept = generated = 0
    rounds = 0
    batch = first
    while True:
        rounds += 1
        flags = dynamic_sampling_keep(batch.rewards, g, reward_weights.to(batch.rewards.device)).tolist()
        if on_round is not None:
            on_round(batch, flags)
        generated += len(flags)
        for j, keep in enumerate(flags):
            group = batch.select(list(range(j * g, (j + 1) * g)))
            (kept if keep else dropped).append(group)
            n_kept += int(keep)
        short = n_kept < need
        if any_rank_short is not None:
            short = any_rank_short(short)
        if not short or rounds > max_extra_rounds:
            break
        missing = max(0, need - n_kept)
        keep_rate = max(MIN_KEEP_RATE, n_kept / generated)
        batch = sample_more(max(1, min(round_cap, math.ceil(missing / keep_rate))))
    chosen = kept[:need]
    unfilled = need - len(chosen)
    chosen += dropped[:unfilled]
    stats = FillStats(rounds=rounds, generated_groups=generated, dropped_groups=generated - n_kept,
                      unfilled_groups=unfilled)
    return ScoredSamples.concat(chosen, pad_id), stats


class GroupFilter:
    """Dynamic sampling for the generation batches of one process, with GRESO's prompt skipping when
    ``dynamic_sampling_explore_prob`` or ``dynamic_sampling_explore_prob_hard`` is < 1. Its state — the refill
    stream's position, the last batch's keep rate (it sizes the next batch's first round), the skipper's streaks, hard
    prompts and draws — changes only in :meth:`fill`, in the thread
    that samples (the learner's, or the asynchronous producer's), and is checkpointed through :meth:`state_dict`.

    Refill prompts come from :meth:`grpokit.pipeline.prompts.PromptOrder.refill`, this process taking every
    ``world_size``-th position: other processes draw other prompts, and a resumed run draws the same ones."""

    def __init__(self, dataset, order: PromptOrder, args, reward_weights: torch.Tensor, pad_id: int, rank: int = 0,
                 world_size: int = 1):
        self.dataset, self.order, self.args = dataset, order, args
        self.reward_weights, self.pad_id, self.rank, self.world_size = reward_weights, pad_id, rank, world_size
        hard = args.dynamic_sampling_explore_prob_hard
        self.skipper = (PromptSkipper(args.dynamic_sampling_explore_prob, args.seed + PROMPT_SKIP_SEED_OFFSET, hard)
                        if min(args.dynamic_sampling_explore_prob, 1.0 if hard is None else hard) < 1.0 else None)
        self.refill_position = 0
        self.last_keep_rate: float | None = None

    def fill(self, rows: list[dict], score: Callable[[list[dict]], ScoredSamples], stats: RolloutStats,
             any_rank_short: Callable[[bool], bool] | None = None) -> ScoredSamples:
        """The generation batch ``rows`` with its groups that scored alike replaced: ``score(rows)`` generates and
        scores; the first round holds ``rows`` and the refill prompts the last batch's keep rate asks for
        (:func:`first_round_groups`), extra rounds draw from the refill stream. Adds the share of generated groups
        dropped, the rounds used, what stayed unfilled and (GRESO) the share of prompts skipped to ``stats``."""
        a, g, skipper = self.args, self.args.num_generations, self.skipper
        need = len(rows) // g
        if skipper is not None:  # GRESO: prompts on a streak of groups that scored alike, skipped before generating
            rows = skipper.keep_groups(rows, g)
        first_groups = first_round_groups(need, self.last_keep_rate, a.dynamic_sampling_oversample)
        first = score(rows + self.refill_rows(first_groups - len(rows) // g))
        filled, fill = fill_with_informative_groups(
            first, lambda n: score(self.refill_rows(n)), g, self.reward_weights, a.dynamic_sampling_max_rounds,
            self.pad_id, any_rank_short, max_round_factor=a.dynamic_sampling_oversample, need=need,
            on_round=None if skipper is None else lambda batch, keep: skipper.observe(
                batch.prompts, g, keep, batch.images,
                total_reward(batch.rewards, self.reward_weights.to(batch.rewards.device)).tolist()))
        self.last_keep_rate = fill.keep_rate
        stats.add("dynamic_sampling/filtered_frac", fill.dropped_groups / fill.generated_groups)
        stats.add("dynamic_sampling/rounds", float(fill.rounds))
        stats.add("dynamic_sampling/unfilled_frac", fill.unfilled_groups / need)
        if skipper is not None:
            stats.add("dynamic_sampling/skipped_frac", skipper.take_skipped_frac() or 0.0)
        return filled

    def refill_rows(self, n_groups: int) -> list[dict]:
        """``n_groups`` more prompts × ``num_generations`` from the refill stream; prompts GRESO's filter passes over
        are skipped (the stream moves on past them), but after a whole pass of skips every prompt is taken."""
        n, g = len(self.dataset), self.args.num_generations
        rows: list[dict] = []
        scanned = 0
        while len(rows) < n_groups * g:
            row = dict(self.dataset[self.order.refill(self.refill_position * self.world_size + self.rank)])
            self.refill_position += 1
            scanned += 1
            if self.skipper is None or scanned > n or self.skipper.keep(row):
                rows += [row] * g
        return rows

    def state_dict(self) -> dict:
        state = {"refill_position": self.refill_position, "last_keep_rate": self.last_keep_rate}
        if self.skipper is not None:
            state["prompt_skipper"] = self.skipper.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.refill_position = int(state.get("refill_position", 0))
        self.last_keep_rate = state.get("last_keep_rate")
        if self.skipper is not None and "prompt_skipper" in state:
            self.skipper.load_state_dict(state["prompt_skipper"])
