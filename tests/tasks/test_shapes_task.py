"""The built-in visual task: pictures drawn from the seed whose answers a recount from the pixels agrees with."""

from __future__ import annotations

import math

import numpy as np
import pytest

from grpokit.tasks import ANSWER_INSTRUCTION, get_task
from grpokit.tasks.shapes import COLOURS, GRID, KINDS, draw_scene, random_scene

WHITE = (255, 255, 255)


def _recount(image, question: str) -> int:
    """Count from the pixels: each cell's centre colour, and its shape from two corners (a square fills its top-left
    corner, a triangle its bottom-left, a circle neither)."""
    pixels = np.asarray(image)
    size = pixels.shape[0]
    cell = size / GRID
    found = []
    for row in range(GRID):
        for col in range(GRID):
            x0, y0 = math.ceil(col * cell + cell * 0.15), math.ceil(row * cell + cell * 0.15)
            y1 = math.floor((row + 1) * cell - cell * 0.15)
            centre = tuple(int(v) for v in pixels[int((row + 0.5) * cell), int((col + 0.5) * cell)])
            if centre == WHITE:
                continue
            colour = next(name for name, rgb in COLOURS.items() if rgb == centre)
            if tuple(pixels[y0, x0]) != WHITE:
                kind = "square"
            elif tuple(pixels[y1, x0 + 2]) != WHITE:
                kind = "triangle"
            else:
                kind = "circle"
            found.append((kind, colour))
    asked = next(w for w in [*KINDS, *COLOURS] if f" {w}" in question.split("?")[0])
    return sum(asked in pair for pair in found)


def test_answers_agree_with_the_pixels_and_the_split_is_disjoint():
    task = get_task("shapes", seed=3, n_eval=16, n_train=64)
    assert len(task.train_dataset) == 64 and len(task.eval_dataset) == 16
    assert task.reward_names == ["correctness", "format"] and task.metadata["needs_images"]
    kinds = set()
    for split in (task.train_dataset, task.eval_dataset):
        for row in split:
            question = row["prompt"][0]["content"]
            assert question.endswith(ANSWER_INSTRUCTION) and row["image"].size == (64, 64)
            assert _recount(row["image"].convert("RGB"), question) == int(row["answer"]) >= 1
            kinds.add(question.split()[2])
    assert kinds >= {"circles", "squares", "triangles", "red"}  # both kinds of question
    train = {(r["prompt"][0]["content"], r["image"].tobytes()) for r in task.train_dataset}
    held = {(r["prompt"][0]["content"], r["image"].tobytes()) for r in task.eval_dataset}
    assert len(train) == 64 and not train & held  # distinct pictures, none held out and trained on


def test_the_seed_draws_the_same_task():
    a, b = get_task("shapes", seed=1, n_eval=4, n_train=8), get_task("shapes", seed=1, n_eval=4, n_train=8)
    c = get_task("shapes", seed=2, n_eval=4, n_train=8)
    rows = lambda t: [(r["prompt"][0]["content"], r["answer"], r["image"].tobytes()) for r in t.train_dataset]
    assert rows(a) == rows(b) and rows(a) != rows(c)


def test_scenes_and_sizes():
    import random

    rng = random.Random(0)
    for _ in range(200):
        scene = random_scene(rng, max_count=6)
        assert 1 <= scene.answer <= 6 and len({cell for *_, cell in scene.shapes}) == len(scene.shapes)
        assert _recount(draw_scene(scene, 96), scene.question) == scene.answer
    big = get_task("shapes", n_eval=2, n_train=2, image_size=128)
    assert big.train_dataset[0]["image"].size == (128, 128)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_count": 10}, "at most 9 shapes"), ({"n_train": 0}, "n_train=0"), ({"image_size": 8}, "image_size=8"),
    ({"n_eval": 10, "n_train": 1, "max_count": 1}, None),
])
def test_bad_options_are_one_line(kwargs, message):
    if message is None:
        assert len(get_task("shapes", **kwargs).train_dataset) == 1
        return
    with pytest.raises(ValueError, match=message):
        get_task("shapes", **kwargs)
