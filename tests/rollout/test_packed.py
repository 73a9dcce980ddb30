"""Linear layers computing with oneDNN-packed weights while generating (grpokit/rollout/packed.py)."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from grpokit.rollout.base import SamplingParams
from grpokit.rollout.packed import packable_dtypes, packed_linears, packing_available
from grpokit.rollout.transformers_backend import TransformersRollout

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")


bf16_packing = pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(), reason="oneDNN computes no bf16 here")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), pytest.param(torch.bfloat16, 2e-2, marks=bf16_packing)])
def test_packed_layers_compute_the_same_and_are_given_back(dtype, tol):
    """float32 layers are packed, and bf16 ones where oneDNN computes bf16: the same logits up to rounding."""
    tok = tiny_tokenizer()
    model = tiny_model(tok).to(dtype).eval()
    ids = torch.randint(5, 200, (3, 7))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with packed_linears(model) as n:
            assert n == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
            packed = model(input_ids=ids).logits
            with packed_linears(model) as again:
                assert again == 0  # packed once
    assert packed.dtype == dtype
    torch.testing.assert_close(packed, plain, atol=tol, rtol=tol)
    assert not any("forward" in vars(m) for m in model.modules())  # the layers' own forward again
    model.train()
    with packed_linears(model):  # with gradients the layers compute as usual (generation only)
        model(input_ids=ids).logits.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_bf16_layers_are_not_packed_where_onednn_computes_no_bf16(monkeypatch):
    """A CPU without bf16 units (oneDNN refuses to pack bf16 there: ``_is_mkldnn_bf16_supported`` is False, as with
    ``ONEDNN_MAX_CPU_ISA=AVX2``): bf16 layers are left as they are, float32 ones packed."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    assert packable_dtypes() == (torch.float32,)
    model = tiny_model(tiny_tokenizer()).to(torch.bfloat16)
    model.lm_head.float()
    with packed_linears(model) as n:
        assert n == 1  # the float32 head alone


def test_greedy_generation_packed_or_not():
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=2)
    enc = tok(["hello there", "hi"], return_tensors="pt", padding=True, add_special_tokens=False)
    params = SamplingParams(max_new_tokens=8, do_sample=False)
    packed = TransformersRollout(tok).generate(model, enc["input_ids"], enc["attention_mask"], params)
    plain = TransformersRollout(tok, pack_weights=False).generate(model, enc["input_ids"], enc["attention_mask"],
                                                                  params)
    assert torch.equal(packed.completion_ids, plain.completion_ids)


def _lora(model, **kw):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                                            **kw))


def test_lora_adapters_are_folded_into_the_packed_weights_without_writing_the_base():
    """Every LoRA layer computes with W + s·B·A packed (the same logits as the adapter beside the base), the base
    weights are not written and nothing is merged; nested blocks pack nothing more; with gradients, or in training
    mode (LoRA's dropout), a layer runs its own forward; everything is given back."""
    from grpokit.rollout.packed import foldable_lora, packed_weight

    tok = tiny_tokenizer()
    model = _lora(tiny_model(tok, seed=3)).eval()
    lora = foldable_lora(model)
    plain_layers = [m for m in model.modules() if type(m) is torch.nn.Linear and not any(m is x.base_layer for x in lora)
                    and not any(m in (*x.lora_A.values(), *x.lora_B.values()) for x in lora)]
    assert len(lora) == 7 * 2 and len(plain_layers) == 1  # every projection of both layers; the head
    base = {k: v.clone() for k, v in model.state_dict().items() if "base_layer" in k}
    pointers = {k: v.data_ptr() for k, v in model.state_dict().items() if "base_layer" in k}
    model.merge_adapter = lambda *a, **k: pytest.fail("merged")
    ids = torch.randint(5, 200, (3, 7))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with packed_linears(model) as n:
            assert n == len(lora) + 1
            assert all(packed_weight(m) is not None and packed_weight(m.base_layer) is None for m in lora)
            got = model(input_ids=ids).logits
            with packed_linears(model) as again:
                assert again == 0
            adapter_calls = []
            lora[0].lora_A["default"].register_forward_hook(lambda *a: adapter_calls.append(1))
            model(input_ids=ids)
            assert adapter_calls == []  # folded: the adapter's own matrices are not called
            model.train()
            noisy = model(input_ids=ids).logits  # training mode: each LoRA layer's own forward, its dropout
            assert adapter_calls == [1]
            model.eval()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(noisy, want, atol=1e-5, rtol=1e-5)  # (the dropout is 0 here: the same numbers)
    assert not any("forward" in vars(m) or packed_weight(m) is not None for m in model.modules())
    for k, v in model.state_dict().items():
        if "base_layer" in k:
            assert torch.equal(v, base[k]) and v.data_ptr() == pointers[k], k


