"""``word_count``: "Describe {topic} in one sentence of exactly {n} words.", a format task sized for a 135M model.

Measured on 32 held-out prompts (seed 0, greedy, 48 new tokens), SmolLM2-135M-Instruct writes one
sentence of 12-37 words whatever ``n`` is: 0 replies exact, 2 within one word, mean ``length``
score 0.47. The exact reward (``word_count``) alone would rarely fire, so the graded ``length``
reward, which differs between any two replies of different length, points toward the target from
the first step. Sampled at T=0.7 (12 training prompts x 8), 5 of 96 replies were exact and 3 of
the 12 groups held at least one exact reply, all for targets of 9 or more words: the exact reward
is earnable, not only the graded one.
"""

from __future__ import annotations

import random

from ..rewards import length, word_count
from .base import Task, split_holdout, user_turn

__all__ = ["TOPICS", "make_word_count_task"]

TOPICS = [
    "the sea", "a cat", "winter", "coffee", "a forest", "the moon", "music", "a train", "rain",
    "friendship", "the city", "bread", "a river", "the desert", "autumn", "a library", "a dog",
    "the wind", "a mountain", "chess", "a garden", "the sun", "snow", "a bicycle", "the night sky",
    "a market", "tea", "a storm", "an island", "a bridge", "the morning", "a candle", "a clock",
    "a volcano", "the ocean floor", "a kite", "a lighthouse", "a festival", "an old house", "spring",
    "a birthday", "a school", "the stars", "a piano", "a bakery", "a farm", "a waterfall", "a map",
    "a letter", "a museum",
]  # fmt: skip
MIN_WORDS, MAX_WORDS = 5, 15

DESCRIPTION = (
    f"Instruction following: \"Describe {{topic}} in one sentence of exactly {{n}} words.\" for 50 topics "
    f"and n from {MIN_WORDS} to {MAX_WORDS} (550 prompts, shuffled by the seed, the first n_eval held out). "
    "Rewards: word_count 1.0 for exactly n words (the accuracy), and length n / (n + |words - n|), a graded "
    "score that still separates replies that all miss. Words are runs of letters or digits."
)


def make_word_count_task(*, seed: int = 0, n_eval: int = 128) -> Task:
    pairs = [(topic, n) for topic in TOPICS for n in range(MIN_WORDS, MAX_WORDS + 1)]
    random.Random(seed).shuffle(pairs)
    rows = [
        {
            "prompt": user_turn(f"Describe {topic} in one sentence of exactly {n} words."),
            "answer": str(n),  # every task has an answer column; here it is the word count
            "target_words": n,
        }
        for topic, n in pairs
    ]
    train, held_out = split_holdout(rows, n_eval, "word_count")
    return Task(
        name="word_count",
        train_dataset=train,
        eval_dataset=held_out,
        reward_funcs=[word_count, length],
        accuracy_reward="word_count",
        description=DESCRIPTION,
        metadata={"seed": seed, "n_eval": n_eval, "n_prompts": len(rows)},
    )
