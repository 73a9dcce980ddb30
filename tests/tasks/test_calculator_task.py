"""The calculator task: distinct questions, held-out rows disjoint from training, worked exchanges that render
through the task's template as real tool calls and results, tools that compute, and bad options refused."""

from __future__ import annotations

import pytest
from tiny import tiny_tokenizer

from grpokit.rewards import correctness
from grpokit.tasks import get_task
from grpokit.tasks.calculator import add, multiply, subtract
from grpokit.tools import MultiTurn


def test_questions_answers_and_split():
    task = get_task("calculator", seed=1, n_eval=32, n_train=200, n_demos=2)
    assert len(task.train_dataset) == 200 and len(task.eval_dataset) == 32
    questions = [p[-1]["content"] for d in (task.train_dataset, task.eval_dataset) for p in d["prompt"]]
    assert len(set(questions)) == len(questions)
    for row in task.train_dataset.select(range(20)):
        a, op, b = row["prompt"][-1]["content"].removeprefix("What is ").removesuffix("?").split()
        assert int(row["answer"]) == {"*": int(a) * int(b), "+": int(a) + int(b), "-": int(a) - int(b)}[op]
        assert len(row["prompt"]) == 2 * 4 + 1
    again = get_task("calculator", seed=1, n_eval=32, n_train=200, n_demos=2)
    assert again.train_dataset["prompt"] == task.train_dataset["prompt"]  # the seed decides everything
    assert multiply(12, 34) == 408 and add(12, 34) == 46 and subtract(12, 34) == -22
    assert {p[-1]["content"].split()[3] for p in task.train_dataset["prompt"]} == {"*", "+", "-"}
    demo_tools = {m["tool_calls"][0]["function"]["name"] for p in task.train_dataset["prompt"] for m in p[:-1]
                  if m["role"] == "assistant" and m["tool_calls"]}
    assert demo_tools == {"multiply"}  # by default the worked exchanges show only multiply


def test_prompts_render_the_worked_exchanges_as_tool_turns():
    task = get_task("calculator", n_eval=4, n_train=8, n_demos=2, ops="*+", demo_ops="*+")
    tok = tiny_tokenizer()
    tok.chat_template = task.chat_template
    MultiTurn(task.tools, None, 2).check_template(tok)
    row = task.train_dataset[0]
    text = tok.apply_chat_template(row["prompt"], tools=task.tools, tokenize=False, add_generation_prompt=True)
    demo_call = row["prompt"][1]["tool_calls"][0]["function"]
    args = demo_call["arguments"]
    assert (f'<tool_call>{{"name": "{demo_call["name"]}", "arguments": {{"a": {args["a"]}, "b": {args["b"]}}}}}'
            "</tool_call>") in text
    assert f"<tool_response>\n{row['prompt'][2]['content']}\n</tool_response>" in text
    assert '"name": "multiply"' in text and '"name": "add"' in text  # the tools of these operators described
    assert '"name": "subtract"' not in text
    names = [row["prompt"][k]["tool_calls"][0]["function"]["name"] for k in (1, 5)]
    assert names == ["multiply", "add"]  # the worked exchanges cycle through the operators


def test_the_answer_after_the_tool_turn_is_graded():
    task = get_task("calculator", n_eval=4, n_train=8)
    row = task.eval_dataset[0]
    messages = [{"role": "assistant", "content": "", "tool_calls": []}, {"role": "tool", "content": row["answer"]},
                {"role": "assistant", "content": f"Answer: {row['answer']}"}]
    assert correctness(completions=[messages, messages[:2]], answer=[row["answer"]] * 2) == [1.0, 0.0]


@pytest.mark.parametrize("kw,message", [({"ops": "/"}, "ops='/' is not allowed"), ({"n_demos": -1}, "n_demos=-1"),
                                        ({"n_train": 0}, "n_train=0")])
def test_bad_options(kw, message):
    with pytest.raises(ValueError, match=message):
        get_task("calculator", **kw)