def test_lora_is_folded_for_all_layers_or_none():
    """One layer that cannot be folded (a second active adapter, DoRA, merged, an fp16 base) and no layer is: the
    adapters are then merged before packing (decoding_weights), as before."""
    from grpokit.rollout.packed import foldable_lora
    from grpokit.rollout.transformers_backend import decoding_weights

    tok = tiny_tokenizer()
    assert len(foldable_lora(_lora(tiny_model(tok)))) == 14
    assert foldable_lora(_lora(tiny_model(tok), use_dora=True)) == []
    model = _lora(tiny_model(tok))
    model.base_model.model.model.layers[1].mlp.down_proj.base_layer.to(torch.float16)
    assert foldable_lora(model) == []
    model = _lora(tiny_model(tok)).eval()
    model.base_model.model.model.layers[0].self_attn.q_proj.merge()
    assert foldable_lora(model) == []
    model.base_model.model.model.layers[0].self_attn.q_proj.unmerge()
    assert len(foldable_lora(model)) == 14
    ids = torch.randint(5, 200, (2, 5))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with decoding_weights(model, pack=True):
            folded = model(input_ids=ids).logits
            assert not any(getattr(m, "merged", False) for m in model.modules())
        own = model.base_model.model.model.layers[1].mlp.up_proj.base_layer  # a forward of its own: not packable,
        own.forward = lambda x: torch.nn.functional.linear(x, own.weight, own.bias)  # so every adapter is merged
        with decoding_weights(model, pack=True):
            assert all(m.merged for m in model.modules() if hasattr(m, "merged_adapters"))
            merged = model(input_ids=ids).logits
        assert not any(getattr(m, "merged", False) for m in model.modules())
    torch.testing.assert_close(folded, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged, want, atol=1e-5, rtol=1e-5)


@bf16_packing
def test_a_bf16_base_is_folded_rounded_once_and_left_bit_for_bit():
    """A bf16 base with float32 adapters (PEFT's default): each LoRA layer computes with ``W + s·B·A`` summed in
    float32 and rounded once to bf16, the base weights are neither written nor merged into (they were merged and
    restored from a copy before), and the logits are those of the adapter beside the base within bf16 rounding."""
    from grpokit.rollout.packed import foldable_lora, folded_weight, packed_linear, packed_weight
    from grpokit.rollout.transformers_backend import decoding_weights

    tok = tiny_tokenizer()
    model = _lora(tiny_model(tok, seed=3).to(torch.bfloat16)).eval()
    lora = foldable_lora(model)
    assert len(lora) == 14 and all(m.lora_A["default"].weight.dtype == torch.float32 for m in lora)
    base = {k: v.clone() for k, v in model.state_dict().items() if "base_layer" in k}
    pointers = {k: v.data_ptr() for k, v in model.state_dict().items() if "base_layer" in k}
    model.merge_adapter = lambda *a, **k: pytest.fail("merged")
    ids = torch.randint(5, 200, (3, 7))
    x = torch.randn(5, 32).to(torch.bfloat16)
    with torch.no_grad():
        beside = model(input_ids=ids).logits
        with decoding_weights(model, pack=True):
            folded = model(input_ids=ids).logits
            layer = lora[3]
            w = layer.base_layer.weight.float() + layer.scaling["default"] * (
                layer.lora_B["default"].weight @ layer.lora_A["default"].weight)
            assert torch.equal(folded_weight(layer), w.to(torch.bfloat16))  # rounded once
            assert not torch.equal(folded_weight(layer), layer.base_layer.weight + (w - layer.base_layer.weight.float())
                                   .to(torch.bfloat16))  # (rounding twice, as a bf16 merge does, differs here)
            once = torch.nn.functional.linear(x, folded_weight(layer))
            got = packed_linear(x, packed_weight(layer), None)
    assert folded.dtype == torch.bfloat16
    torch.testing.assert_close(got, once, atol=2e-2, rtol=1e-2)  # (one bf16 step of the output: summation order)
    torch.testing.assert_close(folded.float(), beside.float(), atol=5e-2, rtol=5e-2)
    for k, v in model.state_dict().items():
        if "base_layer" in k:
            assert torch.equal(v, base[k]) and v.data_ptr() == pointers[k], k
