"""``vllm_mode="colocate"`` against the real engine: GRPOTrainer builds vLLM's ``LLM`` in the trainer's own process
(vLLM's CPU build, which pins transformers 5.16-5.19, so this file runs from the vLLM environment's python:
``make test-vllm`` does; from any other python it skips). Generation goes through the engine, and before every
generation the engine's log-probs of a fixed sequence equal the trainer's (the sync reached it), a skipped sync is
caught by the same check, and a LoRA policy's adapter is folded into the engine's weights."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.models import load_model, load_tokenizer
from grpokit.rollout.vllm_backend import VLLMRollout

TOLERANCE = 5e-3
"""Largest |engine - trainer| log-prob of a token with the same float32 weights (as in test_engine.py)."""

PROMPTS = ["What is 3 + 4?", "Name a colour.", "Count to three.", "Say hello."]

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="colocate mode runs vLLM in the trainer's process: run this file with the vLLM "
                              "environment's python (make test-vllm does)"),
]


def distinct_tokens(completions, **kwargs):
    return [float(len(set(c.split()))) for c in completions]


def engine_gap(llm, model: torch.nn.Module, ids: list[int]) -> float:
    """max |engine log-prob - trainer log-prob| over the tokens of ``ids`` (each given the ones before it)."""
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0),
                       use_tqdm=False)[0]
    served = torch.tensor([step[token].logprob for step, token in zip(out.prompt_logprobs[1:], ids[1:])])
    with torch.no_grad():
        logps = model(input_ids=torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    trainer = logps.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    return float((served - trainer).abs().max())


def train(tmp_path, monkeypatch, *, steps: int, skip_sync_at: int | None = None, peft_config=None, record=True,
          **config):
    """Train ``steps`` steps with a colocated engine in float32 (the trainer's dtype); before each generation
    (after that step's sync) record the engine/trainer gap of a fixed sequence (``record``). ``skip_sync_at``: the
    training step whose sync is skipped."""
    tok = load_tokenizer("smollm2-135m-instruct")
    model = load_model("smollm2-135m-instruct", dtype=torch.float32)
    args = GRPOConfig(output_dir=str(tmp_path / "run"), use_vllm=True, vllm_mode="colocate", rollout_precision="float32",
                      vllm_max_model_length=256, max_steps=steps, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, learning_rate=3e-4 if peft_config is None else 3e-3, logging_steps=1,
                      report_to="none", save_strategy="no", gradient_checkpointing=False, seed=0, **config)
    trainer = GRPOTrainer(model=model, reward_funcs=distinct_tokens, args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), peft_config=peft_config)
    assert type(trainer.rollout).__name__ == "VLLMRollout" and type(trainer.rollout.llm).__name__ == "LLM"
    fixed = tok("The capital of France is Paris, and the capital of Italy is Rome.").input_ids
    gaps, generated = [], []
    generate, sync = VLLMRollout.generate, VLLMRollout.sync_weights

    def recording(rollout, model, *args, **kwargs):
        if record:
            gaps.append(engine_gap(rollout.llm, trainer.model, fixed))
        out = generate(rollout, model, *args, **kwargs)
        generated.append(out)
        return out

    monkeypatch.setattr(VLLMRollout, "generate", recording)
    monkeypatch.setattr(VLLMRollout, "sync_weights",
                        lambda self, model, step=None: None if step == skip_sync_at else sync(self, model, step))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    return trainer, gaps, generated, moved, len(before)


def test_the_colocated_engine_generates_and_holds_the_trainers_weights_after_every_sync(tmp_path, monkeypatch):
    trainer, gaps, generated, moved, n_trainable = train(tmp_path, monkeypatch, steps=4, skip_sync_at=3)
    assert len(gaps) == 4, gaps
    assert max(gaps[:3]) < TOLERANCE, gaps  # built from the checkpoint, then synced after steps 1 and 2
    assert gaps[3] > 10 * TOLERANCE, gaps  # step 3's sync skipped: the engine still holds step 2's weights
    assert len(moved) == n_trainable  # every parameter trained
    for out in generated:  # the engine's own completions and log-probs reached the trainer
        assert out.sampler_logps is not None and out.completion_ids.shape[0] == 4
        assert torch.isfinite(out.sampler_logps[out.completion_mask.bool()]).all()
    mismatch = [log["sampling/mismatch_kl_k3"] for log in trainer.state.log_history if "sampling/mismatch_kl_k3" in log]
    assert len(mismatch) == 4 and max(mismatch[:3]) < 1e-4, mismatch  # same weights, same dtype


def test_a_lora_policy_is_folded_into_the_colocated_engine(tmp_path, monkeypatch):
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    trainer, gaps, _, moved, n_trainable = train(tmp_path, monkeypatch, steps=3, peft_config=lora)
    assert len(gaps) == 3 and max(gaps) < TOLERANCE, gaps
    assert len(moved) == n_trainable and all("lora_" in n for n in moved)


def test_asynchronous_rollouts_generate_ahead_through_the_colocated_engine(tmp_path, monkeypatch):
    """max_staleness=1: the producer thread generates batch k+1 with the engine in this process while the learner
    trains on k; the learner pushes the weights into it between the producer's batches."""
    trainer, _, generated, moved, n_trainable = train(tmp_path, monkeypatch, steps=4, record=False, max_staleness=1)
    assert len(moved) == n_trainable and len(generated) >= 4
    assert trainer.rollout.sync.version >= 2 and trainer.rollout.sync.last.kind == "full"
    staleness = [h["sample/staleness_max"] for h in trainer.state.log_history if "sample/staleness_max" in h]
    assert staleness and max(staleness) <= 1
