"""The decode loop that drops finished rows (grpokit/rollout/decode.py): the completions ``generate`` gives, the
same processors in the same order, rows leaving the batch when they end, and the backend using it only where it
applies."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from grpokit.forward.prefix import common_prefix_length, position_ids_from_mask, prefix_first
from grpokit.rollout.base import SamplingParams
from grpokit.rollout.decode import decode, decodes, token_chooser
from grpokit.rollout.transformers_backend import InverseCDFSampler, TransformersRollout


def prompts(tok, texts, g):
    enc = tok([t for t in texts for _ in range(g)], return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


class EndByContent(LogitsProcessor):
    """Forces the end-of-sequence token once a row holds ``2 + (its last prompt token % 7)`` generated tokens: rows
    end at different steps, decided by their content (the same in both loops whatever their position in the batch)."""

    def __init__(self, prompt_len: int, eos: int):
        self.prompt_len, self.eos = prompt_len, eos

    def __call__(self, input_ids, scores):
        made = input_ids.shape[1] - self.prompt_len
        end = (2 + input_ids[:, self.prompt_len - 1] % 7) <= made
        scores = scores.clone()
        scores[end] = float("-inf")
        scores[end, self.eos] = 0.0
        return scores


def decode_as_generate(model, tok, ids, mask, g, max_new_tokens, repetition_penalty=1.0):
    """Greedy completions of the decode loop, asserted equal to ``generate``'s (rows ending at different steps, by
    :class:`EndByContent`); returns them and the (rows, columns) of every forward the loop ran."""
    eos = tok.eos_token_id
    ender = EndByContent(ids.shape[1], eos)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                              eos_token_id=[eos], repetition_penalty=repetition_penalty)
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                              logits_processor=LogitsProcessorList([ender]))[:, ids.shape[1]:]
    chooser = token_chooser(SamplingParams(max_new_tokens=max_new_tokens, do_sample=False,
                                           repetition_penalty=repetition_penalty))
    shapes, first_logits = [], []

    def choose(seqs, logits, owner):
        if not first_logits:
            first_logits.append(logits[owner].clone())
        return chooser(seqs, ender(seqs, logits), owner)

    hook = model.model.register_forward_pre_hook(lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)),
                                                 with_kwargs=True)
    got = decode(model, ids, mask, max_new_tokens=max_new_tokens, eos_ids=[eos], pad_id=tok.pad_token_id,
                 choose=choose, group=g)
    hook.remove()
    with torch.no_grad():  # the first step's logits: every row's, as a plain forward of its left-padded prompt gives
        plain = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits[:, -1]
    torch.testing.assert_close(first_logits[0], plain.float(), atol=1e-5, rtol=1e-5)
    width = max(expected.shape[1], got.shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=tok.pad_token_id)  # noqa: E731
    assert torch.equal(pad(got), pad(expected))
    return got, shapes


@pytest.mark.parametrize("g", [1, 3])
def test_greedy_completions_equal_generate_with_rows_ending_at_different_steps(g):
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=3).eval()
    ids, mask = prompts(tok, ["hello there", "hi", "what is 2 + 2?", "abcd"], g)
    eos = tok.eos_token_id
    got, shapes = decode_as_generate(model, tok, ids, mask, g, max_new_tokens=10, repetition_penalty=1.3)
    forward_rows = [rows for rows, _ in shapes]
    lengths = ((got != tok.pad_token_id) & (got != eos)).sum(1)
    assert len(set(lengths.tolist())) > 1  # rows ended at different steps...
    decode_steps = forward_rows[1:]  # after the prefill
    assert decode_steps == sorted(decode_steps, reverse=True) and decode_steps[-1] < ids.shape[0]  # ...and left


def test_sampling_uses_the_warpers_and_min_new_tokens():
    """Sampled with top-k 1 (so every draw is the argmax): the loop's samples are generate's greedy completions, and
    no row ends before min_new_tokens."""
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=1).eval()
    ids, mask = prompts(tok, ["hello", "hey there you"], 2)
    eos = tok.eos_token_id
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=1, extra={"min_new_tokens": 5})
    got = decode(model, ids, mask, max_new_tokens=8, eos_ids=[eos], pad_id=tok.pad_token_id,
                 choose=token_chooser(params, InverseCDFSampler(0.7, top_k=1)), min_new_tokens=5, group=2)
    config = GenerationConfig(max_new_tokens=8, min_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id,
                              eos_token_id=[eos])
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]
    assert torch.equal(got, expected[:, :got.shape[1]])
    assert not (got[:, :5] == eos).any()


def test_the_backend_uses_the_loop_only_where_it_applies():
    tok = tiny_tokenizer()
    model = tiny_model(tok)
    assert decodes(model, SamplingParams(max_new_tokens=4, extra={"min_new_tokens": 2}))
    assert not decodes(model, SamplingParams(max_new_tokens=4, extra={"no_repeat_ngram_size": 2}))  # generate's
    assert not decodes(model, SamplingParams(max_new_tokens=4, lockstep=True))
    ids, mask = prompts(tok, ["hello there", "hi"], 2)
    calls = []
    original = model.generate
    model.generate = lambda **kw: (calls.append(kw), original(**kw))[1]
    greedy = SamplingParams(max_new_tokens=6, do_sample=False)
    fast = TransformersRollout(tok).generate(model, ids, mask, greedy)
    assert not calls  # the loop
    slow = TransformersRollout(tok, decode_loop=False).generate(model, ids, mask, greedy)
    assert len(calls) == 1
    assert torch.equal(fast.completion_ids, slow.completion_ids) and torch.equal(fast.completion_mask,
                                                                                  slow.completion_mask)
    TransformersRollout(tok).generate(model, ids, mask, SamplingParams(max_new_tokens=6, do_sample=False,
                                                                       extra={"no_repeat_ngram_size": 2}))
    assert len(calls) == 2


@pytest.mark.parametrize("g", [1, 3])
def test_a_prefix_every_prompt_begins_with_is_encoded_once_and_the_completions_are_generates(g):
    """Prompts of different lengths (left padding) behind one system turn: the turn is encoded once for the batch (one
    row), the rest once per group, and greedy decoding gives what ``generate`` gives from the left-padded rows."""
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=5).eval()
    system = "you are a careful assistant. answer the question. "
    ids, mask = prompts(tok, [system + q for q in ["hello there", "hi", "what is 2 + 2?", "abcd efgh"]], g)
    assert (mask == 0).any()  # rows of several lengths
    shapes = decode_as_generate(model, tok, ids, mask, g, max_new_tokens=8)[1]
    shared = common_prefix_length(ids[:, :-1], mask[:, :-1])
    assert shared >= len(tok(system, add_special_tokens=False)["input_ids"]) - 1
    assert shapes[0] == (1, shared)  # the system turn, once
    assert shapes[1] == (4, ids.shape[1] - 1 - shared)  # the rest of each distinct prompt, once
    assert all(s[1] == 1 for s in shapes[2:])  # then one token a step


def test_prefix_first_by_hand():
    pad = 0
    ids = torch.tensor([[pad, pad, 7, 8, 9, 5], [7, 8, 9, 3, 4, 6], [pad, 7, 8, 9, 1, 2]])
    mask = (ids != pad).long()
    assert common_prefix_length(ids, mask) == 3
    short = torch.tensor([[pad, pad, pad, 7, 8, 9], [7, 8, 9, 3, 4, 6]])
    assert common_prefix_length(short, (short != pad).long()) == 2  # the shortest row keeps a token of its own
    new_ids, new_mask = prefix_first(ids, mask, 3)
    assert new_ids.tolist() == [[7, 8, 9, pad, pad, 5], [7, 8, 9, 3, 4, 6], [7, 8, 9, pad, 1, 2]]
    assert new_mask.tolist() == [[1, 1, 1, 0, 0, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1]]
    real = lambda m, p: p[m.bool()].tolist()  # noqa: E731
    for r in range(3):  # each real token keeps its position
        assert real(new_mask[r], position_ids_from_mask(new_mask)[r]) == real(mask[r], position_ids_from_mask(mask)[r])
    right_padded = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert common_prefix_length(torch.ones(2, 3, dtype=torch.long), right_padded) == 0
    assert common_prefix_length(torch.tensor([[4, 5, 6], [4, 5, 7]]), torch.ones(2, 3, dtype=torch.long)) == 2
    assert common_prefix_length(torch.tensor([[4, 5, 6], [3, 5, 6]]), torch.ones(2, 3, dtype=torch.long)) == 0


def test_rows_run_as_one_state_while_they_agree_and_split_when_their_draws_differ():
    """Groups of four identical prompts: at the first step rows 0-1 and 2-3 of each group draw different tokens (by
    their place in the batch, as independent draws may), after that every row takes its argmax. With sharing the model
    runs one row per group, then two per group (the states split, their caches copied), and the completions and every
    row's logits at every step equal those of the loop run on every row whole."""
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=7).eval()
    ids, mask = prompts(tok, ["hello there", "hi", "what is 2 + 2?"], 4)
    eos = tok.eos_token_id
    vocab = model.config.vocab_size

    def run(share):
        seen, shapes = [], []

        def choose(seqs, logits, owner):
            seqs, logits = seqs[owner], logits[owner]  # one per row
            seen.append(logits.clone())
            if len(seen) == 1:  # the first step: the pair (0, 1) of a group draws one token, the pair (2, 3) another
                pair = (torch.arange(logits.shape[0]) // 2) % 2
                return torch.where(pair == 0, 5, 6 + (seqs[:, -1] % 3))
            scores = logits.clone()
            scores[:, eos] = float("-inf")  # no row ends: every state lives to the end
            return scores.argmax(-1)

        hook = model.model.register_forward_pre_hook(lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)),
                                                     with_kwargs=True)
        out = decode(model, ids, mask, max_new_tokens=5, eos_ids=[eos], pad_id=tok.pad_token_id, choose=choose,
                     group=4, share_prompt=share)
        hook.remove()
        return out, seen, shapes

    whole, whole_logits, whole_shapes = run(False)
    shared, shared_logits, shared_shapes = run(True)
    assert torch.equal(shared, whole)
    assert len(shared_logits) == len(whole_logits) == 5
    for a, b in zip(shared_logits, whole_logits):
        assert a.shape == b.shape == (12, vocab)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert [s[0] for s in whole_shapes[1:]] == [12] * 5
    assert [s[0] for s in shared_shapes if s[1] == 1] == [3, 6, 6, 6, 6]  # a group, then its two halves
    assert all(len(set(shared[i:i + 4, 0].tolist())) == 2 for i in range(0, 12, 4))  # each group's draws differed
