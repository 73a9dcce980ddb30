"""Bad data and bad rewards: each a clear error naming what is wrong (the function and the row), or a documented
rule; never a silent zero."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch
from datasets import Dataset
from reliability_helpers import LoadGuard, chat_dataset, make_args, make_trainer, tiny_tokenizer
from runs import params_of

from grpokit.data import tokenize_prompts
from grpokit.rewards import RewardFunctionError, score_completions
from grpokit.trainer import GRPOTrainer

PROMPTS = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(4)]
COMPLETIONS = [[{"role": "assistant", "content": f"reply {i}"}] for i in range(4)]


def score(func, n=4):
    return score_completions([func], [None], prompts=PROMPTS[:n], completions=COMPLETIONS[:n],
                             completion_ids=[[1, 2]] * n, rows=[{"prompt": p, "answer": str(i)}
                                                                for i, p in enumerate(PROMPTS[:n])])


# -- datasets: rejected before a model is loaded -------------------------------------------------------------------
@pytest.mark.parametrize("dataset,message", [
    (Dataset.from_dict({"text": ["a", "b"]}), "train_dataset has no 'prompt' column (columns: text)"),
    (Dataset.from_dict({"prompt": []}), "train_dataset is empty"),
    ([], "train_dataset is empty"),
    ([{"question": "a"}], "train_dataset has no 'prompt' column (columns: question)"),
    (Dataset.from_dict({"prompt": ["only one"]}), "train_dataset has 1 prompts, fewer than the 2 prompts of one"),
], ids=["no_prompt_column", "empty", "empty_list", "list_without_prompt", "fewer_prompts_than_a_batch"])
def test_bad_datasets_fail_before_the_model_loads(monkeypatch, tmp_path, dataset, message):
    guard = LoadGuard(monkeypatch)
    with pytest.raises(ValueError) as e:
        GRPOTrainer("never-loaded", lambda completions, **k: [0.0] * len(completions),
                    args=make_args(tmp_path, per_device_train_batch_size=8), train_dataset=dataset)
    assert message in str(e.value)
    assert guard.calls == []


def test_a_prompt_of_the_wrong_type_is_named(tmp_path):
    ds = Dataset.from_dict({"prompt": [{"text": "not a prompt"}] * 4})
    trainer = make_trainer(tmp_path, dataset=ds, max_steps=1)
    with pytest.raises(ValueError, match="is neither a string nor a list of chat messages"):
        trainer.train()


# -- long prompts: left-truncated (documented in README "Reliability") ---------------------------------------------
def test_long_prompts_are_left_truncated():
    tok = tiny_tokenizer()
    text = "BEGIN " + "x" * 50 + " END"
    ids, mask, cut = tokenize_prompts([text, "short"], tok, 10, tok.pad_token_id, [False, False])
    assert cut == 1 and ids.shape == (2, 10)
    assert tok.decode(ids[0]) == text[-10:]  # the end of the prompt (the question) is what is kept
    assert mask[1].sum() == len("short") and mask[0].all()


def test_training_with_truncated_prompts_logs_the_fraction(tmp_path):
    ds = Dataset.from_dict({"prompt": ["word " * 40 + f"question {i}?" for i in range(8)]})
    trainer = make_trainer(tmp_path, dataset=ds, max_prompt_length=12, max_steps=2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "prompts/truncated_frac" in h]
    assert len(logs) == 2 and all(h["prompts/truncated_frac"] == 1.0 and math.isfinite(h["loss"]) for h in logs)


# -- reward functions ----------------------------------------------------------------------------------------------
def fails_on_row_2(prompts, completions, **kw):
    for p in prompts:
        if "2 + 2" in p[-1]["content"]:
            raise KeyError("no answer for this one")
    return [1.0] * len(completions)


def fails_on_batches(completions, **kw):
    if len(completions) > 1:
        raise MemoryError("batch too large")
    return [0.5]


async def async_fails_on_row_3(prompts, completions, **kw):
    await asyncio.sleep(0)
    if any("3 + 3" in p[-1]["content"] for p in prompts):
        raise ZeroDivisionError("division by zero")
    return [1.0] * len(completions)


@pytest.mark.parametrize("func,snippets", [
    (fails_on_row_2, ("reward function 'fails_on_row_2' raised KeyError", "on row 2 of 4", "What is 2 + 2?",
                      "reply 2")),
    (fails_on_batches, ("reward function 'fails_on_batches' raised MemoryError: batch too large",
                        "on the batch of 4 completions", "every row alone scores without error",
                        "first prompt 'What is 0 + 0?'")),
    (async_fails_on_row_3, ("reward function 'async_fails_on_row_3' raised ZeroDivisionError", "on row 3 of 4",
                            "What is 3 + 3?")),
], ids=["one_row", "whole_batch_only", "async"])
def test_a_raising_reward_names_the_function_and_the_row(func, snippets):
    with pytest.raises(RewardFunctionError) as e:
        score(func)
    missing = [s for s in snippets if s not in str(e.value)]
    assert not missing, str(e.value)
    assert isinstance(e.value, RuntimeError) and e.value.__cause__ is not None  # the original traceback is kept


BAD_RETURNS = [
    ("wrong_count", [1.0], ("returned 1 values for 4 completions", "one number (or None) per completion")),
    ("too_many", [1.0] * 5, ("returned 5 values for 4 completions",)),
    ("nan", [1.0, float("nan"), 0.0, 0.0], ("returned nan for row 1", "What is 1 + 1?", "must be finite",
                                            "return None")),
    ("inf", [1.0, 0.0, float("inf"), 0.0], ("returned inf for row 2", "must be finite")),
    ("minus_inf", np.array([0.0, 0.0, 0.0, -np.inf]), ("returned -inf for row 3",)),
    ("string", [1.0, "1.0", 0.0, 0.0], ("returned '1.0' (str) for row 1", "expected a number or None")),
    ("bool", [True, 0.0, 0.0, 0.0], ("returned True (bool) for row 0", "expected a number or None")),
    ("dict", [{"score": 1}, 0.0, 0.0, 0.0], ("returned {'score': 1} (dict) for row 0",)),
    ("nothing", None, ("returned NoneType; expected a list of 4 numbers",)),
    ("scalar", 1.0, ("returned float; expected a list of 4 numbers",)),
    ("nan_tensor", torch.tensor([0.0, 0.0, float("nan"), 1.0]), ("returned nan for row 2",)),
]


@pytest.mark.parametrize("case,value,snippets", BAD_RETURNS, ids=[b[0] for b in BAD_RETURNS])
def test_bad_reward_values_are_errors_naming_function_and_row(case, value, snippets):
    def bad_reward(completions, **kw):
        return value

    with pytest.raises(ValueError) as e:
        score(bad_reward)
    assert "reward function 'bad_reward'" in str(e.value)
    missing = [s for s in snippets if s not in str(e.value)]
    assert not missing, str(e.value)


@pytest.mark.parametrize("value", [
    [0.0, 1.0, 2.0, 3.0], (0.0, 1.0, 2.0, 3.0), np.arange(4.0), torch.arange(4.0), np.arange(4, dtype=np.float32),
    [torch.tensor(0.0), torch.tensor(1.0), np.float64(2.0), np.int64(3)], [0, 1, 2, 3],
], ids=["list", "tuple", "numpy", "tensor", "float32", "scalar_objects", "ints"])
def test_accepted_reward_containers(value):
    out = score(lambda completions, **kw: value)
    assert out[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_none_means_not_applicable_and_is_never_a_zero(tmp_path, caplog):
    """Documented rule: None leaves the function out of that row's reward; a row no function scores gets advantage
    0 (no gradient) and is left out of the logged mean, which is then absent rather than 0. Such rows are named in
    one warning (TRL's wording), with the first one's columns."""
    with caplog.at_level("WARNING", logger="grpokit"):
        out = score(lambda completions, **kw: [None, 1.0, None, 3.0])
    assert torch.isnan(out[0, 0]) and out[1, 0] == 1.0
    warned = [r.getMessage() for r in caplog.records if "returned None" in r.getMessage()]
    assert len(warned) == 1 and "All reward functions returned None for the following kwargs:" in warned[0]
    assert "answer='0'" in warned[0] and "'reply 0'" in warned[0] and "2 of 4 completions unscored" in warned[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpokit"):
        score(lambda completions, **kw: [0.0, 1.0, 2.0, 3.0])
    assert not caplog.records

    trainer = make_trainer(tmp_path, reward=lambda completions, **kw: [None] * len(completions), max_steps=2,
                           learning_rate=0.1)
    before = params_of(trainer.model)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) and "reward" not in h for h in logs)
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, before[n]), n  # nothing to learn from: the weights did not move


def test_a_raising_reward_stops_training_with_the_row(tmp_path):
    trainer = make_trainer(tmp_path, reward=fails_on_row_2, dataset=chat_dataset(4), shuffle_dataset=False,
                           per_device_train_batch_size=16, max_steps=1)
    with pytest.raises(RewardFunctionError) as e:
        trainer.train()
    assert "'fails_on_row_2'" in str(e.value) and "on row 8 of 16" in str(e.value)  # rows 8-11: prompt 2's group
