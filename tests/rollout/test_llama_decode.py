"""The flat Llama decode step (grpokit/rollout/llama_decode.py): the logits of the model's own forward at every step
(padding, grouped-query attention, biases, scaled rotary embeddings, an untied head, packed weights, a merged LoRA
adapter), used by the backend where it applies and nowhere else."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

import grpokit.rollout.decode as decode_module
import grpokit.rollout.llama_decode as llama_decode
from grpokit.rollout.base import SamplingParams
from grpokit.rollout.decode import decode
from grpokit.rollout.llama_decode import llama_stepper
from grpokit.rollout.packed import packable_dtypes, packed_linears
from grpokit.rollout.transformers_backend import TransformersRollout, decoding_weights, lora_merged


def prompts(tok, texts, g=1):
    enc = tok([t for t in texts for _ in range(g)], return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def llama(tok, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
               eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    for p in model.parameters():  # larger weights than the init's: differences would show
        p.data.normal_(0, 0.2)
    return model


def run(model, ids, mask, lean, group=1, steps=6):
    """Greedy completions of the decode loop and the logits (one row per row) it chose from at every step; the end
    of sequence never chosen, so every row runs every step."""
    seen = []
    eos = model.config.eos_token_id

    def choose(seqs, logits, owner):
        seen.append(logits[owner].clone())
        scores = logits.clone()
        scores[:, eos] = float("-inf")
        return scores.argmax(-1)[owner]

    out = decode(model, ids, mask, max_new_tokens=steps, eos_ids=[eos], pad_id=model.config.pad_token_id,
                 choose=choose, group=group, lean=lean)
    return out, seen


def assert_same_steps(model, ids, mask, group=1):
    calls = []
    real = llama_decode.llama_step

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    llama_decode.llama_step = spy
    try:
        lean, lean_logits = run(model, ids, mask, True, group)
    finally:
        llama_decode.llama_step = real
    plain, plain_logits = run(model, ids, mask, False, group)
    assert len(calls) == 6  # every decode step went through it
    assert torch.equal(lean, plain)
    for a, b in zip(lean_logits, plain_logits):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


CONFIGS = [
    {},
    dict(num_key_value_heads=4),
    dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    dict(hidden_act="gelu", rms_norm_eps=1e-3, num_attention_heads=8, num_key_value_heads=1, hidden_size=64),
]


@pytest.mark.parametrize("overrides", CONFIGS)
def test_the_logits_of_every_step_equal_the_models_forward(overrides):
    tok = tiny_tokenizer()
    model = llama(tok, **overrides)
    ids, mask = prompts(tok, ["hello there", "hi", "what is 2 + 2? tell me"])  # left padding of 0 to 5+ tokens
    assert (mask == 0).any()
    assert_same_steps(model, ids, mask)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_with_packed_weights_groups_and_each_attention_implementation(attn):
    tok = tiny_tokenizer()
    model = llama(tok, seed=2, attn_implementation=attn)
    ids, mask = prompts(tok, ["hello there", "what is 2 + 2?"], g=3)
    with packed_linears(model) as packed:
        assert packed == 2 * 7 + 1  # every projection and the head
        assert_same_steps(model, ids, mask, group=3)


def test_a_merged_lora_adapter_is_stepped_with_its_merged_weights_and_an_unmerged_one_is_not():
    from peft import LoraConfig, get_peft_model

    tok = tiny_tokenizer()
    peft = get_peft_model(llama(tok, seed=4), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                         init_lora_weights=False)).eval()
    inner = peft.base_model.model
    ids, mask = prompts(tok, ["hello there", "hi"], g=2)
    assert llama_stepper(inner) is None  # adapters on the side: the model's forward
    with lora_merged(peft) as merged, packed_linears(peft):
        assert merged and llama_stepper(inner) is not None
        assert_same_steps(inner, ids, mask, group=2)
    with decoding_weights(peft, pack=True):  # float32 on a CPU: folded into the packed weights, not merged
        assert not any(getattr(m, "merged", False) for m in peft.modules()) and llama_stepper(inner) is not None
        assert_same_steps(inner, ids, mask, group=2)


def test_it_does_not_apply_where_it_would_skip_something():
    tok = tiny_tokenizer()
    model = llama(tok)
    assert llama_stepper(model) is not None
    model.train()
    assert llama_stepper(model) is None
    model.eval()
    model.model.layers[0].self_attn.train()  # one module in training mode (its attention dropout would apply)
    assert llama_stepper(model) is None
    model.eval()
    handle = model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: out * 2)
    assert llama_stepper(model) is None
    handle.remove()
    handle = model.lm_head.register_forward_pre_hook(lambda m, a: None)
    assert llama_stepper(model) is None
    handle.remove()
    assert llama_stepper(model) is not None

    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    assert llama_stepper(qwen) is None


def test_the_backend_samples_with_it_and_draws_what_the_models_forward_gives(monkeypatch):
    """Through TransformersRollout.generate (what the trainer calls): the sampled completions with the flat step equal
    those with the model's forward for the same seed, and the flat step ran."""
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=5).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    ids, mask = prompts(tok, ["hello there", "what is 2 + 2?"], g=4)
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=20)
    calls = []
    real = llama_decode.llama_step

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(llama_decode, "llama_step", spy)
    torch.manual_seed(0)
    lean = TransformersRollout(tok).generate(model, ids, mask, params)
    assert calls
    monkeypatch.setattr(decode_module, "llama_stepper", lambda model: None)
    torch.manual_seed(0)
    plain = TransformersRollout(tok).generate(model, ids, mask, params)
    assert torch.equal(lean.completion_ids, plain.completion_ids)
    assert lean.completion_mask.sum() > ids.shape[0]


