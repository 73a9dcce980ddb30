"""Non-finite numbers stop the step with a clear error (or skip it, counted, with ``skip_nonfinite_steps``) and never
reach the weights; degenerate but legal batches (identical rewards, everything truncated) train without NaN."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import FixedRollout
from reliability_helpers import make_trainer, tiny_tokenizer
from runs import params_of
from transformers import TrainerCallback

import grpokit.trainer as trainer_module


class Snapshots(TrainerCallback):
    """The parameters after every optimizer step (index 0: before training)."""

    def __init__(self, model):
        self.model = model
        self.params = [params_of(model)]

    def on_step_end(self, args, state, control, **kw):
        self.params.append(params_of(self.model))


def poison_policy_loss(monkeypatch, bad_calls: set[int]):
    """Make ``policy_loss`` return a NaN loss on the given (1-based) calls."""
    original = trainer_module.policy_loss
    calls = {"n": 0}

    def patched(*a, **k):
        calls["n"] += 1
        out = original(*a, **k)
        if calls["n"] in bad_calls:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(trainer_module, "policy_loss", patched)


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def test_a_non_finite_loss_stops_without_touching_the_weights(tmp_path, monkeypatch):
    poison_policy_loss(monkeypatch, {2})
    trainer = make_trainer(tmp_path, max_steps=3, learning_rate=0.05)
    snaps = Snapshots(trainer.model)
    trainer.add_callback(snaps)
    with pytest.raises(FloatingPointError) as e:
        trainer.train()
    msg = str(e.value)
    assert "in optimizer step 2: the dapo loss is nan" in msg and "the weights were not updated" in msg
    assert "skip_nonfinite_steps=True" in msg
    assert len(snaps.params) == 2 and not same(snaps.params[0], snaps.params[1])  # step 1 did train
    assert same(params_of(trainer.model), snaps.params[1])  # step 2 changed nothing


def test_non_finite_log_probs_are_named(tmp_path, monkeypatch):
    original = trainer_module.completion_logps

    def nan_logps(*a, **k):
        logps, ent = original(*a, **k)
        if k.get("compute_entropy"):  # the policy forward of compute_loss
            logps = logps.clone()
            logps[0, 0] = float("nan")
        return logps, ent

    monkeypatch.setattr(trainer_module, "completion_logps", nan_logps)
    trainer = make_trainer(tmp_path, max_steps=1)
    before = params_of(trainer.model)
    with pytest.raises(FloatingPointError, match=r"non-finite policy log-probs at 1 of \d+ completion tokens"):
        trainer.train()
    assert same(params_of(trainer.model), before)


def test_skip_nonfinite_steps_skips_counts_and_logs(tmp_path, monkeypatch):
    poison_policy_loss(monkeypatch, {2})
    trainer = make_trainer(tmp_path, max_steps=3, learning_rate=0.05, skip_nonfinite_steps=True)
    snaps = Snapshots(trainer.model)
    trainer.add_callback(snaps)
    trainer.train()
    assert trainer.state.global_step == 3
    assert same(snaps.params[1], snaps.params[2])  # the skipped step left every parameter as it was
    assert not same(snaps.params[2], snaps.params[3])  # and training went on
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h}
    assert logs[2]["skipped_nonfinite"] == 1.0
    assert "skipped_nonfinite" not in logs[1] and "skipped_nonfinite" not in logs[3]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.parametrize("skip", [False, True])
def test_a_non_finite_gradient_never_reaches_the_weights(tmp_path, skip):
    """The loss is finite but backward produces NaN (here through a hook on one weight)."""
    trainer = make_trainer(tmp_path, max_steps=2, learning_rate=0.05, skip_nonfinite_steps=skip)
    weight = trainer.model.model.layers[0].mlp.down_proj.weight
    weight.register_hook(lambda g: g * float("nan"))
    before = params_of(trainer.model)
    if not skip:
        with pytest.raises(FloatingPointError, match=r"non-finite gradients in \d+ of \d+ parameters .* at step 1"):
            trainer.train()
    else:
        trainer.train()
        logs = [h for h in trainer.state.log_history if "skipped_nonfinite" in h]
        assert [h["skipped_nonfinite"] for h in logs] == [1.0, 1.0]
    assert same(params_of(trainer.model), before)
    assert trainer.optimizer is None or all(not s for s in trainer.optimizer.state.values())  # no moments either


def constant_reward(completions, **kw):
    return [0.7] * len(completions)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "cispo", "sapo", "vespo", "gmpo", "luspo"])
@pytest.mark.parametrize("case", ["identical_rewards", "all_truncated", "all_truncated_masked", "both"])
def test_degenerate_batches_train_without_nan(tmp_path, loss_type, case):
    tok = tiny_tokenizer()
    truncated = case != "identical_rewards"
    kwargs = dict(loss_type=loss_type, max_steps=2, mask_truncated_completions=case in ("all_truncated_masked", "both"),
                  rollout_backend=FixedRollout(tok, eos_prob=0.0 if truncated else 0.5))
    if case in ("identical_rewards", "both"):
        kwargs["reward"] = constant_reward
    trainer = make_trainer(tmp_path, **kwargs)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    assert len(logs) == 2
    for h in logs:
        assert all(math.isfinite(v) for v in h.values() if isinstance(v, float)), h
        if case in ("identical_rewards", "both"):
            assert h["frac_reward_zero_std"] == 1.0
        if truncated:
            assert h["completions/clipped_ratio"] == 1.0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
