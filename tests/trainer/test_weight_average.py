"""``ema_decay``: the moving average of the trained weights — its arithmetic against a hand computation, exact
restore after evaluating with it, its file, and a training run whose final weights are the average of the weights
it went through."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from runs import varied_reward
from tiny import tiny_model, tiny_tokenizer
from transformers import TrainerCallback

from grpokit.algorithms.averaging import ema_decay_at, mix_
from grpokit.config import GRPOConfig
from grpokit.run.checkpoint_parts import load_parts, save_parts
from grpokit.trainer import GRPOTrainer
from grpokit.training.weight_average import WEIGHT_AVERAGE_FILE, WeightAverage


def make_trainer(out, **kw):
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      logging_steps=1, report_to="none", gradient_checkpointing=False, save_strategy="no",
                      use_cpu=True, seed=0, disable_tqdm=True, **kw)
    tok = tiny_tokenizer()
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(16)]})
    return GRPOTrainer(tiny_model(tok), varied_reward, args=args, train_dataset=data, processing_class=tok)


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class Two(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=dtype))
        self.frozen = torch.nn.Parameter(torch.tensor([5.0]), requires_grad=False)


def test_decay_ramp_and_cap():
    assert ema_decay_at(0.9, 1) == pytest.approx(2 / 11)
    assert ema_decay_at(0.9, 10) == pytest.approx(11 / 20)
    assert ema_decay_at(0.9, 80) == 0.9 == ema_decay_at(0.9, 10_000)  # (1+t)/(10+t) passes 0.9 at t = 80


def test_mix_pairs_in_order_keeps_dtypes_and_refuses_mismatches():
    target, source = torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.tensor([3.0, 6.0])
    mix_([target], [source], 0.25)
    assert target.dtype == torch.bfloat16 and target.tolist() == [1.5, 3.0]
    with pytest.raises(ValueError, match=r"cannot mix tensors of different shapes \(\(2,\) vs \(3,\)\)"):
        mix_([target], [torch.zeros(3)], 0.5)
    with pytest.raises(ValueError):  # one more source than targets
        mix_([target], [source, source], 0.5)


def test_update_against_hand_computation_and_frozen_left_out():
    m = Two()
    avg = WeightAverage(m, decay=0.5)
    assert set(avg.average) == {"a"}  # only what trains
    with torch.no_grad():
        m.a.copy_(torch.tensor([3.0, 6.0]))
    avg.update()  # t = 1: d = min(0.5, 2/11) = 2/11
    d1 = 2 / 11
    expected = torch.tensor([d1 * 1 + (1 - d1) * 3, d1 * 2 + (1 - d1) * 6])
    torch.testing.assert_close(avg.average["a"], expected)
    with torch.no_grad():
        m.a.copy_(torch.tensor([0.0, 0.0]))
    avg.update()  # t = 2: d = min(0.5, 3/12) = 0.25
    torch.testing.assert_close(avg.average["a"], 0.25 * expected)
    assert avg.updates == 2


def test_bf16_weights_average_in_float32_and_restore_bit_for_bit():
    m = Two(torch.bfloat16)
    avg = WeightAverage(m, decay=0.99)
    assert avg.average["a"].dtype == torch.float32
    with torch.no_grad():
        m.a.copy_(torch.tensor([3.0, 6.0]))
    avg.update()
    trained = m.a.detach().clone()
    with avg.applied():
        torch.testing.assert_close(m.a.float(), avg.average["a"].to(torch.bfloat16).float())
        assert not torch.equal(m.a, trained)
    assert torch.equal(m.a, trained)
    avg.copy_to_model()
    assert torch.equal(m.a, avg.average["a"].to(torch.bfloat16))


def test_file_round_trip_and_another_model_refused(tmp_path):
    m = Two()
    avg = WeightAverage(m, decay=0.9)
    with torch.no_grad():
        m.a.add_(1.0)
    avg.update()
    save_parts([avg], tmp_path)
    assert (tmp_path / WEIGHT_AVERAGE_FILE).is_file()
    again = WeightAverage(Two(), decay=0.9)
    load_parts([again], tmp_path)
    assert again.updates == 1
    assert torch.equal(again.average["a"], avg.average["a"])
    fresh = WeightAverage(Two(), decay=0.9)
    load_parts([fresh], tmp_path / "nothing-here")  # no file: left as it is
    assert fresh.updates == 0

    class Other(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.b = torch.nn.Parameter(torch.zeros(2))

    with pytest.raises(ValueError, match=f"{WEIGHT_AVERAGE_FILE} does not fit this run: it does not hold this model's"
                                         " trained parameters"):
        load_parts([WeightAverage(Other(), decay=0.9)], tmp_path)


@pytest.mark.parametrize("value", [0, 1, 1.5, -0.1, "0.9", float("nan")])
def test_bad_decay_is_one_line(tmp_path, value):
    with pytest.raises(ValueError, match=r"^ema_decay=.* is not allowed") as e:
        GRPOConfig(output_dir=str(tmp_path), ema_decay=value)
    assert "\n" not in str(e.value)


class Trajectory(TrainerCallback):
    """The trained weights after every optimizer step (before the averaged ones replace them at the end)."""

    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, model=None, **kw):
        self.steps.append(params_of(model))


def test_training_ends_with_the_average_of_the_trajectory(tmp_path):
    trainer = make_trainer(tmp_path / "run", max_steps=4, learning_rate=0.05, ema_decay=0.6)
    start = params_of(trainer.model)
    seen = Trajectory()
    trainer.add_callback(seen)
    trainer.train()
    assert len(seen.steps) == 4
    final = params_of(trainer.model)
    for name, w0 in start.items():
        expected = w0.float()
        for t, weights in enumerate(seen.steps, start=1):
            d = min(0.6, (1 + t) / (10 + t))
            expected = d * expected + (1 - d) * weights[name].float()
        torch.testing.assert_close(final[name].float(), expected, rtol=1e-5, atol=1e-6)
        assert not torch.equal(final[name], seen.steps[-1][name]), name  # the average, not the last weights


def test_held_out_curve_sees_the_average_and_training_continues_from_its_own_weights(tmp_path):
    """``averaged_weights()`` during training: the average inside, the trained weights back after (exactly)."""
    trainer = make_trainer(tmp_path / "run", max_steps=3, learning_rate=0.05, ema_decay=0.6)

    class Look(TrainerCallback):
        def __init__(self):
            self.checked = 0

        def on_step_end(self, args, state, control, model=None, **kw):
            trained = params_of(model)
            with trainer.averaged_weights():
                inside = params_of(model)
                for name, a in trainer.weight_average.average.items():
                    assert torch.equal(inside[name], a.to(inside[name].dtype))
            assert all(torch.equal(p, trained[n]) for n, p in params_of(model).items())
            self.checked += 1

    look = Look()
    trainer.add_callback(look)
    trainer.train()
    assert look.checked == 3


def test_sharded_models_are_refused(tmp_path, monkeypatch):
    import grpokit.trainer as trainer_module

    trainer = make_trainer(tmp_path / "run", max_steps=1, ema_decay=0.9)
    monkeypatch.setattr(trainer_module, "sharding_kind", lambda model: "fsdp2")
    with pytest.raises(ValueError, match=r"^ema_decay=0.9 is not supported with FSDP yet"):
        trainer.train()
