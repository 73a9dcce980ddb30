"""VisionInputs: rows selected, repeated, concatenated and fitted by each tensor's unit (row, image, patch, token),
checked on tensors whose values say where they came from."""

from __future__ import annotations

import pytest
import torch

from grpokit.vision.inputs import VisionInputs


def _qwen_like(images_per_row=(1, 2, 0)):
    """Patches labelled ``100 * image + patch``; image ``j`` has ``j + 1`` patches; token types 1 on the last
    ``images`` tokens of each row (right-aligned, width 4)."""
    n = sum(images_per_row)
    patches = [j + 1 for j in range(n)]
    pixel = torch.tensor([[100.0 * j + k] for j in range(n) for k in range(patches[j])])
    grid = torch.tensor([[1, 1, p] for p in patches])
    types = torch.zeros(len(images_per_row), 4, dtype=torch.long)
    for r, k in enumerate(images_per_row):
        if k:
            types[r, -k:] = 1
    out = {"input_ids": torch.zeros(len(images_per_row), 4), "pixel_values": pixel, "image_grid_thw": grid,
           "mm_token_type_ids": types}
    return VisionInputs.from_processor_output(out, images_per_row)


def test_units_are_read_from_the_layout():
    v = _qwen_like()
    assert v.units == {"pixel_values": "patch", "image_grid_thw": "image", "mm_token_type_ids": "token"}
    assert v.patches_per_image == [1, 2, 3] and v.rows == 3 and v.num_images == 3 and v.token_width == 4
    stacked = VisionInputs.from_processor_output(
        {"pixel_values": torch.zeros(2, 3, 3, 4, 4), "pixel_attention_mask": torch.ones(2, 3, 4, 4, dtype=torch.bool)},
        [1, 3])
    assert stacked.units == {"pixel_values": "row", "pixel_attention_mask": "row"}
    tiles = VisionInputs.from_processor_output({"pixel_values": torch.zeros(3, 5, 3, 4, 4),
                                                "image_sizes": torch.ones(3, 2)}, [2, 1])
    assert tiles.units == {"pixel_values": "image", "image_sizes": "image"}
    with pytest.raises(ValueError, match="pixel_values has 4 entries where 3 images were expected"):
        VisionInputs.from_processor_output({"pixel_values": torch.zeros(4, 3, 2, 2)}, [1, 2])


def test_select_and_repeat_follow_images_and_patches():
    v = _qwen_like()
    s = v.select([1, 0, 1])
    # row 1 holds images 1 (patches 100) and 2 (200, 201); row 0 image 0 (patch 0)
    assert s.tensors["pixel_values"].flatten().tolist() == [100, 101, 200, 201, 202, 0, 100, 101, 200, 201, 202]
    assert s.tensors["image_grid_thw"][:, 2].tolist() == [2, 3, 1, 2, 3]
    assert s.images_per_row == [2, 1, 2] and s.patches_per_image == [2, 3, 1, 2, 3]
    assert s.tensors["mm_token_type_ids"].tolist() == [[0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 1, 1]]
    r = v.repeat_interleave(2)
    assert r.images_per_row == [1, 1, 2, 2, 0, 0] and r.tensors["pixel_values"].shape[0] == 2 * (1 + 5)
    assert r.is_grouped(2) and not v.is_grouped(3) and v.is_grouped(1)
    assert v.select(slice(1, 3)).images_per_row == [2, 0] and v.select(range(0)).rows == 0
    with pytest.raises(IndexError):
        v.select([3])
    # the same prompt text with different images is not a group
    mixed = VisionInputs.cat([v.select([1]), v.select([1]), v.select([0]), v.select([1])])
    assert mixed.equal_to_previous().tolist() == [True, False, False]
    assert not mixed.is_grouped(2) and not mixed.is_grouped(4) and mixed.select([0, 1]).is_grouped(2)
    assert v.select([2, 2, 1]).equal_to_previous().tolist() == [True, False] and v.select([1]).is_grouped(1)


