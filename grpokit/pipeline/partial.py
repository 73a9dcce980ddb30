"""Partial rollouts (``partial_rollouts=True``): completions that outlive their generation batch and continue under
newer weights, so that a batch's longest completions no longer hold it back.

Without them a generation batch is ready when its longest completion ends: one completion in sixteen eight times the
median length keeps the producer decoding a handful of rows for most of the batch's time, and the learner waits. With
them the producer (the asynchronous thread, or a rollout worker) keeps *groups in flight*: for batch ``k`` it admits
the groups of batch ``k``'s prompts beside those still running from earlier batches, decodes all of them together,
and stops when ``B`` groups (the batch's size) have finished; the batch is the ``B`` finished groups that were admitted
first. The rest stay in flight for the next batch.

Weights arrive while groups are in flight: the producer stops decoding between two tokens, loads them, and continues
every running completion under them (:func:`grpokit.rollout.partial_decode.continue_rows` encodes each history anew:
no key-value cache crosses from one version to the next). Each token records the version of the weights that sampled
it and its log-prob under that version (at the run's temperature): the loss takes those as the behaviour log-probs,
token by token. ``max_staleness`` bounds every token's age: a group that would join a batch with a token older than
that batch allows (``max(0, v(k) - max_staleness)``) is sampled again from its prompt, counted in
``sample/partial_restarted_total``.

State: the keys (generation batch, group within this process's share of it) of the groups in flight after a batch, in
the pipeline's state (a checkpoint holds it); a resumed run samples those groups again from their prompts, first. No
prompt is lost or trained twice across a resume; the groups in flight when training ends are not trained (as the
prompts of a batch never taken).

Metrics: ``sample/token_staleness_mean`` and ``_max`` (the learner's version minus each token's, over completion
tokens), ``sample/partial_straddling_frac`` (completions sampled by more than one version),
``sample/partial_in_flight`` (groups left running after the batch) and ``sample/partial_restarted_total``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..bounds.watchdog import stage
from ..rollout.base import Generation, completion_mask_from_eos
from ..validation import refusal
from ..vision.detection import is_vlm
from ..vision.encoding import tokenizer_of
from .driver import ContinuingDriver
from .samples import ScoredSamples
from .stats import RolloutStats


class PartialWeights(Protocol):
    """What partial rollouts need from whoever holds the sampler's weights (the thread producer, a worker)."""

    def newer(self) -> bool:
        """Whether weights newer than the sampler's have been published (cheap: asked between two tokens)."""
        ...

    def refresh(self) -> int:
        """Load the newest published weights into the sampler; their version."""
        ...


@dataclass
class _Group:
    key: tuple[int, int]
    """(generation batch, group within this process's share of it): where its prompt comes from."""
    rows: list[dict]
    prompt: list[int]
    """The prompt's token ids, as generation sees it (chat template, truncation)."""
    tokens: list[list[int]] = field(default_factory=list)
    logps: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)

    def restart(self) -> None:
        g = len(self.rows)
        self.tokens, self.logps, self.versions = [[] for _ in range(g)], [[] for _ in range(g)], [[] for _ in range(g)]
        self.ended = [False] * g

    @property
    def done(self) -> bool:
        return all(self.ended)

    def oldest(self) -> int | None:
        return min((min(v) for v in self.versions if v), default=None)


@dataclass
class PartialBatch:
    """One batch of partial rollouts: its scored samples and, per completion token, the version that sampled it and
    its log-prob under that version."""

    samples: ScoredSamples
    behaviour_logps: torch.Tensor
    """(N, C) each token's log-prob under the weights that sampled it; 0 at padding."""
    token_versions: torch.Tensor
    """(N, C) the version of the weights that sampled each token; -1 at padding."""


def check_partial(pipeline, policy: torch.nn.Module, backend, params) -> None:
    """At train start, with ``partial_rollouts=True``: what partial rollouts do not continue, refused in one line."""
    from ..rollout.partial_decode import why_not_continued

    scorer = pipeline.scorer
    why = None
    if scorer.multiturn is not None:
        why = "tools and environments (a multi-turn rollout) are not continued across weight updates yet"
    elif scorer.rollout_func is not None:
        why = "a rollout_func generates its completions itself"
    elif is_vlm(policy):
        why = "a vision-language model's images are not carried into continued completions yet"
    else:
        why = why_not_continued(backend, policy, params)
    if why is not None:
        raise refusal("partial_rollouts", True, f"{why}; use partial_rollouts=False", when="here")


