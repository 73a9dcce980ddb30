"""Prompts with images through each family's processor: the same ids and image tensors as the processor gives each
prompt alone, left-padded; max_prompt_length never cuts into an image."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from tiny_vlm import FAMILIES, shared_tiny_vlm

from grpokit.vision.encoding import encode_prompts, image_block_start

RED, BLUE = Image.new("RGB", (40, 30), "red"), Image.new("RGB", (50, 70), "blue")
PROMPTS = [[{"role": "user", "content": "What is this?"}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And these two?"}],
           [{"role": "user", "content": "No picture here, a longer question."}]]
IMAGES = [[RED], [BLUE, RED], None]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_row_is_what_the_processor_gives_it_alone(family):
    _, processor = shared_tiny_vlm(family)
    enc = encode_prompts(processor, PROMPTS, IMAGES)
    assert enc.images == [[RED], [BLUE, RED], []] and enc.truncated == 0
    width = enc.prompt_ids.shape[1]
    for i, (prompt, images) in enumerate(zip(PROMPTS, IMAGES)):
        parts = [{"type": "image", "image": im} for im in images or []]
        messages = [dict(m) for m in prompt]
        last_user = max(j for j, m in enumerate(messages) if m["role"] == "user")
        messages[last_user] = {"role": "user", "content": parts + [{"type": "text", "text": prompt[last_user]["content"]}]}
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        alone = processor(text=[text], images=[images] if images else None, return_tensors="pt",
                          add_special_tokens=False)
        n = alone["input_ids"].shape[1]
        assert enc.prompt_mask[i].tolist() == [0] * (width - n) + [1] * n  # left-padded
        assert torch.equal(enc.prompt_ids[i, width - n:], alone["input_ids"][0])
        got = enc.vision.select([i]).model_kwargs(n)
        want = {k: v for k, v in alone.items() if k not in ("input_ids", "attention_mask")} if images else {}
        assert set(got) == set(want), (got.keys(), want.keys())
        for key, value in want.items():
            g = got[key]
            if g.dim() == value.dim() and g.shape[1:] != value.shape[1:]:  # stacked images padded to the batch's most
                g = g[:, :value.shape[1]]
            torch.testing.assert_close(g, value, msg=key)
    twice = enc.repeat_interleave(2)
    assert twice.prompt_ids.shape[0] == 6 and torch.equal(twice.prompt_ids[2], twice.prompt_ids[3])
    assert twice.vision.images_per_row == [1, 1, 2, 2, 0, 0] and twice.images[3] == [BLUE, RED]


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3", "idefics3"])
def test_max_prompt_length_cuts_text_but_never_an_image(family):
    model, processor = shared_tiny_vlm(family)
    prompt = [{"role": "system", "content": "A long system prompt that can lose its start. " * 2},
              {"role": "user", "content": "Count."}]
    full = encode_prompts(processor, [prompt], [[RED]])
    n = full.prompt_ids.shape[1]
    cut = encode_prompts(processor, [prompt], [[RED]], max_prompt_length=n - 10)
    assert cut.truncated == 1 and torch.equal(cut.prompt_ids[0], full.prompt_ids[0, 10:])
    for key, t in cut.vision.fit_tokens(n - 10).items():
        assert torch.equal(t, full.vision.fit_tokens(n)[key][:, 10:])
    with torch.no_grad():  # the cut prompt still runs: its image tokens and image tensors agree
        model(input_ids=cut.prompt_ids, attention_mask=cut.prompt_mask, **cut.vision.model_kwargs(n - 10))
    start = image_block_start(full.prompt_ids[0].tolist(), *_token_sets(processor))
    assert 10 < start < n
    edge = encode_prompts(processor, [prompt], [[RED]], max_prompt_length=n - start)  # up to the image: allowed
    assert torch.equal(edge.prompt_ids[0], full.prompt_ids[0, start:])
    with pytest.raises(ValueError) as e:
        encode_prompts(processor, [PROMPTS[0], prompt], [None, [RED]], max_prompt_length=n - start - 1, first_row=40)
    message = str(e.value)
    assert message.startswith("row 41: ") and "would cut into its image" in message and f"at least {n}" in message
    assert "\n" not in message
    # a text prompt of the same batch is cut as text is
    text_only = encode_prompts(processor, [PROMPTS[2]], None, max_prompt_length=5)
    assert text_only.truncated == 1 and text_only.prompt_ids.shape == (1, 5) and text_only.vision is None


def _token_sets(processor):
    from grpokit.vision.encoding import processor_image_token_ids

    return processor_image_token_ids(processor), set(processor.tokenizer.all_special_ids)


def test_plain_text_prompts_hold_the_image_token_once_per_image():
    model, processor = shared_tiny_vlm("llava")
    enc = encode_prompts(processor, ["USER: <image>\nWhat colour? ASSISTANT:", "Text only."], [[RED], None])
    assert enc.vision.images_per_row == [1, 0]
    with torch.no_grad():
        model(input_ids=enc.prompt_ids, attention_mask=enc.prompt_mask, **enc.vision.model_kwargs(enc.prompt_ids.shape[1]))
    with pytest.raises(ValueError, match=r"row 3: a plain-text prompt must hold the image token '<image>' once per "
                                         r"image \(found 0 for 1 image\(s\)\)"):
        encode_prompts(processor, ["x", "What colour?"], [None, [RED]], first_row=2)


def test_bad_prompts_name_their_row():
    _, processor = shared_tiny_vlm("gemma3")
    with pytest.raises(ValueError, match="row 8: the prompt has 1 image placeholder"):
        encode_prompts(processor, [[{"role": "user", "content": [{"type": "image"}]}]], [[RED, BLUE]], first_row=8)
    with pytest.raises(ValueError, match="row 0: prompt 12 is neither"):
        encode_prompts(processor, [12])
    with pytest.raises(ValueError, match="2 prompts but 1 image lists"):
        encode_prompts(processor, PROMPTS[:2], [[RED]])


def test_rows_of_a_generation_batch_are_encoded_once_per_group():
    from grpokit.tasks import get_task
    from grpokit.vision.encoding import encode_rows

    model, processor = shared_tiny_vlm("idefics3")
    task = get_task("shapes", n_eval=2, n_train=3)
    rows = [dict(r) for r in task.train_dataset for _ in range(4)]  # 3 prompts × G = 4, as the sampler yields them
    calls = []
    original = type(processor).__call__
    type(processor).__call__ = lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    try:
        enc = encode_rows(processor, rows, group_size=4, first_row=10)
    finally:
        type(processor).__call__ = original
    assert len(calls) == 3 and enc.prompt_ids.shape[0] == 12 and enc.vision.is_grouped(4)
    assert enc.images[5][0].tobytes() == rows[5]["image"].tobytes()
    with torch.no_grad():
        model(input_ids=enc.prompt_ids, attention_mask=enc.prompt_mask, **enc.vision.model_kwargs(enc.prompt_ids.shape[1]))
    with pytest.raises(ValueError, match="12 rows do not make whole groups of 5"):
        encode_rows(processor, rows, group_size=5)
    rows[4]["image"] = "missing.png"
    with pytest.raises(ValueError, match="row 11: image: image file 'missing.png' does not exist"):
        encode_rows(processor, rows, group_size=4, first_row=10)
