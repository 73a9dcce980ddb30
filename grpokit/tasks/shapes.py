"""``shapes``: a visual counting task whose pictures grpokit draws itself (PIL), for vision-language models.

Each picture shows 1 to ``max_count`` shapes of the asked kind or colour among a few others, each in its own cell of
a 3 × 3 grid on a white square; the question is "How many circles are in the picture?" or "How many red shapes are in
the picture?", answered as a number. Everything is drawn from the seed: the same seed gives the same pictures and the
same split. Rewards: ``correctness`` and ``format``, as the arithmetic task.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..rewards import correctness, format_reward
from ..validation import refusal
from .base import ANSWER_INSTRUCTION, Task, split_holdout

__all__ = ["COLOURS", "KINDS", "Scene", "draw_scene", "make_shapes_task", "random_scene"]

KINDS = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (230, 200, 20)}
GRID = 3


@dataclass(frozen=True)
class Scene:
    """What a picture shows: ``(kind, colour, cell)`` per shape (cells 0..8 of the 3 × 3 grid), and the question."""

    shapes: tuple[tuple[str, str, int], ...]
    asks: str
    """A kind (``"circle"``) or a colour (``"red"``)."""

    @property
    def answer(self) -> int:
        return sum(1 for kind, colour, _ in self.shapes if self.asks in (kind, colour))

    @property
    def question(self) -> str:
        noun = f"{self.asks}s" if self.asks in KINDS else f"{self.asks} shapes"
        return f"How many {noun} are in the picture? {ANSWER_INSTRUCTION}"


def random_scene(rng: random.Random, max_count: int = 4) -> Scene:
    """A scene with 1..``max_count`` shapes that answer the question and up to 2 that do not."""
    by_kind = rng.random() < 0.5
    asks = rng.choice(KINDS) if by_kind else rng.choice(sorted(COLOURS))
    count = rng.randint(1, max_count)
    others = rng.randint(0, min(2, GRID * GRID - count))
    cells = rng.sample(range(GRID * GRID), count + others)
    shapes = []
    for i, cell in enumerate(cells):
        kind, colour = rng.choice(KINDS), rng.choice(sorted(COLOURS))
        if i < count:  # answers the question
            kind, colour = (asks, colour) if by_kind else (kind, asks)
        else:  # must not
            if by_kind:
                kind = rng.choice([k for k in KINDS if k != asks])
            else:
                colour = rng.choice([c for c in sorted(COLOURS) if c != asks])
        shapes.append((kind, colour, cell))
    return Scene(tuple(sorted(shapes, key=lambda s: s[2])), asks)


def draw_scene(scene: Scene, size: int = 64):
    """The scene as an RGB PIL image of ``size`` × ``size`` pixels."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    cell = size / GRID
    for kind, colour, index in scene.shapes:
        row, col = divmod(index, GRID)
        x0, y0 = col * cell + cell * 0.15, row * cell + cell * 0.15
        x1, y1 = (col + 1) * cell - cell * 0.15, (row + 1) * cell - cell * 0.15
        fill = COLOURS[colour]
        if kind == "circle":
            draw.ellipse([x0, y0, x1, y1], fill=fill)
        elif kind == "square":
            draw.rectangle([x0, y0, x1, y1], fill=fill)
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return image


def make_shapes_task(*, seed: int = 0, n_eval: int = 128, n_train: int = 512, image_size: int = 64,
                     max_count: int = 4) -> Task:
    """The task: ``n_train + n_eval`` distinct scenes drawn from ``seed``, the first ``n_eval`` held out."""
    for name, value, lo in (("n_train", n_train, 1), ("image_size", image_size, 16), ("max_count", max_count, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            raise refusal(name, value, f"expected an integer >= {lo}", prefix="Task 'shapes': ")
    if max_count > GRID * GRID:
        raise refusal("max_count", max_count, f"at most {GRID * GRID} shapes fit", prefix="Task 'shapes': ")
    rng = random.Random(seed)
    scenes: dict[Scene, None] = {}
    for _ in range(100 * (n_train + n_eval)):
        if len(scenes) == n_train + n_eval:
            break
        scenes.setdefault(random_scene(rng, max_count))
    rows = [{"prompt": [{"role": "user", "content": s.question}], "image": draw_scene(s, image_size),
             "answer": str(s.answer)} for s in scenes]
    train, held_out = split_holdout(rows, n_eval, "shapes")
    description = (
        f"Count shapes in pictures grpokit draws (PIL, {image_size}x{image_size}): 1-{max_count} circles, squares, "
        f"triangles or shapes of a colour among up to 2 others; \"How many circles are in the picture?\" or \"How "
        f"many red shapes are in the picture?\" ({len(rows)} distinct pictures from the seed, the first n_eval held "
        f"out). Needs a vision-language model. Rewards: correctness 1.0 when the number after the last 'Answer:' is "
        f"the count, format 0.2 for ending with 'Answer: <number>'."
    )
    return Task(name="shapes", train_dataset=train, eval_dataset=held_out, reward_funcs=[correctness, format_reward],
                accuracy_reward="correctness", description=description,
                metadata={"seed": seed, "n_eval": n_eval, "n_train": len(train), "image_size": image_size,
                          "max_count": max_count, "needs_images": True})
