"""Skipping prompts before generation that will likely score alike again (GRESO, arXiv 2506.02177: "Act Only
When It Pays"): a prompt whose groups had no reward spread the last ``z`` times it was generated is generated again
only with probability ``p**z`` (``p``: ``dynamic_sampling_explore_prob``), and skipped otherwise; the first group
with spread resets its streak. With dynamic sampling, every skipped prompt is one group less generated and then
dropped; the batch is filled from the refill stream as before. A prompt is never skipped for good: with ``p`` 0.5
a prompt solved three times in a row still comes back one time in eight, so what is forgotten is seen again.

The paper keeps one ``p`` for easy prompts (every completion solved them) and one for hard ones (none did), and
adapts both to hold a target share of zero-variance groups. Here both are fixed: ``dynamic_sampling_explore_prob``
for easy prompts and ``dynamic_sampling_explore_prob_hard`` (the same unless set) for hard ones. A group is hard when
its shared reward is below the best reward any completion has had so far in the run (with verifiable rewards: none of
its completions was right), easy otherwise. Draws are deterministic in the seed and the number of draws so far, so a
resumed run skips what the uninterrupted one would (both are checkpointed, with which prompts are hard).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from typing import Any

from ..algorithms.advantages import below_best, skip_probability
from ..validation import refusal

DRAW_STREAM_STRIDE = 1_000_003
"""Draw ``d`` of a run seeded ``s`` is ``random.Random(s · DRAW_STREAM_STRIDE + d)``: a prime stride, so that two seeds'
streams of draws never share a generator seed within the first million draws."""


def prompt_key(prompt: Any, images: list | None = None) -> str:
    """A short stable name for a prompt as the dataset holds it (its JSON, hashed) and its pictures (PIL images: their
    pixels, hashed; the same question about another picture is another prompt): what the streaks are kept under."""
    h = hashlib.blake2b(json.dumps(prompt, sort_keys=True, default=str).encode(), digest_size=8)
    for image in images or []:
        h.update(f"{image.mode}{image.size}".encode())
        h.update(image.tobytes())
    return h.hexdigest()


def _row_key(row: dict) -> str:
    from ..vision.images import row_images

    return prompt_key(row.get("prompt"), row_images(row))


class PromptSkipper:
    """The zero-variance streak of every prompt generated so far, and the seeded draws that skip them."""

    def __init__(self, explore_prob: float, seed: int, explore_prob_hard: float | None = None):
        for name, p in (("explore_prob", explore_prob), ("explore_prob_hard", explore_prob_hard)):
            if p is not None and not 0.0 < p <= 1.0:
                raise refusal(name, p, "expected a probability in (0, 1]")
        self.explore_prob = explore_prob
        self.explore_prob_hard = explore_prob if explore_prob_hard is None else explore_prob_hard
        self.seed = seed
        self.streaks: dict[str, int] = {}
        self.hard: set[str] = set()
        """The prompts whose last group scored alike below :attr:`best` (the hard ones)."""
        self.best: float | None = None
        """The best reward any completion has had so far (None before the first scored one)."""
        self.draws = 0
        self.considered = 0
        self.skipped = 0

    def keep(self, row: dict) -> bool:
        """Whether to generate ``row``'s prompt now (draws only for a prompt on a streak)."""
        self.considered += 1
        key = _row_key(row)
        p_skip = skip_probability(self.streaks.get(key, 0),
                                  self.explore_prob_hard if key in self.hard else self.explore_prob)
        if p_skip <= 0.0:
            return True
        u = random.Random(self.seed * DRAW_STREAM_STRIDE + self.draws).random()
        self.draws += 1
        if u < p_skip:
            self.skipped += 1
            return False
        return True

    def keep_groups(self, rows: list[dict], group: int) -> list[dict]:
        """``rows`` (whole groups of ``group`` rows sharing a prompt) without the groups :meth:`keep` skips."""
        out: list[dict] = []
        for i in range(0, len(rows), group):
            if self.keep(rows[i]):
                out += rows[i:i + group]
        return out

    def observe(self, prompts: list, group: int, spread: list[bool], images: list | None = None,
                rewards: list[float] | None = None) -> None:
        """Record groups just generated: ``prompts`` one per row (whole groups of ``group``), ``spread[j]`` whether
        group ``j`` had reward spread; ``images``: per row, its prompt's PIL images (None: no row has one);
        ``rewards``: per row, its total reward (NaN: not scored), which tells hard groups from easy ones (None: every
        group counts as easy)."""
        if rewards is not None:
            scored = [r for r in rewards if not math.isnan(r)]
            if scored:
                self.best = max(scored + ([] if self.best is None else [self.best]))
        for j, has_spread in enumerate(spread):
            key = prompt_key(prompts[j * group], images[j * group] if images is not None else None)
            self.streaks[key] = 0 if has_spread else self.streaks.get(key, 0) + 1
            self.hard.discard(key)
            if not has_spread and rewards is not None and below_best(rewards[j * group:(j + 1) * group], self.best):
                self.hard.add(key)

    def take_skipped_frac(self) -> float | None:
        """The share of prompts skipped since the last call (None when none was considered); resets the counts."""
        if not self.considered:
            return None
        frac = self.skipped / self.considered
        self.considered = self.skipped = 0
        return frac

    def state_dict(self) -> dict[str, Any]:
        return {"streaks": dict(self.streaks), "draws": self.draws, "hard": sorted(self.hard), "best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streaks = {str(k): int(v) for k, v in state.get("streaks", {}).items()}
        self.draws = int(state.get("draws", 0))
        self.hard = {str(k) for k in state.get("hard", [])}
        self.best = None if state.get("best") is None else float(state["best"])

