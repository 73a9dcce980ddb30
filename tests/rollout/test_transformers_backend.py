"""The transformers rollout backend: a shared prompt is prefilled once per group and its KV cache repeated,
with the same completions as prefilling every row."""

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from grpokit.forward.prefix import cache_argument, group_size, inner_causal_lm
from grpokit.rollout.base import SamplingParams
from grpokit.rollout.transformers_backend import TransformersRollout, contiguous_head_input


def _prompts(tok, texts, g):
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc.input_ids.repeat_interleave(g, 0), enc.attention_mask.repeat_interleave(g, 0)


def test_group_size_detects_whole_groups_only():
    tok = tiny_tokenizer()
    ids, mask = _prompts(tok, ["hello there", "hi", "hey you"], 4)
    assert group_size(ids, mask) == 4
    assert group_size(ids[:6], mask[:6]) == 1  # a partial group
    assert group_size(ids[::4], mask[::4]) == 1  # all distinct
    same, same_mask = _prompts(tok, ["abc"], 5)
    assert group_size(same, same_mask) == 5
    ids2 = ids.clone()
    ids2[5, -1] = 7  # one row of the second group differs
    assert group_size(ids2, mask) == 1


def _lora(model, dtype=torch.float32):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model.to(dtype), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                      init_lora_weights=False))


