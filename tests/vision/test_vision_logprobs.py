"""A VLM completion's log-probs through grpokit's forwards (the chunked head, the group-shared prompt, the plain
path, micro-batches) against a plain forward of each row alone with its images."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from tiny_vlm import FAMILIES, shared_tiny_vlm, tiny_vlm

from grpokit.forward.logprobs import completion_logps, lean_head
from grpokit.vision.encoding import encode_prompts

RED, BLUE = Image.new("RGB", (40, 30), "red"), Image.new("RGB", (50, 70), "blue")
PROMPTS = [[{"role": "user", "content": "What is this?"}], [{"role": "user", "content": "And these two, longer?"}],
           [{"role": "user", "content": "No image here."}]]


def _batch(processor, vocab, images=((RED,), (BLUE, RED), None), g=2, c=5, seed=0):
    enc = encode_prompts(processor, PROMPTS[:len(images)], [list(i) if i else None for i in images]).repeat_interleave(g)
    gen = torch.Generator().manual_seed(seed)
    completion = torch.randint(10, vocab, (enc.prompt_ids.shape[0], c), generator=gen)
    mask = torch.ones_like(completion)
    mask[1, 3:] = 0
    mask[-2, 1:] = 0
    return enc, completion, mask


def _reference(model, enc, completion, mask):
    """log softmax of the model's logits, each row alone (no padding) with its images; and the entropies."""
    c = completion.shape[1]
    lps, ents = [], []
    for i in range(completion.shape[0]):
        keep = enc.prompt_mask[i].bool()
        ids = torch.cat([enc.prompt_ids[i][keep], completion[i]])[None]
        extra = enc.vision.select([i]).model_kwargs(int(keep.sum()), c)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0, -c - 1:-1].float()
        logp = torch.log_softmax(logits, -1)
        lps.append(logp.gather(-1, completion[i][:, None])[:, 0])
        ents.append(-(logp.exp() * logp).sum(-1))
    return torch.stack(lps) * mask, torch.stack(ents) * mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logps_equal_a_plain_forward_with_the_images(family):
    model, processor = shared_tiny_vlm(family)
    assert lean_head(model) is model.lm_head  # the head on the outer model is found: the lean path runs
    enc, completion, mask = _batch(processor, model.config.get_text_config().vocab_size)
    with torch.no_grad():
        ref_lp, ref_ent = _reference(model, enc, completion, mask)
        for kwargs in ({}, {"share_prompts": False}, {"lean": False}, {"batch_size": 3}):
            lp, ent = completion_logps(model, enc.prompt_ids, enc.prompt_mask, completion, mask, vision=enc.vision,
                                       **kwargs)
            torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-5, msg=str(kwargs))
            torch.testing.assert_close(ent, ref_ent, rtol=0, atol=2e-5, msg=str(kwargs))
        # without its images the same rows score differently: the images reach the forward
        blind, _ = completion_logps(model, enc.prompt_ids, enc.prompt_mask, completion, mask)
        assert (blind - ref_lp)[:4].abs().max() > 1e-4


@pytest.mark.parametrize("family", ["qwen2_5_vl", "idefics3", "gemma3", "llava_next"])
def test_shared_prompts_equal_encoding_every_row_with_images(family):
    model, processor = tiny_vlm(family)
    model = model.double().eval()
    enc, completion, mask = _batch(processor, model.config.get_text_config().vocab_size, images=((RED,), (BLUE, RED)),
                                   g=3, c=4)
    vision = enc.vision.to(dtype=torch.float64)
    calls = []
    model.get_decoder().register_forward_pre_hook(
        lambda m, a, k: calls.append(tuple(k["inputs_embeds"].shape[:2])), with_kwargs=True)
    out = {}
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        calls.clear()
        lp, ent = completion_logps(model, enc.prompt_ids, enc.prompt_mask, completion, mask, vision=vision,
                                   share_prompts=share, entropy_grad=True)
        w = torch.linspace(-1, 1, lp.numel(), dtype=torch.float64).reshape(lp.shape)
        ((lp * w).sum() + (ent * w.flip(-1)).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[share] = (lp.detach(), ent.detach(), grads, list(calls))
    (lp, ent, grads, fw), (lp_ref, ent_ref, grads_ref, fw_ref) = out[True], out[False]
    p, c = enc.prompt_ids.shape[1], completion.shape[1]
    assert fw == [(2, p), (6, c)] and fw_ref == [(6, p + c)]  # each prompt (and its images) once, then completions
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-9)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-9)
    assert grads.keys() == grads_ref.keys()
    assert any("vision" in n or "visual" in n for n in grads)  # the vision tower is in the graph
    for name in grads_ref:  # norms compute in float32: equal up to its rounding
        scale = grads_ref[name].abs().max().item() + 1e-12
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=0, atol=1e-5 * max(scale, 1.0), msg=name)


@pytest.mark.parametrize("order, forwards", [([0, 2, 1, 3], [4]), ([0, 1, 2, 3], [2, 4])])
def test_the_same_text_with_another_picture_is_another_prompt(order, forwards):
    """Four rows ask the same question: about red, red, blue, blue (groups of 2 share their prompt and picture), or
    about red, blue, red, blue (nothing to share)."""
    model, processor = shared_tiny_vlm("gemma3")
    enc = encode_prompts(processor, [PROMPTS[0]] * 4, [[RED], [RED], [BLUE], [BLUE]]).select(order)
    assert torch.equal(enc.prompt_ids[0], enc.prompt_ids[3])  # the ids alone cannot tell the rows apart
    completion = torch.randint(10, 100, (4, 3), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(completion)
    seen = []
    handle = model.get_decoder().register_forward_pre_hook(lambda m, a, k: seen.append(k["inputs_embeds"].shape[0]),
                                                          with_kwargs=True)
    try:
        with torch.no_grad():
            lp, _ = completion_logps(model, enc.prompt_ids, enc.prompt_mask, completion, mask, vision=enc.vision)
    finally:
        handle.remove()
    with torch.no_grad():
        ref, _ = _reference(model, enc, completion, mask)
    assert seen == forwards
    torch.testing.assert_close(lp, ref, rtol=0, atol=2e-5)


def test_a_lora_wrapped_vlm_takes_the_lean_path():
    peft = pytest.importorskip("peft")
    from grpokit.vision.adapters import lora_settings

    model, processor = tiny_vlm("qwen2_vl")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, init_lora_weights=False, **lora_settings(model))).eval()
    assert lean_head(model) is not None
    enc, completion, mask = _batch(processor, model.config.get_text_config().vocab_size)
    with torch.no_grad():
        lean, _ = completion_logps(model, enc.prompt_ids, enc.prompt_mask, completion, mask, vision=enc.vision)
        plain, _ = completion_logps(model, enc.prompt_ids, enc.prompt_mask, completion, mask, vision=enc.vision,
                                    lean=False)
        ref, _ = _reference(model, enc, completion, mask)
    torch.testing.assert_close(lean, ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(plain, ref, rtol=0, atol=2e-5)
