"""The multi-turn loop with scripted replies: the tool turn's tokens at exact positions in the completion and masked,
the model's tokens kept exactly, max_tool_calling_iterations, the length budget, and truncation."""

from __future__ import annotations

import torch
from tiny import tiny_tokenizer

from grpokit.rollout.base import Generation, PromptBatch, completion_mask_from_eos
from grpokit.tools import CHATML_TOOLS_TEMPLATE, ToolTurnTokens, run_tool_loop


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: first
        b: second
    """
    return a + b


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


class Scripted:
    """Replies by turn: turn t of every row is ``script(t, row)`` (text), tokenised, ending with EOS."""

    def __init__(self, tok, script, max_tokens=200):
        self.tok, self.script, self.turn, self.max_tokens = tok, script, 0, max_tokens
        self.prompts = []

    def encode(self, texts, max_new_tokens):
        rows = [self.tok(t, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id] for t in texts]
        rows = [r[:max_new_tokens] for r in rows]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.tok.pad_token_id)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
        mask, truncated = completion_mask_from_eos(ids, [self.tok.eos_token_id])
        return Generation(ids.masked_fill(mask == 0, self.tok.pad_token_id), mask, truncated)

    def __call__(self, prompts, max_new_tokens=None):
        self.prompts.append([r[m.bool()].tolist() for r, m in zip(prompts.ids, prompts.mask)])
        n = prompts.ids.shape[0]
        out = self.encode([self.script(self.turn, i) for i in range(n)], max_new_tokens or self.max_tokens)
        self.turn += 1
        return out


def setup(n=2):
    tok = tiny_tokenizer()
    tok.chat_template = CHATML_TOOLS_TEMPLATE
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+3?"}], tools=[add], tokenize=False,
                                     add_generation_prompt=True)
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]] * n)
    return tok, ids, PromptBatch(ids, torch.ones_like(ids))


def test_tool_turn_positions_masks_and_messages():
    tok, ids, prompts = setup()
    gen = Scripted(tok, lambda t, i: CALL if (t == 0 and i == 0) else "Answer: 5")
    first = gen(prompts)
    out = run_tool_loop(gen, prompts, first, tok, [{"add": add}] * 2, "hermes", [tok.eos_token_id], None, 300)
    reply1 = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    reply2 = tok("Answer: 5", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    suffix = ToolTurnTokens(tok, [tok.eos_token_id]).suffix([{"role": "tool", "name": "add", "content": "5"}])
    g = out.generation
    n0 = int(g.completion_mask[0].sum())
    assert g.completion_ids[0, :n0].tolist() == reply1 + suffix + reply2
    assert g.tool_mask[0, :n0].tolist() == [1] * len(reply1) + [0] * len(suffix) + [1] * len(reply2)
    assert g.completion_ids[1, :len(reply2)].tolist() == reply2 and g.tool_mask[1].sum() == g.tool_mask.shape[1]
    # the second turn's prompt was the first prompt + reply + tool turn, never re-tokenised
    assert gen.prompts[1] == [ids[0].tolist() + reply1 + suffix]
    assert out.calls == 1 and out.failures == 0
    assert [m["role"] for m in out.messages[0]] == ["assistant", "tool", "assistant"]
    assert out.messages[0][1] == {"role": "tool", "name": "add", "content": "5"}
    assert out.messages[0][0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert not g.is_truncated.any()


def test_max_iterations_and_failures_are_counted():
    tok, ids, prompts = setup(1)
    gen = Scripted(tok, lambda t, i: '<tool_call>{"name": "nope", "arguments": {}}</tool_call>')  # always calls
    out = run_tool_loop(gen, prompts, gen(prompts), tok, [{"add": add}], "hermes", [tok.eos_token_id], 2, 1000)
    assert gen.turn == 3 and out.calls == 2 and out.failures == 2  # 2 rounds of tools, 3 generations
    assert [m["role"] for m in out.messages[0]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert "Tool nope not found." in out.messages[0][1]["content"]


def test_the_budget_rolls_back_a_tool_turn_that_does_not_fit_and_cuts_replies():
    tok, ids, prompts = setup(1)
    gen = Scripted(tok, lambda t, i: CALL if t == 0 else "x" * 50)
    reply1 = len(tok(CALL, add_special_tokens=False)["input_ids"]) + 1
    out = run_tool_loop(gen, prompts, gen(prompts), tok, [{"add": add}], "hermes", [tok.eos_token_id], None,
                        max_completion_length=reply1 + 5)
    assert out.calls == 1 and gen.turn == 1  # the tool ran, its turn did not fit: no second generation
    assert [m["role"] for m in out.messages[0]] == ["assistant"] and int(out.generation.completion_mask.sum()) == reply1
    gen = Scripted(tok, lambda t, i: CALL if t == 0 else "x" * 50)
    suffix = len(ToolTurnTokens(tok, [tok.eos_token_id]).suffix([{"role": "tool", "name": "add", "content": "5"}]))
    limit = reply1 + suffix + 10
    out = run_tool_loop(gen, prompts, gen(prompts), tok, [{"add": add}], "hermes", [tok.eos_token_id], None, limit)
    assert int(out.generation.completion_mask.sum()) == limit and out.generation.is_truncated.all()
