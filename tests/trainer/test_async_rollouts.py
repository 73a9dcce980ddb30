"""Asynchronous rollouts (max_staleness > 0): exact staleness accounting, the bound in the background mode, behaviour
log-probs from the generating weights, dynamic sampling in the producer, a clean stop on SIGTERM and a resume, and
max_staleness=0 being the synchronous trainer bit for bit."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from datasets import Dataset
from tiny import tiny_model, tiny_tokenizer
from transformers import TrainerCallback

from grpokit.config import GRPOConfig
from grpokit.rollout.producer import RolloutProducer
from grpokit.trainer import GRPOTrainer


def dataset(n=48):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(n)],
                              "hard": [i % 3 != 0 for i in range(n)]})


def reward(completions, **kw):
    return [len(set(c[0]["content"])) / 8 for c in completions]


def make_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=6, max_steps=5, logging_steps=1, report_to="none", gradient_checkpointing=False,
                learning_rate=5e-2, save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    base.update(kw)
    return GRPOConfig(**base)


def train(tmp_path, **kw):
    tok = tiny_tokenizer()
    trainer = GRPOTrainer(tiny_model(tok), kw.pop("reward", reward), args=make_args(tmp_path, **kw),
                          train_dataset=dataset(), processing_class=tok)
    produced = []
    if trainer._async is not None:
        original = trainer._async._produce

        def spy(rows, k, version):
            batch = original(rows, k, version)
            produced.append((k, version, [r["prompt"][0]["content"] for r in rows]))
            return batch

        trainer._async._produce = spy
    trainer.train()
    return trainer, produced, [h for h in trainer.state.log_history if "reward" in h]


def test_exact_staleness_is_exact(tmp_path):
    trainer, produced, logs = train(tmp_path, max_staleness=3, staleness_mode="exact", max_steps=6)
    assert [(k, v) for k, v, _ in produced] == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 1), (5, 2)]
    assert [h["sample/staleness_mean"] for h in logs] == [0, 1, 2, 3, 3, 3]
    assert [h["sample/staleness_max"] for h in logs] == [0, 1, 2, 3, 3, 3]
    assert logs[4]["sample/staleness_3_total"] == 1 and logs[4]["sample/dropped_stale_total"] == 0
    # stale data: the ratio to the behaviour policy is not 1, so clipping acts
    assert any(h["clip_ratio/region_mean"] > 0 for h in logs[1:])


def test_the_batches_are_those_of_the_synchronous_sampler(tmp_path):
    tok = tiny_tokenizer()
    sync = GRPOTrainer(tiny_model(tok), reward, args=make_args(tmp_path / "s", max_steps=3), train_dataset=dataset(),
                       processing_class=tok)
    seen = []
    score = sync._score_rows
    sync._score_rows = lambda rows, mode, **k: (seen.append([r["prompt"][0]["content"] for r in rows]),
                                                score(rows, mode, **k))[1]
    sync.train()
    _, produced, _ = train(tmp_path / "a", max_staleness=2, staleness_mode="exact", max_steps=3)
    assert [p for _, _, p in produced] == seen


def test_behaviour_logps_come_from_the_generating_weights(tmp_path):
    tok = tiny_tokenizer()
    trainer = GRPOTrainer(tiny_model(tok), reward, args=make_args(tmp_path, max_staleness=2, staleness_mode="exact",
                                                                  max_steps=4, loss_type="vespo"),
                          train_dataset=dataset(), processing_class=tok)
    olds = []
    finish = trainer._finish_batch

    def record(s, mode, behaviour_logps=None):
        olds.append(behaviour_logps)
        return finish(s, mode, behaviour_logps=behaviour_logps)

    trainer._finish_batch = record
    trainer.train()
    assert all(o is not None for o in olds)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert logs[0]["vespo/phi_seq_mean"] == pytest.approx(1.0, abs=1e-4)  # version 0 data at version 0
    assert logs[3]["vespo/phi_seq_mean"] != pytest.approx(1.0, abs=1e-4)  # two steps stale: W ≠ 1


def test_bounded_mode_stays_within_the_bound_and_stops(tmp_path):
    trainer, produced, logs = train(tmp_path, max_staleness=2, staleness_mode="bounded", max_steps=6)
    assert all(h["sample/staleness_max"] <= 2 for h in logs) and len(logs) == 6
    for k, version, _ in produced:
        assert version >= k - 2  # batch k starts training at step k: never more than 2 versions old
    assert trainer._async.producer is None  # closed at the end of training


def test_weight_sync_steps(tmp_path):
    _, produced, logs = train(tmp_path, max_staleness=2, weight_sync_steps=2, max_steps=6)
    assert all(v % 2 == 0 for _, v, _ in produced)
    assert all(h["sample/staleness_max"] <= 2 for h in logs)


def test_dynamic_sampling_in_the_producer(tmp_path):
    def only_easy(completions, hard, **kw):
        return [0.0 if h else len(set(c[0]["content"])) / 8 for c, h in zip(completions, hard)]

    trainer, _, logs = train(tmp_path, reward=only_easy, max_staleness=1, dynamic_sampling=True,
                             dynamic_sampling_max_rounds=10, max_steps=3)
    assert all(h["frac_reward_zero_std"] == 0 and "dynamic_sampling/rounds" in h for h in logs)
    assert trainer._refill_position > 0


def test_sigterm_stops_the_producer_and_the_run_resumes(tmp_path):
    class Term(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                signal.raise_signal(signal.SIGTERM)

    tok = tiny_tokenizer()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # as a fresh Python process has
    try:
        args = make_args(tmp_path, max_staleness=2, max_steps=5)
        trainer = GRPOTrainer(tiny_model(tok), reward, args=args, train_dataset=dataset(), processing_class=tok,
                              callbacks=[Term()])
        trainer.train()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert trainer.interrupted == signal.SIGTERM and trainer.state.global_step == 2
    assert trainer._async.producer is None
    checkpoint = os.path.join(args.output_dir, "checkpoint-2")
    assert os.path.isdir(checkpoint)
    resumed = GRPOTrainer(tiny_model(tok), reward, args=make_args(tmp_path, max_staleness=2, max_steps=5),
                          train_dataset=dataset(), processing_class=tok)
    resumed.train(resume_from_checkpoint=checkpoint)
    logs = [h for h in resumed.state.log_history if "reward" in h]
    assert resumed.state.global_step == 5 and all(h["sample/staleness_max"] <= 2 for h in logs[-3:])


def test_max_staleness_zero_is_the_synchronous_trainer_bit_for_bit(tmp_path):
    results = []
    for tag, extra in (("default", {}), ("zero", {"max_staleness": 0, "weight_sync_steps": 3})):
        tok = tiny_tokenizer()
        model = tiny_model(tok, seed=2)
        trainer = GRPOTrainer(model, reward, args=make_args(tmp_path / tag, max_steps=3, **extra),
                              train_dataset=dataset(), processing_class=tok)
        assert trainer._async is None
        trainer.train()
        results.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert all(torch.equal(results[0][n], results[1][n]) for n in results[0])


def test_a_producer_failure_reaches_the_learner():
    def produce(k, version):
        raise ValueError("reward service down")

    producer = RolloutProducer(produce, load=lambda s: None, snapshot=dict, start_of=lambda k: k, max_staleness=1,
                               mode="bounded", first_index=0, version=0)
    producer.start()
    with pytest.raises(RuntimeError, match="the rollout producer failed: ValueError: reward service down"):
        producer.take(0)
    producer.close()


def test_config_rules():
    with pytest.raises(ValueError, match="weight_sync_steps=2 is not allowed with staleness_mode='exact'"):
        GRPOConfig(output_dir="/tmp/a", max_staleness=2, staleness_mode="exact", weight_sync_steps=2)
    with pytest.raises(ValueError, match="staleness_mode='nope' is not allowed"):
        GRPOConfig(output_dir="/tmp/a", staleness_mode="nope")
    with pytest.raises(ValueError, match="max_staleness=-1 is not allowed"):
        GRPOConfig(output_dir="/tmp/a", max_staleness=-1)
