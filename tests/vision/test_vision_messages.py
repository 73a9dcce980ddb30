"""Images placed in chat prompts as TRL 1.16 places them; read back; dropped for logs."""

from __future__ import annotations

import copy

import pytest
from PIL import Image

from grpokit.vision.messages import has_image_parts, place_images, prompt_images, strip_images

RED, BLUE = Image.new("RGB", (4, 4), "red"), Image.new("RGB", (4, 4), "blue")


def test_string_contents_get_image_parts_before_the_first_user_text():
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What colours?"},
              {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Sure?"}]
    before = copy.deepcopy(prompt)
    out = place_images(prompt, [RED, BLUE])
    assert prompt == before  # the row's own prompt is left as it is
    assert out == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image", "image": RED}, {"type": "image", "image": BLUE},
                                     {"type": "text", "text": "What colours?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Red."}]},
        {"role": "user", "content": [{"type": "text", "text": "Sure?"}]},
    ]
    assert prompt_images(out) == [RED, BLUE] and has_image_parts(out) and not has_image_parts(prompt)


def test_placeholders_are_filled_in_order_and_filled_images_kept():
    prompt = [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "image"},
                                           {"type": "image", "image": RED}, {"type": "image"}]}]
    out = place_images(prompt, [BLUE, RED])
    assert [p.get("image") for p in out[0]["content"]] == [None, BLUE, RED, RED]
    assert prompt_images(out) == [BLUE, RED, RED]
    assert place_images([{"role": "user", "content": "no images"}], None) == [
        {"role": "user", "content": [{"type": "text", "text": "no images"}]}]


@pytest.mark.parametrize("prompt, images, message", [
    ([{"role": "user", "content": [{"type": "image"}]}], [RED, BLUE], "1 image placeholder(s)"),
    ([{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}], [RED], "2 image placeholder(s)"),
    ([{"role": "user", "content": [{"type": "image"}]}], [], "has 0 image(s)"),
    ([{"role": "system", "content": "only a system turn"}], [RED], "no user message"),
    ([{"role": "robot", "content": "x"}], [RED], "role 'robot'"),
])
def test_mismatches_are_one_line_naming_the_row(prompt, images, message):
    with pytest.raises(ValueError) as e:
        place_images(prompt, images, row=5)
    assert str(e.value).startswith("row 5: ") and message in str(e.value) and "\n" not in str(e.value)


def test_strip_images_keeps_the_structure():
    out = place_images([{"role": "user", "content": "Look"}], [RED])
    assert strip_images(out) == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Look"}]}]
    assert prompt_images(out) == [RED]  # the input is not changed
    assert strip_images("plain text") == "plain text"
