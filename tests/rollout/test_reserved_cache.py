"""The decode loop's KV cache with room reserved (grpokit/rollout/reserved_cache.py): every operation the loop and
the prefill use gives what transformers' DynamicLayer gives, written in place while there is room, and the loop's
completions do not depend on it."""

from __future__ import annotations

import torch
from tiny import tiny_model, tiny_tokenizer
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpokit.forward.prefix import with_cache
from grpokit.rollout import decode as decode_module
from grpokit.rollout.base import SamplingParams
from grpokit.rollout.decode import decode, token_chooser
from grpokit.rollout.reserved_cache import ReservedLayer, reserve


def _states(b, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, n, 4, generator=g), torch.randn(b, 2, n, 4, generator=g)


def _same(reserved: ReservedLayer, plain: DynamicLayer):
    assert reserved.get_seq_length() == plain.get_seq_length()
    assert reserved.get_mask_sizes(1) == plain.get_mask_sizes(1)
    torch.testing.assert_close(reserved.keys, plain.keys, rtol=0, atol=0)
    torch.testing.assert_close(reserved.values, plain.values, rtol=0, atol=0)


def test_every_operation_equals_the_dynamic_layer_and_writes_in_place_while_there_is_room():
    plain = DynamicLayer()
    plain.update(*_states(3, 5, 0))
    reserved = ReservedLayer(plain.keys, plain.values, capacity=8)
    _same(reserved, plain)
    buffer = reserved._keys.data_ptr()
    for step in range(3):  # within the room: in place, the same buffer
        k, v = _states(3, 1, step + 1)
        got, want = reserved.update(k, v), plain.update(k, v)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        assert reserved._keys.data_ptr() == buffer
    _same(reserved, plain)
    for step in range(4):  # past it: the buffers grow
        k, v = _states(3, 2, step + 10)
        reserved.update(k, v), plain.update(k, v)
    assert reserved.get_seq_length() == 16 and reserved._keys.shape[-2] >= 16
    _same(reserved, plain)
    keep = torch.tensor([0, 2])
    reserved.batch_select_indices(keep), plain.batch_select_indices(keep)
    _same(reserved, plain)
    reserved.batch_repeat_interleave(3), plain.batch_repeat_interleave(3)
    _same(reserved, plain)
    reserved.crop(-4), plain.crop(-4)
    _same(reserved, plain)
    k, v = _states(6, 1, 99)
    reserved.update(k, v), plain.update(k, v)
    _same(reserved, plain)


def test_reserve_swaps_only_prefilled_plain_layers():
    tok = tiny_tokenizer()
    model = tiny_model(tok).eval()
    cache = DynamicCache(config=model.config)
    assert reserve(cache, 4) == 0  # nothing prefilled yet
    with torch.no_grad():
        model(input_ids=torch.randint(10, len(tok), (2, 5)), **with_cache(cache, use_cache=True))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    assert reserve(cache, 4) == len(cache.layers) > 0
    assert all(type(layer) is ReservedLayer for layer in cache.layers)
    for layer, (k, v) in zip(cache.layers, before):
        torch.testing.assert_close(layer.keys, k, rtol=0, atol=0)
        torch.testing.assert_close(layer.values, v, rtol=0, atol=0)
    assert cache.get_seq_length() == 5
    assert reserve(cache, 4) == 0  # already reserved


def test_the_decode_loop_gives_the_same_completions_with_and_without_the_reserved_room(monkeypatch):
    tok = tiny_tokenizer()
    model = tiny_model(tok).eval()
    enc = tok(["a b c d e f", "a b c x", "a b c y z"], return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = enc["input_ids"].repeat_interleave(2, 0), enc["attention_mask"].repeat_interleave(2, 0)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    from grpokit.rollout.transformers_backend import InverseCDFSampler

    def run():
        torch.manual_seed(0)
        choose = token_chooser(params, InverseCDFSampler(1.0))
        return decode(model, ids, mask, max_new_tokens=12, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id,
                      choose=choose, group=2)

    swapped = []
    real = decode_module.reserve
    monkeypatch.setattr(decode_module, "reserve", lambda cache, extra: swapped.append(real(cache, extra)))
    with_room = run()
    monkeypatch.setattr(decode_module, "reserve", lambda cache, extra: 0)
    without = run()
    assert swapped and swapped[0] > 0
    assert torch.equal(with_room, without)
