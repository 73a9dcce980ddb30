"""transformers' continuous-batching engine as a rollout backend (TRL's use_transformers_continuous_batching): the same
completions as ``generate`` greedily, EOS handling, sampling parameters, and a training run."""

from __future__ import annotations

import torch
from datasets import Dataset
from tiny import tiny_model, tiny_tokenizer

from grpokit.config import GRPOConfig
from grpokit.rollout.base import SamplingParams
from grpokit.rollout.continuous_batching import ContinuousBatchingRollout
from grpokit.rollout.transformers_backend import TransformersRollout
from grpokit.trainer import GRPOTrainer


def _prompts(tok):
    texts = ["abc", "hello there", "x"]
    rows = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def test_greedy_completions_equal_generate():
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=3)
    ids, mask = _prompts(tok)
    params = SamplingParams(max_new_tokens=12, do_sample=False)
    cb = ContinuousBatchingRollout(tok).generate(model, ids, mask, params)
    ref = TransformersRollout(tok).generate(model, ids, mask, params)
    assert torch.equal(cb.completion_mask, ref.completion_mask)
    assert torch.equal(cb.completion_ids, ref.completion_ids)
    assert torch.equal(cb.is_truncated, ref.is_truncated)
    assert model.training  # the training mode is restored


def test_eos_ends_a_completion_and_padding_follows():
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=3)
    with torch.no_grad():  # make EOS the most likely next token everywhere
        model.lm_head.weight[tok.eos_token_id] += 50.0 * model.lm_head.weight[5:].mean(0).sign()
        model.model.norm.weight.abs_()
    ids, mask = _prompts(tok)
    out = ContinuousBatchingRollout(tok).generate(model, ids, mask, SamplingParams(max_new_tokens=6, do_sample=False))
    for row, m, trunc in zip(out.completion_ids, out.completion_mask, out.is_truncated):
        n = int(m.sum())
        if not trunc:
            assert row[n - 1] == tok.eos_token_id and (row[n:] == tok.pad_token_id).all()


def test_trainer_with_continuous_batching(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_model(tok)
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(8)]})
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=2, logging_steps=1, report_to="none",
                      gradient_checkpointing=False, save_strategy="no", use_cpu=True, disable_tqdm=True,
                      learning_rate=1e-2, use_transformers_paged=True, top_k=5, temperature=0.8,
                      transformers_continuous_batching_config='{"max_memory_percent": 0.2}')
    assert args.use_transformers_continuous_batching
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model, lambda completions, **k: [len(set(c[0]["content"])) / 8 for c in completions],
                          args=args, train_dataset=ds, processing_class=tok)
    assert isinstance(trainer.rollout, ContinuousBatchingRollout)
    assert trainer.rollout.config["max_memory_percent"] == 0.2
    trainer.train()
    assert trainer.state.global_step == 2
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_on_a_cpu_the_cache_is_sized_for_the_call_unless_the_user_sized_it():
    from transformers.generation import ContinuousBatchingConfig

    tok = tiny_tokenizer()
    cpu = torch.device("cpu")
    sized = ContinuousBatchingRollout(tok).continuous_batching_config(cpu, [5, 300, 7], 12)
    page = ContinuousBatchingConfig.page_size  # 256: the longest row (300 + 12 tokens) takes 2 pages, plus one
    assert sized.num_blocks == 3 * (2 + 1) and sized.max_batch_tokens == 312
    assert ContinuousBatchingRollout(tok, {"page_size": 64}).continuous_batching_config(cpu, [5, 300], 12).num_blocks \
        == 2 * (5 + 1)
    assert page == 256
    # what the user set is theirs: a share of memory or a size leaves the cache to transformers' sizing by memory
    for user in ({"max_memory_percent": 0.2}, {"num_blocks": 7}):
        config = ContinuousBatchingRollout(tok, user).continuous_batching_config(cpu, [5, 300], 12)
        assert config.num_blocks == user.get("num_blocks") and config.max_batch_tokens == 305
    assert ContinuousBatchingRollout(tok, {"max_batch_tokens": 64}).continuous_batching_config(
        cpu, [5, 300], 12).max_batch_tokens == 64
    # without a call's sizes (or off a CPU) transformers sizes it by memory, at grpokit's default share
    for config in (ContinuousBatchingRollout(tok).continuous_batching_config(),
                   ContinuousBatchingRollout(tok).continuous_batching_config(torch.device("cuda"), [5], 12)):
        assert config.num_blocks is None and config.max_batch_tokens is None and config.max_memory_percent == 0.5


def test_sized_caches_sample_what_generate_samples_for_long_and_many_rows():
    """Rows of different lengths over more than one page each, more rows than the smallest cache would hold if it
    were sized for one row: the completions equal the default backend's."""
    from transformers.generation import ContinuousBatchingConfig

    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=4)
    rows = [[(7 * i + j) % 50 + 5 for j in range(n)] for i, n in enumerate([3, 40, 17, 70, 1, 33])]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    params = SamplingParams(max_new_tokens=20, do_sample=False)
    rollout = ContinuousBatchingRollout(tok, {"page_size": 16})
    assert rollout.continuous_batching_config(torch.device("cpu"), list(map(len, rows)), 20).num_blocks == 6 * 7
    assert ContinuousBatchingConfig(page_size=16).num_blocks is None
    cb = rollout.generate(model, ids, mask, params)
    ref = TransformersRollout(tok).generate(model, ids, mask, params)
    assert torch.equal(cb.completion_ids, ref.completion_ids)
    assert torch.equal(cb.completion_mask, ref.completion_mask)
