"""Generation with images through the transformers backend: the tokens model.generate gives each row alone, image
placeholder tokens never sampled."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from tiny_vlm import FAMILIES, shared_tiny_vlm, tiny_vlm

from grpokit.rollout.base import SamplingParams
from grpokit.rollout.transformers_backend import TransformersRollout
from grpokit.vision.adapters import parameter_parts
from grpokit.vision.detection import image_token_ids
from grpokit.vision.encoding import encode_prompts

RED, BLUE = Image.new("RGB", (40, 30), "red"), Image.new("RGB", (50, 70), "blue")
PROMPTS = [[{"role": "user", "content": "What is this?"}], [{"role": "user", "content": "And these two, longer?"}],
           [{"role": "user", "content": "No image here."}]]


def _encoded(processor, g=2):
    return encode_prompts(processor, PROMPTS, [[RED], [BLUE, RED], None]).repeat_interleave(g)


def _alone(model, enc, i, n):
    keep = enc.prompt_mask[i].bool()
    ids = enc.prompt_ids[i][keep][None]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         suppress_tokens=image_token_ids(model), **enc.vision.select([i]).model_kwargs(ids.shape[1]))
    return out[0, ids.shape[1]:]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_generation_equals_generate_on_each_row_alone(family):
    model, processor = shared_tiny_vlm(family)
    enc = _encoded(processor)
    backend = TransformersRollout(processor.tokenizer)
    encoded_images = []
    tower = model.get_submodule("model." + parameter_parts(model)["vision"][0].split(".")[1])  # model.visual, ...
    handle = tower.register_forward_hook(lambda *a: encoded_images.append(1))
    try:
        gen = backend.generate(model, enc.prompt_ids, enc.prompt_mask,
                               SamplingParams(max_new_tokens=6, do_sample=False), vision=enc.vision)
    finally:
        handle.remove()
    assert encoded_images and not model.training  # the images reached generate
    for i in range(enc.prompt_ids.shape[0]):
        got = gen.completion_ids[i][gen.completion_mask[i].bool()]
        assert torch.equal(_alone(model, enc, i, 6)[:len(got)], got), i


def test_chunks_and_sampling_with_images():
    model, processor = shared_tiny_vlm("qwen2_vl")
    enc = _encoded(processor, g=3)
    greedy = SamplingParams(max_new_tokens=5, do_sample=False)
    whole = TransformersRollout(processor.tokenizer).generate(model, enc.prompt_ids, enc.prompt_mask, greedy,
                                                              vision=enc.vision)
    chunked = TransformersRollout(processor.tokenizer, max_batch_size=4).generate(
        model, enc.prompt_ids, enc.prompt_mask, greedy, vision=enc.vision)  # chunks cut groups and image rows
    assert torch.equal(whole.completion_ids, chunked.completion_ids)
    torch.manual_seed(0)
    sampled = TransformersRollout(processor.tokenizer).generate(
        model, enc.prompt_ids, enc.prompt_mask, SamplingParams(max_new_tokens=5, temperature=1.5), vision=enc.vision)
    assert sampled.completion_ids.shape[0] == 9 and sampled.completion_mask.sum() > 0


def test_image_placeholder_tokens_are_never_sampled():
    model, processor = tiny_vlm("gemma3")
    image_ids = image_token_ids(model)
    assert image_ids == [model.config.image_token_id]
    with torch.no_grad():  # the head now prefers the image token above all
        model.lm_head.weight[image_ids[0]] = 50 * model.lm_head.weight[:10].mean(0).sign()
    model.eval()
    enc = _encoded(processor, g=1)
    backend = TransformersRollout(processor.tokenizer)
    unsuppressed = model.generate(input_ids=enc.prompt_ids, attention_mask=enc.prompt_mask, max_new_tokens=4,
                                  do_sample=False, **enc.vision.model_kwargs(enc.prompt_ids.shape[1]))
    assert (unsuppressed[:, enc.prompt_ids.shape[1]:] == image_ids[0]).any()  # it would be sampled
    for params in (SamplingParams(max_new_tokens=4, do_sample=False), SamplingParams(max_new_tokens=4),
                   SamplingParams(max_new_tokens=4, extra={"suppress_tokens": [7]})):
        gen = backend.generate(model, enc.prompt_ids, enc.prompt_mask, params, vision=enc.vision)
        assert not (gen.completion_ids == image_ids[0]).any()
    config = backend.generation_config(model, SamplingParams(max_new_tokens=4, extra={"suppress_tokens": [7]}))
    assert config.suppress_tokens == sorted({7, *image_ids})


def test_a_model_whose_cache_cannot_be_repeated_prefills_every_row():
    """Qwen3.5's linear-attention layers keep a recurrent state that cannot be repeated for a group: grouped text
    prompts are prefilled row by row, in generation and in the training forward, with the same results."""
    from grpokit.forward.logprobs import completion_logps
    from grpokit.forward.prefix import encode_once_per_group

    model, processor = shared_tiny_vlm("qwen3_5")
    enc = encode_prompts(processor, PROMPTS[1:], None).repeat_interleave(3)
    assert encode_once_per_group(model, enc.prompt_ids, enc.prompt_mask, 3) == (None, None)
    greedy = SamplingParams(max_new_tokens=5, do_sample=False)
    shared = TransformersRollout(processor.tokenizer).generate(model, enc.prompt_ids, enc.prompt_mask, greedy)
    each = TransformersRollout(processor.tokenizer, share_prompt_prefill=False).generate(
        model, enc.prompt_ids, enc.prompt_mask, greedy)
    assert torch.equal(shared.completion_ids, each.completion_ids)
    with torch.no_grad():
        a, _ = completion_logps(model, enc.prompt_ids, enc.prompt_mask, shared.completion_ids, shared.completion_mask)
        b, _ = completion_logps(model, enc.prompt_ids, enc.prompt_mask, shared.completion_ids, shared.completion_mask,
                                share_prompts=False)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
