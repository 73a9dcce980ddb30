"""A sampler that truncates (``top_k`` / ``top_p`` / ``min_p``) and reports log-probs renormalised over what it
kept, as vLLM's ``processed_logprobs`` are: through ``GRPOTrainer`` the mismatch compares them with the trainer's
log-probs on the same support, so a sampler that *is* the trainer shows no mismatch (TRL #6789: the full-vocabulary
log-probs would show ``log S``, the kept mass, on every token)."""

from __future__ import annotations

import copy

import pytest
import torch
from runs import chat_dataset, first_loss_inputs, make_args, train_logs, varied_reward
from tiny import tiny_model, tiny_tokenizer
from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from grpokit.forward.logprobs import completion_logps
from grpokit.rollout.transformers_backend import TransformersRollout
from grpokit.trainer import GRPOTrainer


class TruncatingEngine(TransformersRollout):
    """grpokit's sampler, reporting each drawn token's log-prob under the model's distribution at the temperature
    truncated as vLLM does (min-p, top-k, top-p: transformers' own warpers) and renormalised."""

    holds_weights = False

    def __init__(self, tokenizer, temperature, top_k=0, top_p=1.0, min_p=None):
        super().__init__(tokenizer)
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p

    def generate(self, model, prompt_ids, prompt_mask, params, **kw):
        gen = super().generate(model, prompt_ids, prompt_mask, params, **kw)
        ids = torch.cat([prompt_ids, gen.completion_ids], 1)
        mask = torch.cat([prompt_mask, gen.completion_mask], 1)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits[:, prompt_ids.shape[1] - 1:-1].float()
        scores = logits.reshape(-1, logits.shape[-1]) / self.temperature
        if self.min_p:
            scores = MinPLogitsWarper(self.min_p)(None, scores)
        if self.top_k:
            scores = TopKLogitsWarper(self.top_k)(None, scores)
        if self.top_p < 1.0:
            scores = TopPLogitsWarper(self.top_p)(None, scores)
        lp = torch.log_softmax(scores, -1).gather(-1, gen.completion_ids.reshape(-1, 1)).view_as(gen.completion_ids)
        gen.sampler_logps = lp.masked_fill(gen.completion_mask == 0, 0.0)
        return gen


@pytest.mark.parametrize("truncation", [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.3, top_k=5)])
def test_a_truncating_sampler_that_is_the_trainer_shows_no_mismatch(tmp_path, truncation):
    tok = tiny_tokenizer()
    args = make_args(tmp_path, temperature=0.7, vllm_importance_sampling_mode="token_truncate", **truncation)
    trainer = GRPOTrainer(tiny_model(tok), varied_reward, args=args, train_dataset=chat_dataset(),
                          processing_class=tok, rollout_backend=TruncatingEngine(tok, 0.7, **truncation))
    initial = copy.deepcopy(trainer.model)
    with first_loss_inputs(trainer) as seen:
        trainer.train()
    batch = seen["batch"]
    assert batch.sampler_logps is not None
    assert batch.old_logps is None  # used once, on-policy: no forward of its own for the mismatch
    valid = batch.loss_mask.bool()
    with torch.no_grad():
        full_vocab, _ = completion_logps(initial, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                         batch.completion_mask, temperature=0.7, compute_entropy=False)
    assert (full_vocab - batch.sampler_logps)[valid].mean() < -0.05  # log S < 0: what the ratio carried before
    ratio = seen["sampler_ratio"]
    torch.testing.assert_close(ratio[valid], torch.ones_like(ratio[valid]), atol=1e-4, rtol=0)
    logs = train_logs(trainer)
    assert all(h["sampling/sampling_logp_difference/mean"] < 1e-4 for h in logs)
    assert all(abs(h["sampling/mismatch_kl_k3"]) < 1e-6 for h in logs)
