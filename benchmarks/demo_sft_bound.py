"""How far supervised fine-tuning takes the demo's model on the demo's task, and how fast: a yardstick for the demo.

The demo trains SmolLM2-135M-Instruct by GRPO on the arithmetic task's training questions and measures greedy accuracy
on the 128 held-out ones. Supervised fine-tuning on the *right* answers of the same training questions, with the
demo's adapter (LoRA r 16 / alpha 32 on every linear layer), weights (bf16 on a CPU with bf16 units, else float32)
and learning rate, shows what the held-out accuracy can be after a given amount of CPU time when every answer is
handed to the model instead of sampled and scored. Two reply styles, the two a demo run settles on:

- ``short``:   ``Answer: 8``
- ``restate``: ``2 + 6 = 8. Answer: 8``

    python benchmarks/demo_sft_bound.py --style short --epochs 3
    python benchmarks/demo_sft_bound.py --style restate --epochs 3

Prints, after each epoch, the held-out greedy accuracy (95% Wilson interval) and the training seconds so far
(evaluations not counted). benchmarks/demo_recipe_search.md ("A supervised yardstick") holds what it measured.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STYLES = {
    "short": lambda a, op, b, answer: f"Answer: {answer}",
    "restate": lambda a, op, b, answer: f"{a} {op} {b} = {answer}. Answer: {answer}",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--style", choices=sorted(STYLES), default="short")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=5e-4, help="learning rate (default 5e-4, the demo's)")
    p.add_argument("--batch-size", type=int, default=32, help="questions per optimizer step (default 32)")
    p.add_argument("--seed", type=int, default=0, help="the task's seed (which questions are held out) and the "
                                                      "order of the training questions")
    a = p.parse_args()

    import torch
    from demo_probe import questions  # the operands back from a prompt
    from peft import get_peft_model

    from grpokit.cli import DEMO_SPEC
    from grpokit.evaluation import evaluate
    from grpokit.machine.cpu_features import cpu_dtype
    from grpokit.machine.threads import fit_torch_threads
    from grpokit.models import load_model, load_tokenizer, no_progress_bars
    from grpokit.run.job import lora_config
    from grpokit.tasks import get_task

    fit_torch_threads()
    torch.manual_seed(a.seed)
    task = get_task("arithmetic", seed=a.seed)
    with no_progress_bars():
        tok = load_tokenizer(DEMO_SPEC["model"])
        model = load_model(DEMO_SPEC["model"], dtype=cpu_dtype())
    model = get_peft_model(model, lora_config(DEMO_SPEC["lora"]))
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=a.lr)
    rows = [task.train_dataset[i] for i in range(len(task.train_dataset))]
    style = STYLES[a.style]

    def target(row) -> str:
        return style(*questions([row])[0], row["answer"])

    def held_out() -> str:
        model.eval()
        summary, _ = evaluate(model, tok, task.eval_dataset, task.reward_funcs, accuracy_reward=task.accuracy_reward,
                              max_new_tokens=DEMO_SPEC["eval"]["max_new_tokens"])
        model.train()
        lo, hi = summary["accuracy_ci95"]
        return f"{summary['accuracy']:.1%} ({lo:.1%}-{hi:.1%})"

    print(f"supervised, {a.style} replies, {len(rows)} training questions, {next(model.parameters()).dtype} weights, "
          f"lr {a.lr:g}, {a.batch_size} per step; before: {held_out()}", flush=True)
    order = random.Random(a.seed)
    trained = 0.0
    for epoch in range(1, a.epochs + 1):
        order.shuffle(rows)
        start = time.perf_counter()
        for i in range(0, len(rows), a.batch_size):
            batch = rows[i:i + a.batch_size]
            prompts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in batch]
            prompt_lens = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in prompts]
            side, tok.padding_side = tok.padding_side, "right"
            try:
                enc = tok([t + target(r) + tok.eos_token for t, r in zip(prompts, batch)], return_tensors="pt",
                          padding=True, add_special_tokens=False)
            finally:
                tok.padding_side = side
            labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
            for j, n in enumerate(prompt_lens):
                labels[j, :n] = -100
            loss = model(**enc, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        trained += time.perf_counter() - start
        print(f"epoch {epoch}: {trained:.0f} s of training, last loss {loss.item():.3f}, held-out {held_out()}",
              flush=True)


if __name__ == "__main__":
    main()
