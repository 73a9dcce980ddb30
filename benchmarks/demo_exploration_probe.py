"""Which arithmetic questions can a trained demo model still learn from its own samples? For a run's saved adapter:
the greedy accuracy on the first ``--n`` training questions, then each question answered wrong sampled ``--samples``
times the way the demo samples (temperature 0.9 among the 50 likeliest tokens, or ``--temperature``), counting the
right answers. A question that never draws one gives a group whose completions all score alike: no advantage, nothing
for GRPO to learn from it (docs/demo.md, "What holds the plateau").

    python benchmarks/demo_exploration_probe.py runs/demo/final                      # ~1 min on a 2-core CPU
    python benchmarks/demo_exploration_probe.py runs/demo/final --temperature 1.3 --n 64

Prints one line per wrong question (its answer, the right samples, the distinct replies) and a summary line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("adapter", help="a run's final/ directory (a LoRA adapter on its base model) or a model")
    ap.add_argument("--n", type=int, default=256, help="training questions answered greedily")
    ap.add_argument("--samples", type=int, default=16, help="samples per question answered wrong")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0, help="the task's seed (which questions are training questions)")
    ns = ap.parse_args()
    sys.path.insert(0, str(ROOT))

    import torch

    from grpokit.cli import _load_for_eval
    from grpokit.evaluation import evaluate
    from grpokit.rewards.builtin import correctness
    from grpokit.tasks.arithmetic import make_arithmetic_task

    task = make_arithmetic_task(seed=ns.seed)
    model, tok = _load_for_eval(ns.adapter, None)
    rows = task.train_dataset.select(range(min(ns.n, len(task.train_dataset))))
    summary, samples = evaluate(model, tok, rows, task.reward_funcs, accuracy_reward=task.accuracy_reward,
                                max_new_tokens=32, num_samples=len(rows), batch_size=128)
    wrong = [rows[i] for i, s in enumerate(samples) if not s["correct"]]
    print(f"greedy: {summary['accuracy']:.1%} right on {len(rows)} training questions; {len(wrong)} wrong")
    torch.manual_seed(ns.seed)
    tok.padding_side = "left"
    hits = []
    for row in wrong:
        text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        enc = tok([text] * ns.samples, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=ns.temperature, top_k=ns.top_k, max_new_tokens=32,
                                 pad_token_id=tok.pad_token_id)
        replies = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        right = int(sum(correctness(completions=replies, answer=[row["answer"]] * len(replies))))
        hits.append(right)
        question = row["prompt"][-1]["content"].split("?")[0]
        print(f"  {question}? = {row['answer']}: {right}/{ns.samples} right; replies {sorted(set(replies))[:4]}")
    if hits:
        print(f"sampled at temperature {ns.temperature} (top-k {ns.top_k}), {ns.samples} each: "
              f"{sum(hits) / (len(hits) * ns.samples):.1%} right; {sum(h == 0 for h in hits)} of {len(hits)} "
              "questions never right")


if __name__ == "__main__":
    main()
