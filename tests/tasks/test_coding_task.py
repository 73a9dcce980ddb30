"""The built-in coding task: its problems, their tests (every reference solution passes them, a wrong one does not),
the held-out split, and its reward through the sandbox."""

import random

import pytest

from grpokit.rewards import CodeExecution
from grpokit.tasks import get_task
from grpokit.tasks.coding import coding_problems


def test_every_reference_solution_passes_its_tests():
    rows = coding_problems()
    assert len(rows) == 275 and len({r["prompt"][0]["content"] for r in rows}) == 275
    for row in rows:
        namespace = {}
        exec(row["solution"], namespace)  # our own reference code, not a model's
        for test in row["tests"]:
            exec(test, namespace)
        assert 2 <= len(row["tests"]) <= 4 and row["function"] in row["prompt"][0]["content"]


def test_a_wrong_solution_fails_the_tests():
    for row in coding_problems():
        namespace = {}
        exec(f"def {row['function']}(*args):\n    return None", namespace)
        failed = 0
        for test in row["tests"]:
            try:
                exec(test, namespace)
            except AssertionError:
                failed += 1
        assert failed >= 1, row["function"]


def test_the_split_and_the_seed():
    task = get_task("coding", seed=3, n_eval=50)
    assert len(task.eval_dataset) == 50 and len(task.train_dataset) == 225
    train = {r["prompt"][0]["content"] for r in task.train_dataset}
    held = {r["prompt"][0]["content"] for r in task.eval_dataset}
    assert not train & held
    assert [r["function"] for r in get_task("coding", seed=3, n_eval=50).eval_dataset] == list(task.eval_dataset["function"])
    assert list(get_task("coding", seed=4, n_eval=50).eval_dataset["function"]) != list(task.eval_dataset["function"])
    (reward,) = task.reward_funcs
    assert isinstance(reward, CodeExecution) and task.accuracy_reward == "code_execution"
    with pytest.raises(ValueError, match="n_eval=275 leaves nothing to train on"):
        get_task("coding", n_eval=275)


def test_the_reward_on_reference_and_wrong_replies():
    task = get_task("coding", seed=0, n_eval=16, timeout_s=10)
    rows = random.Random(0).sample(list(task.eval_dataset), 6)
    right = [f"Here you go:\n```python\n{r['solution']}\n```" for r in rows]
    wrong = [f"```python\ndef {r['function']}(*args):\n    return None\n```" for r in rows]
    (reward,) = task.reward_funcs
    scores = reward(prompts=[r["prompt"] for r in rows] * 2, completions=right + wrong, tests=[r["tests"] for r in rows] * 2)
    assert scores[:6] == [1.0] * 6 and all(s < 1.0 for s in scores[6:])
