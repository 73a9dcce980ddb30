"""GRPOTrainer end to end on tiny random models (no download)."""

import asyncio
import math

import pytest
import torch
from conftest import FixedRollout
from datasets import Dataset
from runs import chat_dataset, first_loss_inputs, make_args, text_dataset, train_logs, varied_reward
from tiny import tiny_model, tiny_tokenizer

from grpokit.algorithms import LOSS_TYPES
from grpokit.trainer import GRPOTrainer

LEVELS = ("token", "sequence", "sequence_token")


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_and_level_trains_every_parameter(tmp_path, loss_type, level):
    tok = tiny_tokenizer()
    model = tiny_model(tok)
    before = params_of(model)
    args = make_args(tmp_path, loss_type=loss_type, importance_sampling_level=level)
    trainer = GRPOTrainer(model, varied_reward, args=args, train_dataset=chat_dataset(), processing_class=tok)
    trainer.train()
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == []
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert all("completions/mean_length" in h and "entropy" in h for h in logs)


def _train_fixed(tmp_path, tag, loss_type, per_device, ga, steps=1):
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=1)
    args = make_args(tmp_path / tag, loss_type=loss_type, per_device_train_batch_size=per_device,
                     gradient_accumulation_steps=ga, max_steps=steps, optim="sgd", learning_rate=0.5,
                     shuffle_dataset=False, max_grad_norm=0.0)
    trainer = GRPOTrainer(model, varied_reward, args=args, train_dataset=chat_dataset(), processing_class=tok,
                          rollout_backend=FixedRollout(tok, seed=3))
    trainer.train()
    return params_of(model)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "vespo", "dr_grpo", "cispo", "gmpo", "sapo", "luspo"])
def test_gradient_accumulation_equals_one_big_batch(tmp_path, loss_type):
    one = _train_fixed(tmp_path, "one", loss_type, per_device=8, ga=1)
    two = _train_fixed(tmp_path, "two", loss_type, per_device=4, ga=2)
    base = params_of(tiny_model(tiny_tokenizer(), seed=1))
    moved = max((one[n] - base[n]).abs().max().item() for n in one)
    assert moved > 1e-4  # the step did something
    for n in one:
        torch.testing.assert_close(one[n], two[n], rtol=1e-5, atol=1e-6)


def test_plain_text_prompts_and_extra_columns(tmp_path):
    seen = {}

    def uses_answer(prompts, completions, answer, trainer_state, completion_ids, **kw):
        seen["answer"] = list(answer)
        seen["prompt_type"] = type(prompts[0])
        seen["step"] = trainer_state.global_step
        assert len(completion_ids) == len(completions)
        return [float(len(c) % 3) for c in completions]

    tok = tiny_tokenizer()
    trainer = GRPOTrainer(tiny_model(tok), uses_answer, args=make_args(tmp_path, max_steps=1),
                          train_dataset=text_dataset(), processing_class=tok)
    trainer.train()
    assert seen["prompt_type"] is str
    assert len(seen["answer"]) == 4 and len(set(seen["answer"])) == 1  # one prompt, repeated G times


def test_async_and_none_rewards(tmp_path):
    async def slow_reward(completions, **kw):
        await asyncio.sleep(0.01)
        return [1.0 if i % 2 else 0.0 for i in range(len(completions))]

    def sometimes_none(completions, **kw):
        return [None if i % 2 else 0.5 for i in range(len(completions))]

    tok = tiny_tokenizer()
    args = make_args(tmp_path, max_steps=1)
    trainer = GRPOTrainer(tiny_model(tok), [slow_reward, sometimes_none], args=args,
                          train_dataset=chat_dataset(), processing_class=tok)
    trainer.train()
    log = [h for h in trainer.state.log_history if "reward" in h][0]
    assert log["rewards/slow_reward/mean"] == pytest.approx(0.5)
    assert log["rewards/sometimes_none/mean"] == pytest.approx(0.5)  # None rows are skipped, not zeros
    assert log["reward"] == pytest.approx((0.5 + 1 + 0.5 + 1) / 4)