@pytest.mark.parametrize("g,lora", [(1, False), (3, False), (3, True)])
def test_shared_prefill_gives_the_same_completions(g, lora):
    """Also for a PEFT model (the LoRA demo): the prompt is encoded once through the LoRA-wrapped inner model."""
    tok = tiny_tokenizer()
    model = _lora(tiny_model(tok)) if lora else tiny_model(tok)
    ids, mask = _prompts(tok, ["hello there", "hi", "what is 2 + 2?"], g)
    params = SamplingParams(max_new_tokens=12, temperature=0.9, extra={"min_new_tokens": 4})
    outs, prefilled = [], []
    hook = inner_causal_lm(model).model.register_forward_pre_hook(
        lambda m, a, k: prefilled.append(k["input_ids"].numel()) if len(prefilled) < 2 else None, with_kwargs=True)
    for share in (False, True):
        torch.manual_seed(0)
        model.train()
        prefilled.clear()
        out = TransformersRollout(tok, share_prompt_prefill=share).generate(model, ids, mask, params)
        assert model.training  # the mode is restored
        outs.append((out, sum(prefilled)))
    hook.remove()
    (plain, plain_tokens), (shared, shared_tokens) = outs
    assert torch.equal(plain.completion_ids, shared.completion_ids)
    assert torch.equal(plain.completion_mask, shared.completion_mask)
    # tokens of the first two forwards (the decode loop, grpokit/rollout/decode.py): the prefill of every prompt row
    # but its last token, then that token of every row; shared: each distinct prompt once, and its last token once
    n, length = ids.shape
    assert plain_tokens == n * (length - 1) + n
    assert shared_tokens == (plain_tokens if g == 1 else (n // g) * length)


def test_shared_prefill_with_max_batch_size_and_static_cache_fallback():
    tok = tiny_tokenizer()
    model = tiny_model(tok)
    ids, mask = _prompts(tok, ["hello there", "hi"], 4)
    params = SamplingParams(max_new_tokens=6, do_sample=False)
    base = TransformersRollout(tok, share_prompt_prefill=False).generate(model, ids, mask, params)
    chunked = TransformersRollout(tok, max_batch_size=4).generate(model, ids, mask, params)
    assert torch.equal(base.completion_ids, chunked.completion_ids)
    static = SamplingParams(max_new_tokens=6, do_sample=False, extra={"cache_implementation": "static"})
    out = TransformersRollout(tok).generate(model, ids, mask, static)  # not shared: generate owns its cache
    assert torch.equal(base.completion_ids, out.completion_ids)


@pytest.mark.parametrize("lockstep", [False, True])
def test_lockstep_generates_with_synced_gpus_and_no_shared_prefill(lockstep):
    """Under sharded weights that were not gathered every rank must run the same forwards: generate gets
    synced_gpus=True and no per-rank prefill shortcut (grpokit/forward/sharding.py)."""
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=1)
    seen = []
    original = model.generate

    def spy(**kwargs):
        seen.append(kwargs)
        return original(**{k: v for k, v in kwargs.items() if k != "synced_gpus"})  # needs a process group

    model.generate = spy
    ids = torch.tensor([[5, 6, 7]] * 4)
    TransformersRollout(tok, decode_loop=False).generate(model, ids, torch.ones_like(ids),  # generate's arguments
                                                         SamplingParams(max_new_tokens=3, lockstep=lockstep))
    assert seen[0]["synced_gpus"] is lockstep
    assert (cache_argument() in seen[0]) is (not lockstep)  # the 4 rows are one group: shared prefill unless lockstep


@pytest.mark.parametrize("top_k, most", [(0, None), (5, 5)])
def test_top_k_zero_samples_the_whole_vocabulary(top_k, most):
    """top_k=0 means no top-k filter (TRL's default); transformers would fill an unset top_k with 50."""
    tok = tiny_tokenizer()
    model = tiny_model(tok)
    ids, mask = _prompts(tok, ["hi"], 256)
    params = SamplingParams(max_new_tokens=1, temperature=1000.0, top_k=top_k, extra={"min_new_tokens": 1})
    torch.manual_seed(0)
    out = TransformersRollout(tok).generate(model, ids, mask, params)
    distinct = out.completion_ids[:, 0].unique().numel()
    if most is None:
        assert distinct > 100  # near-uniform over 260 tokens: ~160 distinct in 256 draws; top-k 50 caps it at 50
    else:
        assert distinct <= most


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_generation_leaves_the_lora_base_weights_as_they_were(dtype):
    """LoRA is merged for generation and the base given back: bf16/fp16 (on a CPU) from a copy, bit for bit —
    unmerging alone would round them twice and they would drift, generation after generation (the check below would
    see ~0.005 after five). float32 on a CPU with oneDNN, and bf16 where oneDNN computes bf16, is not merged at all:
    each layer computes with its adapter folded into its packed weight, and the base is never written (without
    oneDNN: merged, then unmerged to ~1e-8)."""
    from grpokit.rollout.packed import packable_dtypes, packed_weight

    tok = tiny_tokenizer()
    model = _lora(tiny_model(tok), dtype)
    base = {k: v.clone() for k, v in model.state_dict().items() if "base_layer" in k}
    seen = []
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    hook = layer.register_forward_pre_hook(lambda m, a: seen.append((m.merged, packed_weight(m) is not None)))
    ids, mask = _prompts(tok, ["hello"], 2)
    for _ in range(5):
        TransformersRollout(tok).generate(model, ids, mask, SamplingParams(max_new_tokens=2))
    hook.remove()
    folded = dtype in packable_dtypes()
    assert seen and all(s == ((False, True) if folded else (True, False)) for s in seen)
    assert not layer.merged and packed_weight(layer) is None and "forward" not in vars(layer)
    drift = max((model.state_dict()[k].float() - v.float()).abs().max().item() for k, v in base.items())
    assert drift == 0 if dtype != torch.float32 or folded else drift < 1e-6


def test_lora_merged_gives_back_a_mixed_precision_base():
    """Some LoRA-wrapped weights in float32 among bf16 ones (as models that keep modules in float32 have): the bf16
    ones come back from the copy, the float32 ones by unmerging, and PEFT's merge record is cleared either way."""
    from grpokit.rollout.transformers_backend import lora_merged

    tok = tiny_tokenizer()
    model = _lora(tiny_model(tok), torch.bfloat16)
    kept = model.base_model.model.model.layers[0].self_attn.q_proj
    kept.base_layer.float()
    base = {k: v.clone() for k, v in model.state_dict().items() if "base_layer" in k}
    with lora_merged(model) as merged:
        assert merged and kept.merged
        with lora_merged(model) as again:
            assert not again  # already merged (by the user, or an outer merge): left as it is
        assert not torch.equal(kept.base_layer.weight, base["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])
    assert not any(getattr(m, "merged", False) for m in model.modules())
    for k, v in base.items():
        now = model.state_dict()[k]
        if v.dtype == torch.float32:
            torch.testing.assert_close(now, v, atol=1e-6, rtol=0)
        else:
            assert torch.equal(now, v), k


def test_bf16_lora_generation_merged_matches_the_adapter_on_the_side(monkeypatch):
    """The bf16 model with its adapter merged (or, where oneDNN computes bf16, folded into packed weights) samples what
    the model with the adapter on the side does (greedy, same tokens on a tiny model)."""
    import contextlib

    from grpokit.rollout import transformers_backend

    tok = tiny_tokenizer()
    model = _lora(tiny_model(tok), torch.bfloat16)
    ids, mask = _prompts(tok, ["hello there", "what is 2 + 2?"], 2)
    params = SamplingParams(max_new_tokens=8, do_sample=False)
    merged = TransformersRollout(tok).generate(model, ids, mask, params)
    monkeypatch.setattr(transformers_backend, "lora_merged", lambda m: contextlib.nullcontext(False))
    side = TransformersRollout(tok, pack_weights=False).generate(model, ids, mask, params)
    assert torch.equal(merged.completion_ids, side.completion_ids)


def test_the_lm_head_gets_a_contiguous_input_while_generating():
    """transformers slices the prefill's last position, a strided view, for the head; on a CPU a strided input
    makes torch copy the head's weight once per row. Without the hook the head sees that view (so the check can
    fail); with it, only contiguous inputs."""
    tok = tiny_tokenizer()
    model = tiny_model(tok)
    ids, mask = _prompts(tok, ["hello there", "what is 2 + 2?"], 1)
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(a[0].is_contiguous()))
    try:
        model(input_ids=ids, attention_mask=mask, logits_to_keep=1)
        assert seen == [False]  # what transformers hands the head
        seen.clear()
        with contiguous_head_input(model):
            model(input_ids=ids, attention_mask=mask, logits_to_keep=1)
        assert seen == [True]
        seen.clear()
        TransformersRollout(tok, share_prompt_prefill=False).generate(
            model, ids, mask, SamplingParams(max_new_tokens=3, do_sample=False, extra={"min_new_tokens": 3}))
        assert len(seen) == 4 and all(seen)  # the decode loop's prefill, then 3 steps
    finally:
        hook.remove()
    assert not model.get_output_embeddings()._forward_pre_hooks  # removed after generation


@pytest.mark.parametrize("kwargs", [dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=1.0, top_p=0.6),
                                    dict(temperature=0.9, min_p=0.05)])
def test_inverse_cdf_sampler_draws_transformers_distribution(kwargs):
    """The CPU sampler draws from the distribution transformers' own warpers define: empirical frequencies over
    40 000 draws within 0.02 total variation of the exact softmax, and no token outside the kept set."""
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from grpokit.rollout.transformers_backend import InverseCDFSampler

    torch.manual_seed(0)
    scores = torch.randn(1, 40) * 2
    rows = scores.expand(40_000, -1).contiguous()
    ids = torch.zeros(40_000, 1, dtype=torch.long)
    out = InverseCDFSampler(**kwargs)(ids, rows)
    assert torch.isfinite(out).sum(1).eq(1).all()  # one finite score per row: greedy picks the drawn token
    drawn = out.argmax(1)
    ref = LogitsProcessorList([TemperatureLogitsWarper(kwargs["temperature"])])
    if kwargs.get("top_k"):
        ref.append(TopKLogitsWarper(kwargs["top_k"]))
    if kwargs.get("top_p"):
        ref.append(TopPLogitsWarper(kwargs["top_p"]))
    if kwargs.get("min_p"):
        ref.append(MinPLogitsWarper(kwargs["min_p"]))
    exact = torch.softmax(ref(ids[:1], scores.clone()), -1)[0]
    freq = torch.bincount(drawn, minlength=40).double() / len(drawn)
    assert (freq[exact == 0] == 0).all()
    assert 0.5 * (freq - exact.double()).abs().sum() < 0.02


def test_cpu_sampling_uses_the_fast_sampler_unless_an_extra_needs_generate():
    from grpokit.rollout.transformers_backend import fast_sampler

    cpu = torch.device("cpu")
    assert fast_sampler(SamplingParams(max_new_tokens=4, extra={"min_new_tokens": 2}), cpu) is not None
    assert fast_sampler(SamplingParams(max_new_tokens=4, extra={"typical_p": 0.9}), cpu) is None
    assert fast_sampler(SamplingParams(max_new_tokens=4, do_sample=False), cpu) is None
    assert fast_sampler(SamplingParams(max_new_tokens=4), torch.device("meta")) is None


@pytest.mark.parametrize("share", [False, True])
def test_the_prefix_all_prompts_begin_with_is_shared_only_when_prompts_are(share):
    """``share_prompt_prefill`` governs every sharing of the decode loop: on, a system turn all prompts begin
    with is encoded once for the call and a group's rows run as one while they agree; off, every row is run whole.
    The completions are the same either way."""
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=4)
    ids, mask = _prompts(tok, ["you are a careful assistant. " + q for q in ["hello there", "hi", "what is 2 + 2?"]],
                         2)
    forwards = []
    hook = model.model.register_forward_pre_hook(lambda m, a, k: forwards.append(tuple(k["input_ids"].shape)),
                                                 with_kwargs=True)
    out = TransformersRollout(tok, share_prompt_prefill=share).generate(
        model, ids, mask, SamplingParams(max_new_tokens=4, do_sample=False, extra={"min_new_tokens": 4}))
    hook.remove()
    n, length = ids.shape
    if share:
        prefix = forwards[0][1]
        assert forwards[0][0] == 1 and prefix >= 20  # the system turn, once
        assert forwards[1] == (n // 2, length - 1 - prefix)  # each distinct prompt's rest, once
    else:
        assert forwards[0] == (n, length - 1)  # every row whole
    # greedy: a group's two rows draw the same tokens, so shared they stay one state, one row of every decode forward
    assert all(f == (n // 2 if share else n, 1) for f in forwards[-4:])
    other = TransformersRollout(tok, share_prompt_prefill=not share).generate(
        model, ids, mask, SamplingParams(max_new_tokens=4, do_sample=False, extra={"min_new_tokens": 4}))
    assert torch.equal(out.completion_ids, other.completion_ids)
