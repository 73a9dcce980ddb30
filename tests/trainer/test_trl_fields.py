"""TRL fields grpokit now implements: sync_ref_model (the reference mixed toward the policy, kept across a resume),
cast_lm_head_to_fp32 (float32 head for the policy and the reference), and the completions files and table
(log_completions, log_unique_prompts)."""

from __future__ import annotations

import os

import pandas as pd
import pytest
import torch
from datasets import Dataset
from tiny import tiny_model, tiny_tokenizer
from transformers import TrainerCallback

from grpokit.config import GRPOConfig
from grpokit.trainer import GRPOTrainer
from grpokit.training.reference import REFERENCE_FILE, mix_into_reference


def dataset(n=16):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(n)]})


def reward(completions, **kw):
    return [float(len(c[0]["content"])) for c in completions]


def args_for(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=6, max_steps=2, logging_steps=1, report_to="none", gradient_checkpointing=False,
                learning_rate=1e-2, save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, beta=0.1)
    base.update(kw)
    return GRPOConfig(**base)


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_mix_into_reference_is_the_tr_dpo_update():
    policy, ref = tiny_model(seed=1), tiny_model(seed=2)
    p0, r0 = params(policy), params(ref)
    mix_into_reference(policy, ref, 0.25)
    for name, value in params(ref).items():
        torch.testing.assert_close(value, 0.25 * p0[name] + 0.75 * r0[name])
    assert all(torch.equal(v, p0[n]) for n, v in params(policy).items())  # the policy is untouched


class Snapshots(TrainerCallback):
    def __init__(self, trainer):
        self.trainer, self.policy, self.ref = trainer, {}, {}

    def on_step_end(self, args, state, control, **kw):
        # runs after the trainer's own hooks (added later): the reference has been mixed already
        self.policy[state.global_step] = params(self.trainer.model)
        self.ref[state.global_step] = params(self.trainer.ref_model)


def test_sync_ref_model_mixes_every_n_steps_and_resumes(tmp_path):
    tok = tiny_tokenizer()
    args = args_for(tmp_path, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5, max_steps=4,
                    save_strategy="steps", save_steps=1)
    trainer = GRPOTrainer(tiny_model(tok), reward, args=args, train_dataset=dataset(), processing_class=tok)
    initial = params(trainer.model)
    snap = Snapshots(trainer)
    trainer.add_callback(snap)
    trainer.train()
    for name, value in snap.ref[1].items():
        assert torch.equal(value, initial[name])  # step 1: no sync yet
    for name, value in snap.ref[2].items():
        torch.testing.assert_close(value, 0.5 * snap.policy[2][name] + 0.5 * initial[name])
    assert any(not torch.equal(snap.ref[2][n], initial[n]) for n in initial)
    assert os.path.isfile(os.path.join(args.output_dir, "checkpoint-3", REFERENCE_FILE))
    resumed = GRPOTrainer(tiny_model(tok), reward, args=args, train_dataset=dataset(), processing_class=tok)
    resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-3"))
    for name, value in params(resumed.ref_model).items():
        torch.testing.assert_close(value, snap.ref[4][name])  # the mixed reference came back with the checkpoint
    for name, value in params(resumed.model).items():
        torch.testing.assert_close(value, snap.policy[4][name])


def test_sync_ref_model_needs_a_reference_of_its_own(tmp_path):
    from peft import LoraConfig

    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="sync_ref_model=True needs beta > 0"):
        GRPOTrainer(tiny_model(tok), reward, args=args_for(tmp_path, sync_ref_model=True, beta=0.0),
                    train_dataset=dataset(), processing_class=tok)
    with pytest.raises(ValueError, match="not supported with a PEFT adapter"):
        GRPOTrainer(tiny_model(tok), reward, args=args_for(tmp_path, sync_ref_model=True), train_dataset=dataset(),
                    processing_class=tok, peft_config=LoraConfig(r=2, target_modules=["q_proj"]))


@pytest.mark.parametrize("tie", [True, False])
def test_cast_lm_head_to_fp32_runs_the_head_in_float32(tmp_path, monkeypatch, tie):
    import grpokit.forward.logprobs as logprobs

    dtypes = []
    real = logprobs.linear_logps_and_entropy

    def spy(*a, **kw):
        dtypes.append(kw.get("dtype"))
        return real(*a, **kw)

    monkeypatch.setattr(logprobs, "linear_logps_and_entropy", spy)
    tok = tiny_tokenizer()
    model = tiny_model(tok, tie=tie).to(torch.bfloat16)
    trainer = GRPOTrainer(model, reward, args=args_for(tmp_path, cast_lm_head_to_fp32=True, max_steps=1),
                          train_dataset=dataset(), processing_class=tok)
    for m in (trainer.model, trainer.ref_model):
        assert m.lm_head.weight.dtype == torch.float32 and m.lm_head.forward.__self__ is m.lm_head
        assert m.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
        assert m(input_ids=torch.tensor([[5, 6, 7]])).logits.dtype == torch.float32
    assert trainer.model.lm_head.weight is not trainer.ref_model.lm_head.weight
    trainer.train()
    assert dtypes and all(d == torch.float32 for d in dtypes)
    assert torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))


def test_cast_lm_head_to_fp32_refuses_an_adapter_on_the_head(tmp_path):
    from peft import LoraConfig

    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="needs a plain linear LM head"):
        GRPOTrainer(tiny_model(tok, tie=False), reward, args=args_for(tmp_path, cast_lm_head_to_fp32=True, beta=0.0),
                    train_dataset=dataset(), processing_class=tok,
                    peft_config=LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))


@pytest.mark.parametrize("unique", [False, True])
def test_completions_are_saved_as_parquet_per_logging_step(tmp_path, unique):
    tok = tiny_tokenizer()
    args = args_for(tmp_path, log_completions=True, log_unique_prompts=unique, beta=0.0,
                    per_device_train_batch_size=8)
    trainer = GRPOTrainer(tiny_model(tok), reward, args=args, train_dataset=dataset(), processing_class=tok)
    trainer.train()
    files = sorted(os.listdir(os.path.join(args.output_dir, "completions")))
    assert files == ["completions_00001.parquet", "completions_00002.parquet"]
    frame = pd.read_parquet(os.path.join(args.output_dir, "completions", files[0]))
    assert list(frame.columns) == ["step", "prompt", "completion", "reward", "advantage"]
    assert len(frame) == (2 if unique else 8) and (frame["step"] == 1).all()
