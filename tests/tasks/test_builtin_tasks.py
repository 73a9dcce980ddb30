"""Built-in tasks: sizes, disjointness, determinism, prompts, and that their rewards grade them."""

from __future__ import annotations

import re

import pytest

from grpokit.rewards import correctness, format_reward, length, word_count
from grpokit.tasks import ANSWER_INSTRUCTION, Task, arithmetic_questions, get_task, list_tasks


def contents(dataset) -> list[str]:
    return [p[-1]["content"] for p in dataset["prompt"]]


def test_list_tasks():
    assert list_tasks() == ["arithmetic", "calculator", "coding", "shapes", "word_count", "word_problems"]


@pytest.mark.parametrize("name", ["arithmetic", "word_problems", "word_count"])
def test_common_shape(name):
    task = get_task(name, seed=0, n_eval=16)
    assert isinstance(task, Task)
    assert task.name == name
    assert len(task.eval_dataset) == 16
    for dataset in (task.train_dataset, task.eval_dataset):
        assert {"prompt", "answer"} <= set(dataset.column_names)
        row = dataset[0]
        assert row["prompt"] == [{"role": "user", "content": row["prompt"][0]["content"]}]
        assert isinstance(row["answer"], str)
    assert task.accuracy_reward in task.reward_names
    assert task.description
    train, held_out = set(contents(task.train_dataset)), set(contents(task.eval_dataset))
    assert not train & held_out
    assert len(train) == len(task.train_dataset)  # no duplicate prompts


def test_arithmetic_exactly_as_in_demo_notes():
    questions = arithmetic_questions()
    assert len(questions) == 651
    assert len({(a, op, b) for a, op, b, _ in questions}) == 651
    for a, op, b, result in questions:
        assert 0 <= a <= 20 and 0 <= b <= 20
        assert result == (a + b if op == "+" else a - b)
        if op == "-":
            assert a >= b
    task = get_task("arithmetic")
    assert (len(task.train_dataset), len(task.eval_dataset)) == (523, 128)
    assert task.reward_funcs == [correctness, format_reward]
    assert task.accuracy_reward == "correctness"
    pattern = re.compile(r"What is (\d+) ([+-]) (\d+)\? End your reply with the line 'Answer: <number>'\.")
    for row in task.eval_dataset:
        m = pattern.fullmatch(row["prompt"][0]["content"])
        assert m, row
        a, op, b = int(m[1]), m[2], int(m[3])
        assert row["answer"] == str(a + b if op == "+" else a - b)
    everything = contents(task.train_dataset) + contents(task.eval_dataset)
    assert len(set(everything)) == 651


def test_seed_determinism():
    for name in ["arithmetic", "word_problems", "word_count"]:
        a = get_task(name, seed=3, n_eval=32)
        b = get_task(name, seed=3, n_eval=32)
        c = get_task(name, seed=4, n_eval=32)
        assert a.train_dataset.to_list() == b.train_dataset.to_list()
        assert a.eval_dataset.to_list() == b.eval_dataset.to_list()
        assert a.eval_dataset.to_list() != c.eval_dataset.to_list()


def test_arithmetic_same_questions_any_seed():
    a, b = get_task("arithmetic", seed=0), get_task("arithmetic", seed=1)
    all_a = set(contents(a.train_dataset) + contents(a.eval_dataset))
    all_b = set(contents(b.train_dataset) + contents(b.eval_dataset))
    assert all_a == all_b


@pytest.mark.parametrize("n_eval", [-1, 651, 1000, 1.5])
def test_arithmetic_bad_n_eval(n_eval):
    with pytest.raises(ValueError, match="n_eval"):
        get_task("arithmetic", n_eval=n_eval)


def test_n_eval_zero():
    task = get_task("arithmetic", n_eval=0)
    assert len(task.eval_dataset) == 0 and len(task.train_dataset) == 651
    assert task.eval_dataset.features == task.train_dataset.features


def test_word_problems():
    task = get_task("word_problems", seed=0, n_eval=64, n_train=300)
    assert (len(task.train_dataset), len(task.eval_dataset)) == (300, 64)
    assert task.reward_funcs == [correctness, format_reward]
    for row in task.train_dataset.select(range(50)):
        text = row["prompt"][0]["content"]
        assert text.endswith(ANSWER_INSTRUCTION)
        assert int(row["answer"]) >= 0
    # a right reply earns the full reward, through the task's own reward functions
    rows = task.eval_dataset.select(range(8))
    completions = [[{"role": "assistant", "content": f"Working.\nAnswer: {a}"}] for a in rows["answer"]]
    per_func = [f(prompts=rows["prompt"], completions=completions, answer=rows["answer"]) for f in task.reward_funcs]
    total = [sum(values) for values in zip(*per_func, strict=True)]
    assert total == [pytest.approx(1.2)] * 8
    with pytest.raises(ValueError, match="n_train"):
        get_task("word_problems", n_train=0)


