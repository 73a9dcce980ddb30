"""The pipeline's sampling-and-scoring stage: dataset rows in, one scored completion per row out
(:class:`grpokit.pipeline.samples.ScoredSamples`). Local to the process (no collective), so it runs any number of
times per generation batch (dynamic sampling's rounds) and in any thread (the asynchronous producer's)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ..algorithms.advantages import overlong_penalty
from ..bounds.user_calls import CallBounds
from ..rollout.base import Generation, context_length, stop_token_ids
from ..tools import TurnLimits
from ..vision.inputs import pixel_dtype
from .driver import SamplingDriver
from .samples import PreparedPrompts, ScoredSamples, prepare_prompts, sample_and_score, score_generation
from .stats import RolloutStats


class RolloutScorer:
    """Generates one completion per row — with the driver's policy, through the tool loop when the trainer has tools,
    or with the user's ``rollout_func`` (TRL's ``rollout_func(prompts, trainer)``: ``rollout_func_owner`` is the
    ``trainer`` it receives) — and scores it with every reward function (TRL's calling convention, with
    ``trainer_state``, ``log_metric`` and ``log_extra``); DAPO's overlong penalty joins the rewards as one more
    column."""

    def __init__(self, model: torch.nn.Module, processing_class, reward_funcs: list, reward_processing_classes: list,
                 args, *, multiturn=None, rollout_func: Callable | None = None, rollout_func_owner: Any = None,
                 bounds: CallBounds | None = None):
        self.processing_class = processing_class
        self.reward_funcs, self.reward_processing_classes = reward_funcs, reward_processing_classes
        self.args, self.multiturn = args, multiturn
        self.rollout_func, self.rollout_func_owner = rollout_func, rollout_func_owner
        self.eos_ids = stop_token_ids(model, processing_class)
        self.limits = TurnLimits(self.eos_ids, args.max_completion_length, context_length(model))
        self.bounds = bounds if bounds is not None else CallBounds.from_config(args)
        """Time bounds on every call into user code, and the run's stop flag (grpokit/bounds/user_calls.py)."""
        self.image_dtype = pixel_dtype(model)
        """The dtype a batch's pixel values are given to the model in (its weights')."""

    def __call__(self, rows: list[dict], driver: SamplingDriver, stats: RolloutStats) -> ScoredSamples:
        a = self.args
        extra: dict[str, list] = defaultdict(list)
        reward_kwargs = self._reward_kwargs(driver, stats, extra)
        first_turn = None
        if self.rollout_func is not None:
            first_turn = lambda rows, tools_per_row: self._rollout_func_turn(rows, driver)  # noqa: E731
        s = sample_and_score(rows, self.processing_class, driver.generate, self.reward_funcs,
                             self.reward_processing_classes, chat_template_kwargs=a.chat_template_kwargs,
                             max_prompt_length=a.max_prompt_length, device=driver.device, reward_kwargs=reward_kwargs,
                             multiturn=self.multiturn, limits=self.limits, first_turn=first_turn, bounds=self.bounds,
                             dtype=self.image_dtype)
        return self._account(s, rows, stats, extra)

    def score_generated(self, rows: list[dict], prepared: PreparedPrompts, generation: Generation,
                        driver: SamplingDriver, stats: RolloutStats) -> ScoredSamples:
        """Completions generated elsewhere (partial rollouts: :mod:`grpokit.pipeline.partial`) for ``rows``, whose
        prompts are ``prepared``, scored as :meth:`__call__` scores its own."""
        extra: dict[str, list] = defaultdict(list)
        s = score_generation(rows, prepared, generation, self.processing_class, self.reward_funcs,
                             self.reward_processing_classes, reward_kwargs=self._reward_kwargs(driver, stats, extra),
                             bounds=self.bounds)
        return self._account(s, rows, stats, extra)

    def prepare(self, rows: list[dict], device=None) -> PreparedPrompts:
        """The rows' prompts as generation gets them (chat template, tokenised, left-padded and truncated)."""
        return prepare_prompts(rows, self.processing_class, chat_template_kwargs=self.args.chat_template_kwargs,
                               max_prompt_length=self.args.max_prompt_length, device=device)

    @staticmethod
    def _reward_kwargs(driver: SamplingDriver, stats: RolloutStats, extra: dict[str, list]) -> dict:
        """What reward functions receive besides the rows: ``trainer_state``, ``log_metric`` and ``log_extra``."""
        return {
            "trainer_state": driver.trainer_state,
            "log_metric": stats.log_reward_metric,
            "log_extra": lambda column, values: extra[str(column)].extend(list(values)),
        }

    def _account(self, s: ScoredSamples, rows: list[dict], stats: RolloutStats,
                 extra: dict[str, list]) -> ScoredSamples:
        """What scoring measured into ``stats``; the logged extra columns and DAPO's overlong penalty into ``s``."""
        a = self.args
        for name, count in s.incidents.counts.items():  # timeouts, cut tool results
            stats.add(name, count)
        if s.tool_calls is not None:
            stats.add("tools/call_frequency", s.tool_calls / len(rows))
            stats.add("tools/failure_frequency", s.tool_failures / s.tool_calls if s.tool_calls else 0.0)
        s.extra_columns = {k: (list(v) + [None] * len(rows))[:len(rows)] for k, v in extra.items()}
        if s.n_truncated_prompts:
            stats.add("prompts/truncated_frac", s.n_truncated_prompts / len(rows))
        if a.overlong_buffer_length is not None:
            lengths = s.generation.completion_mask.sum(1)
            penalty = overlong_penalty(lengths, a.max_completion_length, a.overlong_buffer_length,
                                       a.overlong_penalty_factor)
            s.rewards = torch.cat([s.rewards, penalty.unsqueeze(1).to(s.rewards)], 1)
        return s

    def _rollout_func_turn(self, rows: list[dict], driver: SamplingDriver) -> tuple:
        """The prompts and first replies from ``rollout_func``; its extra fields join the rows."""
        from .rollout_func import call_rollout_func, merge_fields

        prepared, generation, fields = call_rollout_func(
            self.rollout_func, [r.get("prompt") for r in rows], self.rollout_func_owner, self.processing_class,
            self.eos_ids, use_logprobs=self.args.use_vllm,
            has_tools=self.multiturn is not None and self.multiturn.has_tools)
        prepared.ids, prepared.mask = prepared.ids.to(driver.device), prepared.mask.to(driver.device)
        return prepared, generation, merge_fields(rows, fields)
