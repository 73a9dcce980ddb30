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
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from grpokit.forward.logprobs import completion_logps
from grpokit.rollout.base import stop_token_ids
from grpokit.rollout.transformers_backend import TransformersRollout
from grpokit.trainer import GRPOTrainer


class TruncatingEngine(TransformersRollout):
    """grpokit's sampler, reporting each drawn token's log-prob under the model's distribution as vLLM's processed
    log-probs are: stop tokens held back before ``min_tokens``, the repetition penalty on the tokens of the row so far
    (the prompt without its padding, the completion before the position), the temperature, then truncated as vLLM
    does (min-p, top-k, top-p: transformers' own processors) and renormalised."""

    holds_weights = False

    def __init__(self, tokenizer, temperature, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0,
                 min_tokens=0):
        super().__init__(tokenizer)
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p
        self.repetition_penalty, self.min_tokens = repetition_penalty, min_tokens

    def generate(self, model, prompt_ids, prompt_mask, params, **kw):
        gen = super().generate(model, prompt_ids, prompt_mask, params, **kw)
        ids = torch.cat([prompt_ids, gen.completion_ids], 1)
        mask = torch.cat([prompt_mask, gen.completion_mask], 1)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits[:, prompt_ids.shape[1] - 1:-1].float()
        stops = stop_token_ids(model, self.tokenizer)
        lp = torch.zeros(gen.completion_ids.shape)
        for b in range(ids.shape[0]):
            for t in range(gen.completion_ids.shape[1]):
                scores = logits[b, t:t + 1].clone()
                if t < self.min_tokens:
                    scores[:, stops] = float("-inf")
                if self.repetition_penalty != 1.0:
                    so_far = torch.cat([prompt_ids[b][prompt_mask[b] == 1], gen.completion_ids[b, :t]])
                    scores = RepetitionPenaltyLogitsProcessor(self.repetition_penalty)(so_far[None], scores)
                scores = scores / self.temperature
                if self.min_p:
                    scores = MinPLogitsWarper(self.min_p)(None, scores)
                if self.top_k:
                    scores = TopKLogitsWarper(self.top_k)(None, scores)
                if self.top_p < 1.0:
                    scores = TopPLogitsWarper(self.top_p)(None, scores)
                lp[b, t] = torch.log_softmax(scores, -1)[0, gen.completion_ids[b, t]]
        gen.sampler_logps = lp.masked_fill(gen.completion_mask == 0, 0.0)
        return gen


@pytest.mark.parametrize("truncation, reshaping", [
    (dict(top_k=3), {}), (dict(top_p=0.5), {}), (dict(min_p=0.3, top_k=5), {}),
    ({}, dict(repetition_penalty=1.5)),
    (dict(top_k=5), dict(repetition_penalty=0.8, min_tokens=3)),
])
def test_a_reshaping_sampler_that_is_the_trainer_shows_no_mismatch(tmp_path, truncation, reshaping):
    """Truncation, the repetition penalty and ``min_new_tokens`` replayed on the trainer's side: the engine's
    log-probs and the trainer's agree, where the whole vocabulary's softmax would not."""
    tok = tiny_tokenizer()
    settings = dict(truncation, repetition_penalty=reshaping.get("repetition_penalty", 1.0))
    if reshaping.get("min_tokens"):
        settings["generation_kwargs"] = {"min_new_tokens": reshaping["min_tokens"]}
    args = make_args(tmp_path, temperature=0.7, vllm_importance_sampling_mode="token_truncate", **settings)
    model = tiny_model(tok, tie=False)
    if reshaping:  # a random model's logits are all near 0, where a multiplicative penalty changes little
        with torch.no_grad():
            model.lm_head.weight.mul_(30.0)
    trainer = GRPOTrainer(model, varied_reward, args=args, train_dataset=chat_dataset(),
                          processing_class=tok, rollout_backend=TruncatingEngine(tok, 0.7, **truncation, **reshaping))
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
    assert (full_vocab - batch.sampler_logps)[valid].abs().mean() > 0.05  # what the ratio carried before
    ratio = seen["sampler_ratio"]
    torch.testing.assert_close(ratio[valid], torch.ones_like(ratio[valid]), atol=1e-4, rtol=0)
    logs = train_logs(trainer)
    assert all(h["sampling/sampling_logp_difference/mean"] < 1e-4 for h in logs)
    assert all(abs(h["sampling/mismatch_kl_k3"]) < 1e-6 for h in logs)


def test_an_asynchronous_producer_replays_the_sampler_for_the_mismatch(tmp_path):
    """With ``max_staleness=1`` the behaviour log-probs are the producer's forward of the weights that sampled: the
    mismatch compares the sampler's with that forward's under the same truncation and penalty, so a sampler that is
    the trainer shows none (before, that forward's whole-vocabulary log-probs were compared, and the combination of
    copies, a producer and a truncating sampler was refused)."""
    tok = tiny_tokenizer()
    args = make_args(tmp_path, temperature=0.7, top_k=3, repetition_penalty=1.5, max_staleness=1, max_steps=3,
                     vllm_importance_sampling_mode="token_truncate")
    model = tiny_model(tok, tie=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    trainer = GRPOTrainer(model, varied_reward, args=args, train_dataset=chat_dataset(), processing_class=tok,
                          rollout_backend=TruncatingEngine(tok, 0.7, top_k=3, repetition_penalty=1.5))
    with first_loss_inputs(trainer) as seen:
        trainer.train()
    assert seen["old_logps"] is not None  # the producer's behaviour log-probs
    logs = train_logs(trainer)
    assert len(logs) == 3
    assert all(h["sampling/sampling_logp_difference/mean"] < 1e-4 for h in logs), logs
    assert all(abs(h["sampling/mismatch_kl_k3"]) < 1e-6 for h in logs)