def test_word_problems_answers_are_right():
    """Re-derive every template's answer from the numbers in its text, in the order they appear."""
    import random

    from grpokit.tasks import word_problems as wp

    formulas = {
        wp._add: lambda n: n[0] + n[1],
        wp._sub: lambda n: n[0] - n[1],
        wp._mul: lambda n: n[0] * n[1],
        wp._div: lambda n: n[0] // n[1],
        wp._difference: lambda n: n[0] - n[1],
        wp._add_sub: lambda n: n[0] + n[1] - n[2],
        wp._together: lambda n: 2 * n[0] + n[1],
        wp._mul_add: lambda n: n[0] + n[1] * n[2],
        wp._mul_sub: lambda n: n[0] * n[1] - n[2],
        wp._sub_sub: lambda n: n[0] - n[1] - n[2],
    }
    assert set(formulas) == set(wp.TEMPLATES)
    rng = random.Random(0)
    for template, formula in formulas.items():
        for _ in range(50):
            question, answer = template(rng, "Tom", "Anna", "Ben", "apples")
            numbers = [int(x) for x in re.findall(r"\d+", question)]
            assert answer == formula(numbers) and answer >= 0, question
            if template is wp._div:
                assert numbers[0] % numbers[1] == 0, question


def test_word_count_task():
    task = get_task("word_count", seed=0)
    assert len(task.train_dataset) + len(task.eval_dataset) == 550
    assert task.reward_funcs == [word_count, length]
    assert task.accuracy_reward == "word_count"
    row = task.eval_dataset[0]
    n = row["target_words"]
    assert f"exactly {n} words" in row["prompt"][0]["content"]
    assert row["answer"] == str(n)
    exact = " ".join(["word"] * n)
    assert word_count(completions=[exact], target_words=[n]) == [1.0]
    assert get_task("format").name == "word_count"  # alias


def test_unknown_task_and_options():
    with pytest.raises(ValueError, match="arithmetic.*word_count.*word_problems"):
        get_task("gsm9k")
    with pytest.raises(ValueError, match="does not exist"):
        get_task("missing_file.jsonl")
    with pytest.raises(ValueError, match="n_train"):
        get_task("arithmetic", n_train=5)


def test_arithmetic_easy_first_orders_only_the_training_questions():
    shuffled, curriculum = get_task("arithmetic", seed=2), get_task("arithmetic", seed=2, order="easy_first")
    assert curriculum.eval_dataset.to_list() == shuffled.eval_dataset.to_list()
    assert sorted(contents(curriculum.train_dataset)) == sorted(contents(shuffled.train_dataset))
    operands = [tuple(int(x) for x in re.findall(r"\d+", text)[:2]) for text in contents(curriculum.train_dataset)]
    levels = [max(pair) for pair in operands]
    assert levels == sorted(levels) and levels[0] < 3 and levels[-1] == 20
    first_level = [text for text in contents(shuffled.train_dataset)
                   if max(int(x) for x in re.findall(r"\d+", text)[:2]) == levels[0]]
    assert contents(curriculum.train_dataset)[:len(first_level)] == first_level  # the seed's order within a level
    with pytest.raises(ValueError, match="order='hardest' is not allowed: expected one of shuffled, easy_first"):
        get_task("arithmetic", order="hardest")


def test_arithmetic_instruction_first_asks_the_same_questions_with_the_question_last():
    """The same questions, answers and split; each user turn the instruction then the question, so that prompts share
    all but their last tokens (what grpokit encodes once for all of them)."""
    plain, first = get_task("arithmetic", seed=1), get_task("arithmetic", seed=1, instruction_first=True)
    for a, b in [(plain.train_dataset, first.train_dataset), (plain.eval_dataset, first.eval_dataset)]:
        assert a["answer"] == b["answer"]
        for p, f in zip(contents(a), contents(b)):
            question, instruction = p.split("? ", 1)
            assert f == f"{instruction} {question}?" and f.startswith(ANSWER_INSTRUCTION)
    assert first.metadata["instruction_first"] is True
    with pytest.raises(ValueError, match="instruction_first='yes' is not allowed: expected true or false"):
        get_task("arithmetic", instruction_first="yes")
