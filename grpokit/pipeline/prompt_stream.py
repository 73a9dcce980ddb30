"""The prompts dynamic sampling draws beyond a generation batch: one process's refill stream, with GRESO's prompt
skipping (:class:`PromptStream`). It owns its state — the stream's position and the skipper's streaks and draws —
which changes only in the thread that samples and is checkpointed with the pipeline's."""

from __future__ import annotations

import torch

from ..algorithms.advantages import total_reward
from .prompt_skipping import PromptSkipper
from .prompts import PROMPT_SKIP_SEED_OFFSET, PromptOrder
from .samples import ScoredSamples
from .stats import RolloutStats


class PromptStream:
    """Refill prompts come from :meth:`grpokit.pipeline.prompts.PromptOrder.refill`, this process taking every
    ``world_size``-th position: other processes draw other prompts, and a resumed run draws the same ones. GRESO
    (:mod:`grpokit.pipeline.prompt_skipping`) is on when ``dynamic_sampling_explore_prob`` or
    ``dynamic_sampling_explore_prob_hard`` is < 1: prompts on a streak of groups that scored alike are passed over
    before they are generated."""

    def __init__(self, dataset, order: PromptOrder, args, reward_weights: torch.Tensor, rank: int = 0,
                 world_size: int = 1):
        self.dataset, self.order, self.group = dataset, order, args.num_generations
        self.reward_weights, self.rank, self.world_size = reward_weights, rank, world_size
        hard = args.dynamic_sampling_explore_prob_hard
        self.skipper = (PromptSkipper(args.dynamic_sampling_explore_prob, args.seed + PROMPT_SKIP_SEED_OFFSET, hard)
                        if min(args.dynamic_sampling_explore_prob, 1.0 if hard is None else hard) < 1.0 else None)
        self.refill_position = 0

    def skip(self, rows: list[dict]) -> list[dict]:
        """The generation batch's rows without the groups GRESO passes over."""
        return rows if self.skipper is None else self.skipper.keep_groups(rows, self.group)

    def draw(self, n_groups: int) -> list[dict]:
        """``n_groups`` more prompts × ``num_generations`` from the refill stream; prompts GRESO passes over are
        skipped (the stream moves on past them), but after a whole pass of skips every prompt is taken."""
        n, g = len(self.dataset), self.group
        rows: list[dict] = []
        scanned = 0
        while len(rows) < n_groups * g:
            row = dict(self.dataset[self.order.refill(self.refill_position * self.world_size + self.rank)])
            self.refill_position += 1
            scanned += 1
            if self.skipper is None or scanned > n or self.skipper.keep(row):
                rows += [row] * g
        return rows

    def observe(self, samples: ScoredSamples, spread: list[bool]) -> None:
        """A round's groups and which had reward spread: GRESO's streaks (and hard prompts) follow them."""
        if self.skipper is not None:
            rewards = total_reward(samples.rewards, self.reward_weights.to(samples.rewards.device)).tolist()
            self.skipper.observe(samples.prompts, self.group, spread, samples.images, rewards)

    def record(self, stats: RolloutStats) -> None:
        """The share of prompts GRESO skipped since the last batch (``dynamic_sampling/skipped_frac``)."""
        if self.skipper is not None:
            stats.add("dynamic_sampling/skipped_frac", self.skipper.take_skipped_frac() or 0.0)

    def state_dict(self) -> dict:
        state: dict = {"refill_position": self.refill_position}
        if self.skipper is not None:
            state["prompt_skipper"] = self.skipper.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.refill_position = int(state.get("refill_position", 0))
        if self.skipper is not None and "prompt_skipper" in state:
            self.skipper.load_state_dict(state["prompt_skipper"])
