"""Asynchronous rollouts (max_staleness > 0): exact staleness accounting, the bound in the background mode, behaviour
log-probs from the generating weights, dynamic sampling in the producer, a clean stop on SIGTERM and a resume, and
max_staleness=0 being the synchronous trainer bit for bit."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from datasets import Dataset
from runs import run_args
from tiny import tiny_model, tiny_tokenizer
from transformers import TrainerCallback

from grpokit.config import GRPOConfig
from grpokit.pipeline.producer import RolloutProducer
from grpokit.trainer import GRPOTrainer


def dataset(n=48):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(n)],
                              "hard": [i % 3 != 0 for i in range(n)]})


def reward(completions, **kw):
    return [len(set(c[0]["content"])) / 8 for c in completions]


def make_args(tmp_path, **kw):
    return run_args(tmp_path / "out", **{"max_completion_length": 6, "max_steps": 5, "learning_rate": 5e-2, **kw})


class TakenBatches(TrainerCallback):
    """Records every produced batch the learner takes: (index, version, the first round's prompts), by wrapping the
    producer's public ``next_batch`` once the trainer has started it."""

    def __init__(self, trainer):
        self.trainer, self.taken = trainer, []

    def on_train_begin(self, args, state, control, **kw):
        producer = self.trainer.pipeline.producer
        take = producer.next_batch

        def spy(version, is_main_process):
            batch = take(version, is_main_process)
            self.taken.append((batch.index, batch.version, [r["prompt"][0]["content"] for r in producer.rows(batch.index)]))
            return batch

        producer.next_batch = spy


def train(tmp_path, **kw):
    tok = tiny_tokenizer()
    trainer = GRPOTrainer(tiny_model(tok), kw.pop("reward", reward), args=make_args(tmp_path, **kw),
                          train_dataset=dataset(), processing_class=tok)
    spy = TakenBatches(trainer)
    if trainer.args.max_staleness > 0:
        trainer.add_callback(spy)  # after the trainer's own hooks, which start the producer
    trainer.train()
    return trainer, spy.taken, [h for h in trainer.state.log_history if "reward" in h]


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
    score = sync.pipeline.scorer
    sync.pipeline.scorer = lambda rows, driver, stats: (seen.append([r["prompt"][0]["content"] for r in rows]),
                                                        score(rows, driver, stats))[1]
    sync.train()
    _, produced, _ = train(tmp_path / "a", max_staleness=2, staleness_mode="exact", max_steps=3)
    assert [p for _, _, p in produced] == seen


def test_behaviour_logps_come_from_the_generating_weights(tmp_path):
    tok = tiny_tokenizer()
    trainer = GRPOTrainer(tiny_model(tok), reward, args=make_args(tmp_path, max_staleness=2, staleness_mode="exact",
                                                                  max_steps=4, loss_type="vespo"),
                          train_dataset=dataset(), processing_class=tok)
    olds = []
    finish = trainer.pipeline.finish

    def record(samples, stats, driver, mode="train", behaviour_logps=None, **kw):
        olds.append(behaviour_logps)
        return finish(samples, stats, driver, mode, behaviour_logps=behaviour_logps, **kw)

    trainer.pipeline.finish = record
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
    assert trainer.pipeline.producer is None  # closed at the end of training


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
    assert trainer.pipeline.prompts.refill_position > 0


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
    assert trainer.pipeline.producer is None
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
        assert trainer.pipeline.producer is None
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


def test_a_bounded_run_stopped_and_resumed_trains_on_the_prompts_of_an_uninterrupted_one(tmp_path):
    """The producer runs ahead (its state: the refill position, the keep rate, the skipped prompts' streaks and draws),
    so a checkpoint must hold the state after the last batch the learner took, not the producer's live one: the
    resumed run then trains on the very prompts the uninterrupted run does, none twice, none skipped. Rewards depend on
    the prompt only (which groups have spread is the same in every run), so the prompts trained on are determined by
    the pipeline's state alone."""
    def spread_if_easy(completions, hard, **kw):
        return [0.0 if h else float(i % 2) for i, h in enumerate(hard)]

    kw = dict(max_staleness=2, staleness_mode="bounded", dynamic_sampling=True, dynamic_sampling_max_rounds=4,
              dynamic_sampling_explore_prob=0.5, max_steps=8, save_strategy="steps", save_steps=100)

    def run(out, stop_at=None, resume=None):
        class Term(TrainerCallback):
            def on_step_end(self, args, state, control, **k):
                if state.global_step == stop_at:
                    producer = trainer.pipeline.producer.producer
                    deadline = time.monotonic() + 120
                    while producer.ready() < 2:  # the producer has run ahead of the learner (and moved its state)
                        assert time.monotonic() < deadline, "the producer did not produce ahead within 120 s"
                        time.sleep(0.01)
                    signal.raise_signal(signal.SIGTERM)

        tok = tiny_tokenizer()
        trainer = GRPOTrainer(tiny_model(tok), spread_if_easy, args=make_args(out, **kw), train_dataset=dataset(),
                              processing_class=tok, callbacks=[Term()])
        trained = []
        finish = trainer.pipeline.finish

        def record(samples, stats, driver, mode="train", behaviour_logps=None, **kw):
            if mode == "train":
                trained.append([p[0]["content"] for p in samples.prompts[::4]])
            return finish(samples, stats, driver, mode, behaviour_logps=behaviour_logps, **kw)

        trainer.pipeline.finish = record
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            trainer.train(resume_from_checkpoint=resume)
        finally:
            signal.signal(signal.SIGTERM, previous)
        return trainer, trained

    _, whole = run(tmp_path / "whole")
    first, before = run(tmp_path / "cut", stop_at=3)
    assert first.interrupted == signal.SIGTERM and len(before) == 3
    saved = json.loads(open(os.path.join(tmp_path / "cut" / "out", "checkpoint-3", "grpokit_state_0.json")).read())
    assert saved["refill_position"] > 0 and saved["prompt_skipper"]["streaks"]
    _, after = run(tmp_path / "cut", resume="auto")
    assert len(whole) == 8 and before + after == whole


def test_the_state_is_copied_before_the_producer_thread_starts(tmp_path, monkeypatch):
    """The producer's thread owns the pipeline's state from its first moment: the copy a checkpoint holds until the
    learner takes a batch is made before the thread starts (made after, it would read the state while the thread
    writes it: dynamic sampling's refill position moves as soon as the thread draws prompts)."""
    from grpokit.pipeline.producer import AsyncRollouts

    seen = []
    start = AsyncRollouts.start

    def checked_start(self, global_step, generate_every):
        pipeline = self.pipeline
        seen.append((pipeline.producer is self, pipeline._taken_state, pipeline.prompts.refill_position))
        return start(self, global_step, generate_every)

    monkeypatch.setattr(AsyncRollouts, "start", checked_start)
    tok = tiny_tokenizer()
    trainer = GRPOTrainer(tiny_model(tok), reward, args=make_args(tmp_path, max_staleness=1, dynamic_sampling=True,
                                                                  max_steps=2),
                          train_dataset=dataset(), processing_class=tok)
    trainer.train()
    assert len(seen) == 1
    registered, copied, position = seen[0]
    assert registered and copied is not None and copied["refill_position"] == position == 0
