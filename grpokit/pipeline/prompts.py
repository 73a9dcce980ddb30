"""Which prompts a run visits, in which order: the one seeded order that the dataloader's sampler, dynamic sampling's
refill stream and the asynchronous producer all read.

A *generation batch* holds ``prompts_per_batch`` distinct prompts, each repeated ``num_generations`` times
consecutively (a group). Epoch ``e`` visits the prompts in the permutation seeded with ``seed + e``; the refill
stream (dynamic sampling's extra prompts) walks its own permutations, pass ``p`` seeded with
``seed + REFILL_SEED_OFFSET + p``, so that it does not replay the sampler's order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from ..data import check_prompt_count

REFILL_SEED_OFFSET = 7919
"""Added to ``seed`` for the refill stream's permutations (a prime larger than any epoch count, so that pass ``p`` of
the refill stream never draws the permutation of the sampler's epoch ``p``)."""
PROMPT_SKIP_SEED_OFFSET = 104729
"""Added to ``seed`` for GRESO's skip draws (:mod:`grpokit.pipeline.prompt_skipping`): a stream of its own."""


def permutation(n: int, seed: int) -> list[int]:
    """The permutation of ``range(n)`` a seed gives (torch's ``randperm``, as the dataloader sampler always did)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


class PromptOrder:
    """The prompt indices of every generation batch and of the refill stream, for a dataset of ``num_prompts``."""

    def __init__(self, num_prompts: int, prompts_per_batch: int, shuffle: bool = True, seed: int = 0):
        check_prompt_count(num_prompts, prompts_per_batch)
        self.num_prompts = num_prompts
        self.prompts_per_batch = prompts_per_batch
        self.shuffle = shuffle
        self.seed = seed
        self.batches_per_epoch = num_prompts // prompts_per_batch  # an incomplete last block is dropped
        self._permutations: dict[int, list[int]] = {}

    def _permutation(self, seed: int) -> list[int]:
        """The permutation a seed gives, the last few kept (an epoch's and the refill stream's current pass are read
        row by row)."""
        if seed not in self._permutations:
            if len(self._permutations) >= 4:
                del self._permutations[next(iter(self._permutations))]
            self._permutations[seed] = permutation(self.num_prompts, seed)
        return self._permutations[seed]

    def epoch(self, epoch: int) -> list[int]:
        """Every prompt index in epoch ``epoch``'s order."""
        return self._permutation(self.seed + epoch) if self.shuffle else list(range(self.num_prompts))

    def batch(self, k: int) -> list[int]:
        """The distinct prompts of generation batch ``k`` (counted from the start of training, across epochs)."""
        epoch, j = divmod(k, self.batches_per_epoch)
        p = self.prompts_per_batch
        return self.epoch(epoch)[j * p:(j + 1) * p]

    def refill(self, position: int) -> int:
        """The prompt at ``position`` of the refill stream (a global position: process ``r`` of ``w`` reads
        positions ``r, r + w, r + 2w, ...``). Shuffled: a seeded permutation per pass over the dataset; not shuffled:
        the dataset in its order from the prompts after the first generation batch (a curriculum stays one)."""
        n = self.num_prompts
        if not self.shuffle:
            return (position + self.prompts_per_batch) % n
        return self._permutation(self.seed + REFILL_SEED_OFFSET + position // n)[position % n]


class GroupRepeatSampler(Sampler[int]):
    """Yields dataset indices so that each dataloader batch is one generation batch of :class:`PromptOrder`: each
    prompt index ``num_generations`` times consecutively (one row per completion, the group contiguous), the whole
    block ``repeats`` times (``steps_per_generation × num_iterations``: one dataloader batch per training micro-step;
    the trainer generates on the first and reuses the rollouts on the others). A resumed run replays the same order.
    """

    def __init__(self, num_prompts: int, num_generations: int, prompts_per_batch: int, repeats: int = 1,
                 shuffle: bool = True, seed: int = 0):
        self.order = PromptOrder(num_prompts, prompts_per_batch, shuffle, seed)
        self.num_prompts = num_prompts
        self.num_generations = num_generations
        self.prompts_per_batch = prompts_per_batch
        self.repeats = repeats
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        for k in range(self.order.batches_per_epoch):
            block = [i for i in self.order.batch(self.epoch * self.order.batches_per_epoch + k)
                     for _ in range(self.num_generations)]
            for _ in range(self.repeats):
                yield from block

    def __len__(self) -> int:
        return self.order.batches_per_epoch * self.prompts_per_batch * self.num_generations * self.repeats


class GroupRepeatIterable(torch.utils.data.IterableDataset):
    """:class:`GroupRepeatSampler`'s shape for a dataset read as a stream (an ``IterableDataset``, no ``len()``): each
    block of ``prompts_per_batch`` rows is yielded with every row ``num_generations`` times consecutively, the whole
    block ``repeats`` times; a trailing partial block is dropped. ``shuffle`` uses the stream's own buffered
    ``shuffle(seed=seed + epoch)`` when it has one (🤗 datasets). Under several processes accelerate gives each
    process its slice of every block, as it does with the sampler's batches."""

    def __init__(self, dataset, num_generations: int, prompts_per_batch: int, repeats: int = 1, shuffle: bool = True,
                 seed: int = 0):
        self.dataset = dataset
        self.num_generations = num_generations
        self.prompts_per_batch = prompts_per_batch
        self.repeats = repeats
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[dict]:
        stream = self.dataset
        if self.shuffle and hasattr(stream, "shuffle"):
            stream = stream.shuffle(seed=self.seed + self.epoch)
        block: list[dict] = []
        for row in stream:
            block.append(row)
            if len(block) == self.prompts_per_batch:
                for _ in range(self.repeats):
                    for r in block:
                        for _ in range(self.num_generations):
                            yield dict(r)
                block = []


class BatchRows:
    """The rows of generation batch ``k`` on process ``rank`` as the dataloader would give them (its contiguous share
    of the batch's ``prompts_per_batch × num_generations`` rows), read from the dataset by index: what the asynchronous
    producer generates ahead of the learner."""

    def __init__(self, dataset, order: PromptOrder, num_generations: int, rows_per_process: int, rank: int = 0):
        self.dataset, self.order, self.g = dataset, order, num_generations
        self.rows_per_process, self.rank = rows_per_process, rank

    def __call__(self, k: int) -> list[dict]:
        block = [i for i in self.order.batch(k) for _ in range(self.g)]
        mine = block[self.rank * self.rows_per_process:(self.rank + 1) * self.rows_per_process]
        return [dict(self.dataset[i]) for i in mine]
