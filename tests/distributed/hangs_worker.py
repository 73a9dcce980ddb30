"""Worker for the two-process hang test: in the same two processes, one run after another,

- ``sync_none``: a judge that hangs on rank 1 only and a tool that hangs on rank 0 only: both ranks train on;
- ``async_none`` (max_staleness=1): an environment whose get_reward hangs on rank 1 only: both ranks train on;
- ``sync_stop``: the judge hangs on rank 1, reward_timeout_action='stop': both ranks stop, naming rank 1;
- ``async_stop``: rollout_func hangs on rank 0 (max_staleness=1): both ranks stop, naming rank 0;

each rank writes what it saw to OUT/rank<r>.pt. (The watchdog's stall under two processes: stall_worker.py.)"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from datasets import Dataset  # noqa: E402
from hang import Hang  # noqa: E402
from scripted_tools import ScriptedBackend, tokenizer  # noqa: E402
from tiny import tiny_model  # noqa: E402

from grpokit.bounds.user_calls import RunStopped  # noqa: E402
from grpokit.config import GRPOConfig  # noqa: E402
from grpokit.trainer import GRPOTrainer  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
BOUND = 0.5
STUCK = Hang(result=None, name="stuck")  # never released: the processes end with their runs


def judge(completions, **kw):
    """Hangs on rank 1; 0 for every row elsewhere."""
    if RANK == 1:
        STUCK()
    return [0.0] * len(completions)



def varied(completions, **kw):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [len(set(t)) / 8.0 for t in texts]


def wait_for_it(seconds: int) -> str:
    """Wait for something that never comes on rank 0.

    Args:
        seconds: how long to wait
    """
    if RANK == 0:
        STUCK()
    return "came"


class Slow:
    def reset(self, **row):
        return " Begin."

    def get_reward(self) -> float:
        if RANK == 1:
            STUCK()
        return 1.0


def stuck_rollout(prompts, trainer):
    if RANK == 0:
        STUCK()
    ids = [[5, 6]] * len(prompts)
    return {"prompt_ids": ids, "completion_ids": [[7, trainer.processing_class.eos_token_id]] * len(prompts),
            "logprobs": None}


def args(out: str, **kw) -> GRPOConfig:
    base = dict(output_dir=out, per_device_train_batch_size=4, num_generations=4, max_completion_length=200,
                max_steps=2, logging_steps=1, report_to="none", gradient_checkpointing=False, save_strategy="no",
                use_cpu=True, seed=0, disable_tqdm=True, learning_rate=1e-2, reward_timeout_s=BOUND,
                tool_timeout_s=BOUND)
    base.update(kw)
    return GRPOConfig(**base)


def dataset() -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Go {i}."}] for i in range(16)]})


def run(name: str, out: str, rewards, **kw) -> dict:
    tok = tokenizer()
    rollout_func = kw.pop("rollout_func", None)
    tools = kw.pop("tools", None)
    env = kw.pop("environment_factory", None)
    call = '<tool_call>{"name": "wait_for_it", "arguments": {"seconds": 5}}</tool_call>'
    trainer = GRPOTrainer(tiny_model(tok, max_positions=2048), rewards, args=args(os.path.join(out, name), **kw),
                          train_dataset=dataset(), processing_class=tok, tools=tools, environment_factory=env,
                          rollout_func=rollout_func,
                          rollout_backend=ScriptedBackend(tok, first=lambda i: call if tools else "Answer: 5"))
    result = {"stopped": None}
    try:
        trainer.train()
    except RunStopped as e:
        result["stopped"] = str(e)
    result["steps"] = trainer.state.global_step
    result["logs"] = [h for h in trainer.state.log_history if "reward" in h]
    result["weights"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return result


def main(out: str) -> None:
    seen = {
        "sync_none": run("sync_none", out, [varied, judge], tools=[wait_for_it]),
        "async_none": run("async_none", out, [varied], environment_factory=Slow, max_staleness=1),
        "sync_stop": run("sync_stop", out, [varied, judge], reward_timeout_action="stop"),
        "async_stop": run("async_stop", out, [varied], rollout_func=stuck_rollout, max_staleness=1),
    }
    torch.save(seen, os.path.join(out, f"rank{RANK}.pt"))
    print(f"rank {RANK}: the four runs are done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
    from grpokit.bounds.process_group import exit_process

    exit_process(0)  # the hung calls' daemon threads must not hold the process
