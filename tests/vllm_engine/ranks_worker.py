"""One rank of asynchronous rollouts from vLLM's server on two training processes (test_engine_ranks.py runs it
under torchrun): ``ranks_worker.py URL OUT``. Writes ``OUT/rank<i>.json``: the size of every generation request
this rank's own client sent, the batches' staleness, which parameters trained, what the main process pushed, and
the engine/trainer gap of a fixed sequence once training ended."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.models import load_model, load_tokenizer
from grpokit.rollout.vllm_server import VLLMServerClient

PROMPTS = ["What is 3 + 4?", "Name a colour.", "Count to three.", "Say hello."]


def distinct_tokens(completions, **kwargs):
    return [float(len(set(c.split()))) for c in completions]


def score_in_turn(client: VLLMServerClient, ids: list[int], rank: int) -> torch.Tensor:
    """The engine's log-probs of ``ids``, once no rank generates: every rank's producer has stopped (the barrier after
    ``train()``; a rank that finished first would otherwise score while the other's producer still finishes a batch
    it generated ahead), and the ranks score one after the other. vLLM's CPU build with LoRA serving on (0.32) stops
    its engine when a request for prompt log-probs shares a step with a generation (its LoRA logits layer is handed
    the sampled rows' mapping for the prompt's rows: an einsum size mismatch)."""
    dist.barrier()
    served = None
    for turn in range(dist.get_world_size()):
        if turn == rank:
            served = torch.tensor(client.prompt_logprobs(ids))
        dist.barrier()
    return served


def main(url: str, out: Path) -> None:
    requests: list[int] = []
    generate = VLLMServerClient.generate

    def counting(client, prompts, sampling):
        requests.append(len(prompts))
        return generate(client, prompts, sampling)

    VLLMServerClient.generate = counting
    tok = load_tokenizer("smollm2-135m-instruct")
    model = load_model("smollm2-135m-instruct", dtype=torch.float32)
    args = GRPOConfig(output_dir=str(out / "run"), use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                      vllm_server_timeout=300, max_steps=3, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, learning_rate=1e-4, logging_steps=1, report_to="none",
                      save_strategy="no", gradient_checkpointing=False, seed=0, max_staleness=1,
                      use_cpu=True)
    trainer = GRPOTrainer(model=model, reward_funcs=distinct_tokens, args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    params = dict(trainer.model.named_parameters())
    rank = trainer.accelerator.process_index
    fixed = tok("The capital of France is Paris, and the capital of Italy is Rome.").input_ids
    served = score_in_turn(trainer.rollout.client, fixed, rank)
    with torch.no_grad():
        logps = trainer.model(input_ids=torch.tensor([fixed])).logits[0, :-1].float().log_softmax(-1)
    own = logps.gather(-1, torch.tensor(fixed[1:]).unsqueeze(-1)).squeeze(-1)
    result = {
        "rank": rank,
        "per_rank": trainer.rollout.per_rank,
        "requests": requests,
        "staleness": [h["sample/staleness_max"] for h in trainer.state.log_history if "sample/staleness_max" in h],
        "moved": sum(not torch.equal(params[n], b) for n, b in before.items()),
        "trainable": len(before),
        "checksum": float(sum(params[n].double().sum() for n in before)),
        "pushes": trainer.rollout.sync.version if trainer.rollout.sync is not None else None,
        "steps": trainer.state.global_step,
        "final_gap": float((served - own).abs().max()),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
