"""Linear layers computing with oneDNN-packed weights while generating (grpokit/rollout/packed.py)."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from grpokit.rollout.base import SamplingParams
from grpokit.rollout.packed import packed_linears, packing_available
from grpokit.rollout.transformers_backend import TransformersRollout

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")


def test_packed_layers_compute_the_same_and_are_given_back():
    tok = tiny_tokenizer()
    model = tiny_model(tok).eval()
    ids = torch.randint(5, 200, (3, 7))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with packed_linears(model) as n:
            assert n == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
            packed = model(input_ids=ids).logits
            with packed_linears(model) as again:
                assert again == 0  # packed once
    torch.testing.assert_close(packed, plain, atol=1e-4, rtol=1e-4)
    assert not any("forward" in vars(m) for m in model.modules())  # the layers' own forward again
    model.train()
    with packed_linears(model):  # with gradients the layers compute as usual (generation only)
        model(input_ids=ids).logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_bf16_layers_are_not_packed():
    model = tiny_model(tiny_tokenizer()).to(torch.bfloat16)
    with packed_linears(model) as n:
        assert n == 0


def test_greedy_generation_packed_or_not():
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=2)
    enc = tok(["hello there", "hi"], return_tensors="pt", padding=True, add_special_tokens=False)
    params = SamplingParams(max_new_tokens=8, do_sample=False)
    packed = TransformersRollout(tok).generate(model, enc["input_ids"], enc["attention_mask"], params)
    plain = TransformersRollout(tok, pack_weights=False).generate(model, enc["input_ids"], enc["attention_mask"],
                                                                  params)
    assert torch.equal(packed.completion_ids, plain.completion_ids)