def test_cat_pads_tokens_on_the_left_and_stacks_with_zeros():
    a, b = _qwen_like((1,)), _qwen_like((0, 2))
    b.tensors["mm_token_type_ids"] = b.tensors["mm_token_type_ids"][:, 1:]  # width 3
    b.token_width = 3
    merged = VisionInputs.cat([a, None, b], [1, 2, 2])
    assert merged.images_per_row == [1, 0, 0, 0, 2] and merged.token_width == 4
    assert merged.tensors["mm_token_type_ids"].tolist() == [[0, 0, 0, 1]] + [[0, 0, 0, 0]] * 3 + [[0, 0, 1, 1]]
    assert merged.tensors["pixel_values"].flatten().tolist() == [0, 0, 100, 101]  # each part's own labels
    assert VisionInputs.cat([None, None]) is None
    one = VisionInputs.from_processor_output({"pixel_values": torch.ones(1, 1, 3, 2, 2),
                                              "pixel_attention_mask": torch.ones(1, 1, 2, 2, dtype=torch.bool)}, [1])
    three = VisionInputs.from_processor_output({"pixel_values": 2 * torch.ones(1, 3, 3, 2, 2),
                                                "pixel_attention_mask": torch.ones(1, 3, 2, 2, dtype=torch.bool)}, [3])
    stacked = VisionInputs.cat([one, None, three])
    assert stacked.tensors["pixel_values"].shape == (3, 3, 3, 2, 2)
    assert stacked.tensors["pixel_attention_mask"].sum((2, 3)).tolist() == [[4, 0, 0], [0, 0, 0], [4, 4, 4]]
    assert stacked.tensors["pixel_values"][0, 1:].abs().sum() == 0 and stacked.tensors["pixel_values"][1].abs().sum() == 0


def test_tokens_are_fitted_to_the_prompt_width_and_zero_over_the_completion():
    v = _qwen_like()
    wide = v.fit_tokens(6, completion_width=2)["mm_token_type_ids"]
    assert wide.tolist()[1] == [0, 0, 0, 0, 1, 1, 0, 0] and wide.shape == (3, 8)
    assert v.fit_tokens(3)["mm_token_type_ids"].tolist()[1] == [0, 1, 1]  # cut on the left
    kwargs = v.model_kwargs(5, 1)
    assert set(kwargs) == {"pixel_values", "image_grid_thw", "mm_token_type_ids"}
    assert kwargs["mm_token_type_ids"].shape == (3, 6)
    assert v.select([2]).model_kwargs(5) == {}  # a text row: a text forward


def test_to_casts_only_floating_tensors():
    v = _qwen_like().to("cpu", torch.float64)
    assert v.tensors["pixel_values"].dtype == torch.float64 and v.tensors["image_grid_thw"].dtype == torch.long
    assert v.tensors["mm_token_type_ids"].dtype == torch.long


def test_units_must_describe_the_tensors():
    with pytest.raises(ValueError, match="do not describe"):
        VisionInputs({"pixel_values": torch.zeros(1)}, {"pixel_values": "pixels"}, [1])


def test_extend_tokens_appends_text_after_each_prompt():
    v = _qwen_like()  # token types right-aligned, width 4
    e = v.extend_tokens([2, 0, 1])
    assert e.token_width == 6
    # row 0's prompt is followed by 2 text tokens, row 1's by none, row 2's by one: still right-aligned
    assert e.tensors["mm_token_type_ids"].tolist() == [[0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0]]
    assert torch.equal(e.tensors["pixel_values"], v.tensors["pixel_values"]) and e.images_per_row == v.images_per_row
    # fitted to a continued prompt of width 7 and a completion of 2: the image tokens sit where the ids put them
    assert e.fit_tokens(7, 2)["mm_token_type_ids"][0].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="2 extensions for 3 prompts"):
        v.extend_tokens([1, 1])


def test_layout_and_tensors_give_the_inputs_back():
    v = _qwen_like().select([2, 1, 1])
    back = VisionInputs.from_layout(dict(v.tensors), v.layout())
    assert back.units == v.units and back.images_per_row == v.images_per_row
    assert back.patches_per_image == v.patches_per_image and back.token_width == v.token_width
    assert all(torch.equal(back.tensors[k], t) for k, t in v.tensors.items())
    with pytest.raises(ValueError, match="expected"):
        VisionInputs.from_layout(dict(v.tensors), {**v.layout(), "images_per_row": [1, 1, 1]})