def test_a_layer_with_a_forward_of_its_own_is_not_bypassed():
    """cast_lm_head_to_fp32 gives the head a forward of its own (the input cast to float32); so may a user: the
    model's forward then runs, not the flat step; the backend's packed forward is the one allowed."""
    tok = tiny_tokenizer()
    model = llama(tok, tie_word_embeddings=False)
    head = model.lm_head
    head.forward = lambda x: torch.nn.functional.linear(x.float(), head.weight.float())
    assert llama_stepper(model) is None
    del head.forward
    model.model.layers[0].mlp.forward = lambda x: x
    assert llama_stepper(model) is None
    del model.model.layers[0].mlp.forward
    with packed_linears(model):
        assert llama_stepper(model) is not None


def test_grpo_trainer_with_lora_generates_with_it(tmp_path, monkeypatch):
    """The demo's path: GRPOTrainer with a LoRA adapter on every linear layer (folded into the packed weights for
    generation, never merged into the base weights, which stay bit for bit): its rollouts step through the flat Llama
    step, and a training step moves the adapter."""
    from datasets import Dataset
    from peft import LoraConfig

    from grpokit import GRPOConfig, GRPOTrainer

    calls = []
    real = llama_decode.llama_step
    monkeypatch.setattr(llama_decode, "llama_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    tok = tiny_tokenizer()
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(8)]})
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, max_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                      gradient_checkpointing=False, learning_rate=1e-2, disable_tqdm=True)
    trainer = GRPOTrainer(tiny_model(tok), lambda completions, **kw: [float(len(c[0]["content"])) for c in completions],
                          args=args, train_dataset=data, processing_class=tok,
                          peft_config=LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "base_layer" in n}
    merges = []
    monkeypatch.setattr(trainer.model, "merge_adapter", lambda *a, **k: merges.append(1))
    trainer.train()
    assert calls and merges == []
    moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved
    assert base and all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if "base_layer" in n)


@pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(), reason="oneDNN computes no bf16 here")
def test_a_bf16_model_with_its_lora_adapter_folded_into_packed_weights():
    """The demo's setting on a CPU with bf16 units: a bf16 base, float32 adapters folded into bf16 packed weights
    (nothing merged); the flat step computes what the model's forward computes with them."""
    from peft import LoraConfig, get_peft_model

    tok = tiny_tokenizer()
    peft = get_peft_model(llama(tok, seed=4).to(torch.bfloat16), LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)).eval()
    inner = peft.base_model.model
    ids, mask = prompts(tok, ["hello there", "hi"], g=2)
    with decoding_weights(peft, pack=True):
        assert not any(getattr(m, "merged", False) for m in peft.modules()) and llama_stepper(inner) is not None
        assert_same_steps(inner, ids, mask, group=2)