@pytest.mark.parametrize("peft", [False, True])
def test_beta_with_reference_model(tmp_path, peft):
    tok = tiny_tokenizer()
    model = tiny_model(tok)
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    args = make_args(tmp_path, beta=0.1, max_steps=2, num_iterations=2)
    trainer = GRPOTrainer(model, varied_reward, args=args, train_dataset=chat_dataset(), processing_class=tok,
                          peft_config=peft_config)
    if peft:
        assert trainer.ref_model is None
    else:
        assert trainer.ref_model is not None
    trainer.train()
    logs = [h for h in trainer.state.log_history if "kl" in h]
    assert len(logs) == 2
    assert logs[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # first step: policy == reference
    assert logs[1]["kl"] > 0  # after an update the policy has moved away from the reference
    if peft:
        lora = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        assert lora and all("lora_" in n for n in lora)


def test_num_iterations_reuses_rollouts_with_old_logps(tmp_path):
    tok = tiny_tokenizer()
    rollout = FixedRollout(tok, seed=0)
    calls = {"n": 0}
    original = rollout.generate

    def counting(*a, **k):
        calls["n"] += 1
        return original(*a, **k)

    rollout.generate = counting
    args = make_args(tmp_path, num_iterations=2, max_steps=4, loss_type="grpo", epsilon=0.01, learning_rate=5e-2)
    trainer = GRPOTrainer(tiny_model(tok), varied_reward, args=args, train_dataset=chat_dataset(),
                          processing_class=tok, rollout_backend=rollout)
    trainer.train()
    assert calls["n"] == 2  # 4 optimizer steps, each generation batch used twice
    logs = [h for h in trainer.state.log_history if "clip_ratio/region_mean" in h]
    assert logs[0]["clip_ratio/region_mean"] == 0.0  # first pass is on-policy
    assert logs[1]["clip_ratio/region_mean"] > 0.0  # second pass sees the updated policy


def test_all_truncated_and_masked_leaves_parameters_unchanged(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_model(tok)
    before = params_of(model)
    args = make_args(tmp_path, mask_truncated_completions=True, max_steps=2)
    trainer = GRPOTrainer(model, varied_reward, args=args, train_dataset=chat_dataset(), processing_class=tok,
                          rollout_backend=FixedRollout(tok, eos_prob=0.0))
    trainer.train()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    logs = [h for h in trainer.state.log_history if "completions/clipped_ratio" in h]
    assert all(h["completions/clipped_ratio"] == 1.0 and math.isfinite(h["loss"]) for h in logs)


def test_gradient_checkpointing_and_8bit_adam(tmp_path):
    pytest.importorskip("bitsandbytes")
    tok = tiny_tokenizer()
    model = tiny_model(tok)
    before = params_of(model)
    args = make_args(tmp_path, gradient_checkpointing=True, optim="adamw_8bit", max_steps=1)
    GRPOTrainer(model, varied_reward, args=args, train_dataset=chat_dataset(), processing_class=tok).train()
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_reward_model_as_reward_function(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(cfg)
    args = make_args(tmp_path, max_steps=1)
    trainer = GRPOTrainer(tiny_model(tok), [rm, varied_reward], args=args, train_dataset=chat_dataset(),
                          processing_class=tok, reward_processing_classes=[tok, None])
    trainer.train()
    log = [h for h in trainer.state.log_history if "reward" in h][0]
    rm_keys = [k for k in log if k.startswith("rewards/") and "varied_reward" not in k]
    assert rm_keys and all(math.isfinite(log[k]) for k in rm_keys)


def test_sampler_logps_apply_the_mismatch_correction(tmp_path):
    """A backend that returns sampler log-probs (as vLLM does) gets the ratio ρ in the loss: on-policy from the loss's
    own forward (no old log-probs' forward), reusing batches (``num_iterations=2``) from the old log-probs."""
    for reuse in (1, 2):
        tok = tiny_tokenizer()
        rollout = FixedRollout(tok, sampler_noise=0.5)
        args = make_args(tmp_path / str(reuse), max_steps=2, vllm_importance_sampling_mode="token_truncate",
                         num_iterations=reuse)
        trainer = GRPOTrainer(tiny_model(tok), varied_reward, args=args, train_dataset=chat_dataset(),
                              processing_class=tok, rollout_backend=rollout)
        with first_loss_inputs(trainer) as seen:
            trainer.train()
        assert (seen["old_logps"] is not None) == (reuse > 1)
        ratio = seen["sampler_ratio"]
        assert ratio.shape == seen["batch"].completion_ids.shape
        assert (ratio <= 3.0).all() and not torch.allclose(ratio, torch.ones_like(ratio))
        assert rollout.synced == {1: 1, 2: 0}[reuse]  # before the second generation (reused: one generation)
        assert all("sampling/mismatch_kl_k3" in h for h in train_logs(trainer))


def test_resume_from_checkpoint(tmp_path):
    tok = tiny_tokenizer()
    args = make_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    GRPOTrainer(tiny_model(tok), varied_reward, args=args, train_dataset=chat_dataset(), processing_class=tok).train()
    ckpt = tmp_path / "out" / "checkpoint-1"
    assert (ckpt / "model.safetensors").exists()
    args2 = make_args(tmp_path, max_steps=3, save_strategy="no")
    trainer = GRPOTrainer(tiny_model(tok), varied_reward, args=args2, train_dataset=chat_dataset(),
                          processing_class=tok)
    trainer.train(resume_from_checkpoint=str(ckpt))
    assert trainer.state.global_step == 3


def test_bad_inputs_are_named(tmp_path):
    tok = tiny_tokenizer()
    args = make_args(tmp_path)
    with pytest.raises(ValueError, match="'prompt' column"):
        GRPOTrainer(tiny_model(tok), varied_reward, args=args, train_dataset=Dataset.from_dict({"text": ["a"]}),
                    processing_class=tok)
    with pytest.raises(ValueError, match=r"reward_weights=\[1.0, 2.0\] is not allowed: 2 weights for 1"):
        GRPOTrainer(tiny_model(tok), varied_reward, args=make_args(tmp_path, reward_weights=[1.0, 2.0]),
                    train_dataset=chat_dataset(), processing_class=tok)

    def wrong_count(completions, **kw):
        return [1.0]

    trainer = GRPOTrainer(tiny_model(tok), wrong_count, args=args, train_dataset=chat_dataset(), processing_class=tok)
    with pytest.raises(ValueError, match="'wrong_count' returned 1 values for 4 completions"):
        trainer.train()
