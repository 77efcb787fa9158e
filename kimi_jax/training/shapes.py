"""Procedurally drawn images with questions about them (the tiny vision-language model's training data).

A scene is a light background with one to three shapes (square, circle, triangle) of distinct kinds and colours,
or a single large digit. Each example asks one question whose answer is one word:
"What colour is the square?" -> "red", "Which shape is blue?" -> "circle", "How many shapes are there?" -> "2",
"What digit is this?" -> "7". Image sizes and aspect ratios vary, so the tower sees every resize it will meet.
"""

from __future__ import annotations

import dataclasses
import random

from PIL import Image, ImageDraw, ImageFont

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 40), "blue": (30, 60, 220), "yellow": (235, 205, 20),
           "purple": (140, 40, 170), "orange": (245, 130, 20), "black": (20, 20, 20)}
SHAPES = ("square", "circle", "triangle")
TASKS = {"colour": 0.5, "shape": 0.2, "count": 0.15, "digit": 0.15}
COLOUR_QUESTIONS = ("What colour is the {shape}?", "What color is the {shape}?", "Which colour is the {shape}?")


@dataclasses.dataclass(frozen=True)
class Example:
    image: Image.Image
    question: str
    answer: str
    task: str


def _jitter(colour: tuple[int, int, int], rng: random.Random, amount: int = 25) -> tuple[int, ...]:
    return tuple(min(255, max(0, c + rng.randint(-amount, amount))) for c in colour)


def _background(rng: random.Random, size: tuple[int, int]) -> Image.Image:
    return Image.new("RGB", size, tuple(rng.randint(200, 255) for _ in range(3)))


def _draw_shape(draw: ImageDraw.ImageDraw, kind: str, box: tuple[int, int, int, int], fill) -> None:
    x0, y0, x1, y1 = box
    if kind == "square":
        draw.rectangle(box, fill=fill)
    elif kind == "circle":
        draw.ellipse(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)


def _place(rng: random.Random, size: tuple[int, int], side: int, taken: list) -> tuple[int, int, int, int] | None:
    for _ in range(50):
        x, y = rng.randint(0, size[0] - side), rng.randint(0, size[1] - side)
        box = (x, y, x + side, y + side)
        if all(box[2] <= t[0] or t[2] <= box[0] or box[3] <= t[1] or t[3] <= box[1] for t in taken):
            return box
    return None


def shape_scene(rng: random.Random, size: tuple[int, int]) -> tuple[Image.Image, dict[str, str]]:
    """-> (image, {shape kind: colour name}) with 1-3 shapes of distinct kinds and colours."""
    image = _background(rng, size)
    draw = ImageDraw.Draw(image)
    kinds = rng.sample(SHAPES, rng.randint(1, 3))
    colours = rng.sample(sorted(COLOURS), len(kinds))
    taken, facts = [], {}
    for kind, colour in zip(kinds, colours):
        side = int(min(size) * rng.uniform(0.28, 0.45))
        box = _place(rng, size, side, taken)
        if box is None:
            continue
        taken.append(box)
        _draw_shape(draw, kind, box, _jitter(COLOURS[colour], rng))
        facts[kind] = colour
    return image, facts


def digit_scene(rng: random.Random, size: tuple[int, int]) -> tuple[Image.Image, str]:
    image = _background(rng, size)
    digit = str(rng.randint(0, 9))
    font = ImageFont.load_default(size=int(min(size) * rng.uniform(0.55, 0.8)))
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = draw.textbbox((0, 0), digit, font=font)
    x = rng.randint(0, max(0, size[0] - (right - left))) - left
    y = rng.randint(0, max(0, size[1] - (bottom - top))) - top
    draw.text((x, y), digit, fill=_jitter(COLOURS[rng.choice(sorted(COLOURS))], rng), font=font)
    return image, digit


def random_size(rng: random.Random) -> tuple[int, int]:
    side = rng.randint(84, 224)
    ratio = rng.uniform(0.75, 1.33)
    return side, max(56, int(side * ratio))


def make_example(rng: random.Random, task: str | None = None) -> Example:
    """One image + question + one-word answer; ``task`` one of TASKS (random by its weight if None)."""
    task = task or rng.choices(list(TASKS), weights=list(TASKS.values()))[0]
    size = random_size(rng)
    if task == "digit":
        image, digit = digit_scene(rng, size)
        return Example(image, "What digit is this?", digit, task)
    image, facts = shape_scene(rng, size)
    if task == "count":
        return Example(image, "How many shapes are there?", str(len(facts)), task)
    kind = rng.choice(sorted(facts))
    if task == "shape":
        return Example(image, f"Which shape is {facts[kind]}?", kind, task)
    return Example(image, rng.choice(COLOUR_QUESTIONS).format(shape=kind), facts[kind], task)
