"""What a demo model knows of arithmetic, beyond its greedy accuracy: on the 128 held-out questions of the demo's task,

- ``framed``: greedy accuracy when the reply is started for the model (``"14 - 12 = "``, ``"14 - 12 equals "``,
  ``"Answer: "``), 4 new tokens: the arithmetic the model can do whatever format it learned to reply in;
- ``pass@k``: ``k`` completions per question sampled at temperature ``T`` (the whole vocabulary): the share of
  questions with at least one right answer (a GRPO group of ``k`` can only teach what it samples), the sampled
  accuracy, and how many of the questions greedy gets wrong have a right sample.

    python benchmarks/demo_probe.py smollm2-135m-instruct                 # the base model
    python benchmarks/demo_probe.py runs/demo/final --k 8 --temperature 1.0   # a demo's trained adapter

benchmarks/demo_recipe_search.md holds what it measured.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FRAMES = {
    "a op b = ": lambda a, op, b: f"{a} {op} {b} = ",
    "a op b equals ": lambda a, op, b: f"{a} {op} {b} equals ",
    "Answer: ": lambda a, op, b: "Answer: ",
}


def questions(rows) -> list[tuple[str, str, str]]:
    out = []
    for r in rows:
        m = re.search(r"What is (\d+) ([+-]) (\d+)\?", r["prompt"][-1]["content"])
        out.append((m.group(1), m.group(2), m.group(3)))
    return out


def framed_accuracy(model, tok, rows, frame) -> tuple[float, dict[str, int]]:
    """Greedy accuracy with the reply started by ``frame``; the wrong answers counted by operation."""
    import torch

    asked = questions(rows)
    texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) + frame(a, op, b)
             for r, (a, op, b) in zip(rows, asked)]
    side, tok.padding_side = tok.padding_side, "left"
    try:
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tok.padding_side = side
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    replies = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    wrong = {"+": 0, "-": 0}
    right = 0
    for reply, r, (_, op, _) in zip(replies, rows, asked):
        m = re.match(r"\s*(\d+)", reply)
        if m and m.group(1) == r["answer"]:
            right += 1
        else:
            wrong[op] += 1
    return right / len(rows), wrong


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a model (smollm2-135m-instruct) or a run's final/ adapter")
    p.add_argument("--k", type=int, default=8, help="completions sampled per question (default 8)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--n", type=int, default=128, help="held-out questions (default 128)")
    a = p.parse_args()

    from datasets import Dataset

    from grpokit.cli import _load_for_eval
    from grpokit.evaluation import evaluate
    from grpokit.machine.threads import fit_torch_threads
    from grpokit.tasks import get_task

    fit_torch_threads()
    task = get_task("arithmetic")
    model, tok = _load_for_eval(a.model, None)
    rows = [task.eval_dataset[i] for i in range(a.n)]
    for name, frame in FRAMES.items():
        acc, wrong = framed_accuracy(model, tok, rows, frame)
        print(f"framed {name!r:18s} {acc:6.1%}  (wrong: {wrong['+']} sums, {wrong['-']} differences)", flush=True)
    kw = dict(accuracy_reward=task.accuracy_reward, max_new_tokens=48)
    greedy_summary, greedy = evaluate(model, tok, Dataset.from_list(rows), task.reward_funcs, greedy=True,
                                      num_samples=len(rows), **kw)
    repeated = Dataset.from_list([r for r in rows for _ in range(a.k)])
    sampled_summary, sampled = evaluate(model, tok, repeated, task.reward_funcs, greedy=False,
                                        temperature=a.temperature, num_samples=len(repeated), **kw)
    hits = [sum(bool(sampled[i * a.k + j]["correct"]) for j in range(a.k)) for i in range(len(rows))]
    wrong_greedy = [i for i, s in enumerate(greedy) if not s["correct"]]
    print(f"greedy {greedy_summary['accuracy']:.1%} | sampled at T {a.temperature}: accuracy "
          f"{sampled_summary['accuracy']:.1%}, pass@{a.k} {sum(h > 0 for h in hits) / len(rows):.1%} | of the "
          f"{len(wrong_greedy)} questions greedy gets wrong, {sum(hits[i] > 0 for i in wrong_greedy)} have a right "
          "sample")
    for i in wrong_greedy[:10]:
        print(f"  {greedy[i]['prompt'][:16]!r} expected {greedy[i]['answer']}: {greedy[i]['completion'][:40]!r} "
              f"({hits[i]}/{a.k} samples right)")


if __name__ == "__main__":
    main()
