"""``loraplus_lr_ratio`` (LoRA+): the adapters' B matrices in param groups of their own at ``ratio ×`` the learning
rate, every trainable parameter in exactly one group, the schedule scaling both alike, and a real step that moves B
``ratio`` times as far as plain LoRA does."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from runs import varied_reward
from tiny import tiny_model, tiny_tokenizer

from grpokit.config import GRPOConfig
from grpokit.trainer import GRPOTrainer
from grpokit.training.lora_plus import is_lora_b

LR = 1e-3


def make_trainer(out, lora=True, **kw):
    kw.setdefault("max_steps", 1)
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      logging_steps=1, report_to="none", gradient_checkpointing=False, save_strategy="no",
                      use_cpu=True, seed=0, disable_tqdm=True, learning_rate=LR, weight_decay=0.01, **kw)
    tok = tiny_tokenizer()
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(16)]})
    peft = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if lora else None
    return GRPOTrainer(tiny_model(tok), varied_reward, args=args, train_dataset=data, processing_class=tok,
                       peft_config=peft)


def test_names():
    assert is_lora_b("base_model.model.layers.0.q_proj.lora_B.default.weight")
    assert is_lora_b("m.embed_tokens.lora_embedding_B.default")
    assert not is_lora_b("base_model.model.layers.0.q_proj.lora_A.default.weight")
    assert not is_lora_b("m.not_lora_Bx.weight")


def test_groups_and_schedule(tmp_path):
    t = make_trainer(tmp_path, loraplus_lr_ratio=16.0, warmup_steps=4, max_steps=8)
    t.create_optimizer_and_scheduler(num_training_steps=8)
    names = {id(p): n for n, p in t.model.named_parameters() if p.requires_grad}
    seen = [id(p) for g in t.optimizer.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(names) and len(seen) == len(set(seen))  # each trainable parameter once
    for g in t.optimizer.param_groups:
        kinds = {is_lora_b(names[id(p)]) for p in g["params"]}
        assert len(kinds) <= 1  # a group holds B matrices only, or none
        if kinds == {True}:
            assert g["initial_lr"] == pytest.approx(16 * LR)
    assert any(is_lora_b(names[id(g["params"][0])]) for g in t.optimizer.param_groups if g["params"])
    t.lr_scheduler.step()  # warmup 1 of 4 steps: both kinds scaled alike
    a_lr = {g["lr"] for g in t.optimizer.param_groups if g["params"] and not is_lora_b(names[id(g["params"][0])])}
    b_lr = {g["lr"] for g in t.optimizer.param_groups if g["params"] and is_lora_b(names[id(g["params"][0])])}
    assert len(a_lr) == len(b_lr) == 1
    assert a_lr.pop() == pytest.approx(LR / 4) and b_lr.pop() == pytest.approx(16 * LR / 4)


def b_step(tmp_path, **kw) -> float:
    """The largest change of any B matrix in one optimizer step (Adam's first step moves each element by ~lr)."""
    t = make_trainer(tmp_path, **kw)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters() if is_lora_b(n)}
    t.train()
    return max((p.detach() - before[n]).abs().max().item() for n, p in t.model.named_parameters() if n in before)


def test_one_step_moves_b_ratio_times_as_far(tmp_path):
    plain = b_step(tmp_path / "plain")
    plus = b_step(tmp_path / "plus", loraplus_lr_ratio=8.0)
    assert plain == pytest.approx(LR, rel=0.05)  # B starts at zero; Adam's first step is lr·g/|g|
    assert plus == pytest.approx(8 * LR, rel=0.05)


def test_without_lora_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"loraplus_lr_ratio=4.0 needs LoRA adapters: the model has no trainable lora_B"):
        make_trainer(tmp_path, lora=False, loraplus_lr_ratio=4.0).create_optimizer()
    with pytest.raises(ValueError, match=r"loraplus_lr_ratio"):
        GRPOConfig(output_dir=str(tmp_path), loraplus_lr_ratio=0.0)


def test_an_optimizer_passed_in_is_left_as_it_is(tmp_path):
    t = make_trainer(tmp_path, loraplus_lr_ratio=4.0)
    given = torch.optim.SGD([p for p in t.model.parameters() if p.requires_grad], lr=LR)
    t.optimizer = given
    assert t.create_optimizer() is given and len(given.param_groups) == 1 and given.param_groups[0]["lr"] == LR