class PartialRollouts:
    """The groups in flight of one producer (it owns them: the thread or worker that samples). ``scorer``: the
    pipeline's :class:`grpokit.pipeline.scoring.RolloutScorer`."""

    def __init__(self, scorer, args):
        self.scorer, self.args = scorer, args
        self.g = args.num_generations
        self._flight: list[_Group] = []
        self._resume: list[tuple[int, int]] = []
        self._through = -1
        """The last generation batch whose groups were admitted."""

    # -- state -----------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        keys = [list(g.key) for g in self._flight] + [list(k) for k in self._resume]
        return {"partial_in_flight": sorted(keys), "partial_admitted_through": self._through}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._flight = []
        self._resume = [tuple(k) for k in state.get("partial_in_flight", [])]
        self._through = int(state.get("partial_admitted_through", -1))

    # -- producing ---------------------------------------------------------------------------------------------------
    def produce(self, k: int, rows_of: Callable[[int], list[dict]], driver: ContinuingDriver,
                weights: PartialWeights, oldest: int, stats: RolloutStats, ahead: tuple[int, int] | None = None) -> PartialBatch:
        """Generation batch ``k``: as many finished groups as ``rows_of(k)`` holds, none with a token older than
        version ``oldest``, the groups admitted first taken first. In flight: the groups left from earlier batches
        (on a resume, those a checkpoint had in flight, sampled again from their prompts), batch ``k``'s, and — once
        the sampler's weights are recent enough for it (``ahead``: the producer's next batch and the oldest version
        it allows) — the next batch's, so that the producer keeps decoding while a batch's longest completions run."""
        rows = rows_of(k)
        wanted = len(rows) // self.g
        for key in self._resume:  # a resumed run's groups in flight, sampled again from their prompts
            self._admit([key], [rows_of(key[0])[key[1] * self.g:(key[1] + 1) * self.g]])
        self._resume = []
        self._admit_batch(k, rows)
        restarted = 0
        for group in self._flight:
            first = group.oldest()
            if first is not None and first < oldest:  # a token too old for this batch (and any later one)
                group.restart()
                restarted += 1
        version = weights.refresh()
        with stage("generation"):
            while sum(g.done for g in self._flight) < wanted:
                if ahead is not None and ahead[1] <= version and ahead[0] > self._through:
                    self._admit_batch(ahead[0], rows_of(ahead[0]))
                version = self._decode(driver, weights, version, wanted)
        finished = [g for g in self._flight if g.done][:wanted]
        taken = {id(g) for g in finished}
        self._flight = [g for g in self._flight if id(g) not in taken]
        batch = self._score(finished, driver, stats)
        straddling = sum(len(set(v)) > 1 for g in finished for v in g.versions)
        stats.add("sample/partial_straddling_frac", straddling / len(batch.samples))
        stats.add("sample/partial_in_flight", float(len(self._flight)))
        stats.add("sample/partial_restarted_total", float(restarted))
        return batch

    def _admit_batch(self, k: int, rows: list[dict]) -> None:
        """Batch ``k``'s groups into flight, unless they were admitted already."""
        if k <= self._through:
            return
        n = len(rows) // self.g
        self._admit([(k, j) for j in range(n)], [rows[j * self.g:(j + 1) * self.g] for j in range(n)])
        self._through = k

    def _admit(self, keys: list[tuple[int, int]], groups: list[list[dict]]) -> None:
        if not keys:
            return
        prepared = self.scorer.prepare([r for rows in groups for r in rows])
        for j, (key, rows) in enumerate(zip(keys, groups)):
            first = j * self.g
            group = _Group(key=key, rows=rows, prompt=prepared.ids[first][prepared.mask[first].bool()].tolist())
            group.restart()
            self._flight.append(group)
        self._flight.sort(key=lambda g: g.key)

    def _decode(self, driver: ContinuingDriver, weights: PartialWeights, version: int, wanted: int) -> int:
        """Decode every running completion until ``wanted`` groups have finished or newer weights are published
        (then loaded: their version is returned)."""
        live = [(g, i) for g in self._flight for i in range(self.g) if not g.ended[i]]
        # Finished: the groups done before this call, and after each step those with no row among the running ones
        done_before = sum(g.done for g in self._flight)
        group_of = torch.tensor([gi for gi, g in enumerate(self._flight) for i in range(self.g) if not g.ended[i]])
        pending = torch.unique(group_of)

        def interrupt(running: torch.Tensor) -> bool:
            finished_now = pending.numel() - torch.unique(group_of[running.cpu()]).numel()
            return done_before + finished_now >= wanted or weights.newer()

        budget = self.args.max_completion_length
        out = driver.continue_rows([g.prompt + g.tokens[i] for g, i in live], [budget - len(g.tokens[i])
                                                                               for g, i in live], interrupt)
        for (g, i), tokens, logps, ended in zip(live, out.tokens, out.logps, out.ended):
            g.tokens[i] += tokens
            g.logps[i] += logps
            g.versions[i] += [version] * len(tokens)
            g.ended[i] = ended
        return weights.refresh() if weights.newer() else version

    def _score(self, groups: list[_Group], driver: ContinuingDriver, stats: RolloutStats) -> PartialBatch:
        rows = [r for g in groups for r in g.rows]
        prepared = self.scorer.prepare(rows, driver.device)
        completions = [(g.tokens[i], g.logps[i], g.versions[i]) for g in groups for i in range(self.g)]
        width = max(1, max(len(t) for t, _, _ in completions))
        pad = tokenizer_of(self.scorer.processing_class).pad_token_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        logps = torch.zeros((len(rows), width), dtype=torch.float32)
        versions = torch.full((len(rows), width), -1, dtype=torch.long)
        for n, (t, lp, v) in enumerate(completions):
            ids[n, :len(t)] = torch.tensor(t, dtype=torch.long)
            logps[n, :len(t)] = torch.tensor(lp, dtype=torch.float32)
            versions[n, :len(t)] = torch.tensor(v, dtype=torch.long)
        mask, truncated = completion_mask_from_eos(ids, self.scorer.eos_ids)
        generation = Generation(completion_ids=ids.masked_fill(mask == 0, pad).to(driver.device),
                                completion_mask=mask.to(driver.device), is_truncated=truncated.to(driver.device))
        samples = self.scorer.score_generated(rows, prepared, generation, driver, stats)
        return PartialBatch(samples=samples, behaviour_logps=logps * mask, token_versions=versions.masked_fill(
            mask == 0, -1))
