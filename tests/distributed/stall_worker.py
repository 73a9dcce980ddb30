"""Worker for the two-process stall test (tests/distributed/test_stall_two_ranks.py).

    python stall_worker.py OUT plain-then-stall     # launch 1: an uninterrupted run, then the stalled one
    python stall_worker.py OUT resume               # launch 2: the stalled run resumed from its checkpoint

Both runs train the tiny model for three steps on two ranks, sampling with grpokit's own generation (the global RNG,
so the RNG state a checkpoint holds decides the completions). ``plain``: to the end, writing each rank's weights and
logs to OUT/plain-rank<r>.pt. ``stall``: the same run with every bound off and a reward that hangs on rank 1 at
step 1; the watchdog (``stall_action="save_and_exit"``) saves a checkpoint and ends both processes with 124.
``resume``: from that checkpoint to the end, writing OUT/resume-rank<r>.pt."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from datasets import Dataset  # noqa: E402
from hang import Hang  # noqa: E402
from tiny import tiny_model, tiny_tokenizer  # noqa: E402

from grpokit.bounds.process_group import exit_process  # noqa: E402
from grpokit.config import GRPOConfig  # noqa: E402
from grpokit.trainer import GRPOTrainer  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
STALL_S = 4.0
STUCK = Hang(result=None, name="stuck")  # never released: the watchdog ends the process


def judge(completions, trainer_state, **kw):
    """Distinct characters of each reply (spread in every group); hangs on rank 1 at step 1 of the stalled run."""
    if judge.hang and RANK == 1 and trainer_state.global_step == 1:
        STUCK()
    return [len(set(c[-1]["content"])) / 8.0 for c in completions]


judge.hang = False


def run(name: str, out: str, **kw) -> GRPOTrainer:
    tok = tiny_tokenizer()
    args = GRPOConfig(output_dir=os.path.join(out, name), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=3, logging_steps=1, report_to="none",
                      gradient_checkpointing=False, save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                      learning_rate=1e-2, **kw)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Go {i}."}] for i in range(16)]})
    return GRPOTrainer(tiny_model(tok), judge, args=args, train_dataset=dataset, processing_class=tok)


def record(trainer: GRPOTrainer, path: str) -> None:
    torch.save({"weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
                "logs": [{k: v for k, v in h.items() if k not in ("step_time", "learning_rate_check")}
                         for h in trainer.state.log_history if "reward" in h],
                "steps": trainer.state.global_step}, path)


def main(out: str, mode: str) -> None:
    if mode == "resume":
        trainer = run("stall", out)
        trainer.train(resume_from_checkpoint=os.path.join(out, "stall", "checkpoint-1"))
        record(trainer, os.path.join(out, f"resume-rank{RANK}.pt"))
        return
    trainer = run("plain", out)
    trainer.train()
    record(trainer, os.path.join(out, f"plain-rank{RANK}.pt"))
    judge.hang = True
    run("stall", out, reward_timeout_s=None, stall_timeout_s=STALL_S, stall_action="save_and_exit").train()
    print(f"rank {RANK}: the stalled run returned, which it must not", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_process(0)
