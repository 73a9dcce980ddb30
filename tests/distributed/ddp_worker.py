"""Worker for the multi-process tests: trains a tiny model for two optimizer steps with a rollout backend whose
completions depend only on (generation call, global row), so any split over ranks sees the same data.

Run under ``torchrun --nproc_per_node N`` or in-process (one rank). Writes, per loss type, the final parameters,
the advantages and completions of every generation batch to ``OUT/<loss>-rank<r>.pt``.

    python ddp_worker.py OUT PER_DEVICE GA LOSS[,LOSS...] [--fail-rank R] [--num-generations G]
                         [--shard fsdp2|zero3] [--real-rollout] [--no-gather] [--fake-vllm-server]
                         [--top-entropy Q] [--lora] [--adamw] [--save-steps] [--resume CHECKPOINT] [--moe] [--workers]
                         [++ OUT PER_DEVICE GA LOSS[,LOSS...] [flags] ...]

``++`` separates runs made one after another by the same processes (one launch, ~10 s of imports, for several).

``--shard``: train with sharded weights. accelerate enables FSDP only on accelerators, so on CPU the worker
sets accelerate's state to FSDP itself (after which accelerate's own FSDP2 wrapping runs, on gloo), with the
plugin read from the launcher's environment when there is one (tests pass examples/accelerate/fsdp2.yaml's); ZeRO-3
goes through transformers' ``deepspeed`` argument (DeepSpeed runs on CPU with gloo). ``--real-rollout``:
sample with transformers ``generate`` (seeded), stopping at any of 60 token ids so that rows, and ranks, end
at different lengths. ``--no-gather``: ``ds3_gather_for_generation=False`` (generation in lockstep on shards).
``--fake-vllm-server``: ``use_vllm=True, vllm_mode="server"`` with :class:`FakeServer` in place of TRL's client.
``--lora``: a PEFT LoRA adapter (r 4 on q/v, initialised non-zero so merging it for generation changes tokens).
``--workers``: one rollout worker process per rank (``rollout_workers=1``, ``max_staleness=1``, the default rollout
backend); each rank records the prompts of every batch it trains on and its weights' sum after every step.
``--adamw``: AdamW (lr 0.01) instead of plain SGD, so the optimizer has state to checkpoint. ``--save-steps``: a
checkpoint after every step. ``--resume CHECKPOINT``: resume from it. ``--moe``: a tiny Qwen3-MoE policy with
``routing_replay="rollout"``, sampled with its routers perturbed (``tiny_moe.ShiftedRouters``); each rank counts the
recorded tokens whose training forward did not use the recorded experts (``moe``: taps, violations, re-routed).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from datasets import Dataset  # noqa: E402
from tiny import tiny_model, tiny_tokenizer  # noqa: E402
from tiny_moe import ShiftedRouters, tiny_moe_model  # noqa: E402

from grpokit.bounds.process_group import exit_process  # noqa: E402
from grpokit.config import GRPOConfig  # noqa: E402
from grpokit.forward.sharding import full_weights, sharding_kind  # noqa: E402
from grpokit.rollout.base import Generation, completion_mask_from_eos  # noqa: E402
from grpokit.trainer import GRPOTrainer  # noqa: E402

COMPLETION_LEN = 8
# FSDP configured by the launcher's environment (read at start: transformers sets ACCELERATE_USE_FSDP itself later)
FSDP_FROM_LAUNCHER = os.environ.get("ACCELERATE_USE_FSDP") == "true" and "FSDP_VERSION" in os.environ
STOP_IDS = list(range(100, 160))  # ~23% of the tiny vocabulary: rows end after a few tokens, or run to the limit


def rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class GlobalRowRollout:
    """Completions are a pure function of (call number, global row index)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = 0

    def generate(self, model, prompt_ids, prompt_mask, params):
        rank, _ = rank_and_world()
        n = prompt_ids.shape[0]
        rows = []
        for i in range(n):
            g = torch.Generator().manual_seed(1000 * self.calls + rank * n + i)
            ids = torch.randint(10, len(self.tokenizer), (COMPLETION_LEN,), generator=g)
            stop = int(torch.randint(2, COMPLETION_LEN + 2, (1,), generator=g))
            if stop < COMPLETION_LEN:
                ids[stop] = self.tokenizer.eos_token_id
            rows.append(ids)
        self.calls += 1
        ids = torch.stack(rows)
        mask, truncated = completion_mask_from_eos(ids, [self.tokenizer.eos_token_id])
        return Generation(ids.masked_fill(mask == 0, self.tokenizer.pad_token_id), mask, truncated)

    def sync_weights(self, model, step=None):
        pass


class FakeServer:
    """TRL's VLLMClient surface. A completion is a function of its prompt and of how many times that prompt came
    before it in the request, so a request holding the whole generation batch gives the same rows however the
    batch is split over ranks (and a group's rows differ)."""

    def __init__(self):
        self.requests, self.pushed, self.resets = [], {}, 0

    def generate(self, prompts, n, generation_kwargs=None, **sampling):
        self.requests.append([list(p) for p in prompts])
        seen: dict[tuple, int] = {}
        completions = []
        for p in prompts:
            k = seen[tuple(p)] = seen.get(tuple(p), -1) + 1
            length = 1 + (sum(p) + 3 * k) % COMPLETION_LEN
            completions.append([10 + (sum(p) * 7 + 11 * k + j) % 200 for j in range(length)])
        return {"completion_ids": completions, "logprobs": [[[-1.0 - 0.1 * j] for j in range(len(c))]
                                                            for c in completions]}

    def update_named_param(self, name, tensor):
        self.pushed[name] = tensor.detach().clone()

    def reset_prefix_cache(self):
        self.resets += 1


def moe_replay_counts(moe: bool) -> dict | None:
    """With ``moe``, every training forward's routing tap checked when it closes: how many closed, how many recorded
    tokens used other experts than recorded (must be 0), how many the router alone would have re-routed."""
    if not moe:
        return None
    import grpokit.moe.training as moe_training
    from grpokit.moe import RouteTap

    counts = {"taps": 0, "violations": 0, "rerouted": 0}

    class Checked(RouteTap):
        def __exit__(self, *exc):
            super().__exit__(*exc)
            recorded = (self.forced != 255).all(-1).all(-1)
            counts["taps"] += 1
            for layer, used in enumerate(self.used):
                want = self.forced[recorded, layer].long().sort(-1).values
                counts["violations"] += int((used[recorded].long().sort(-1).values != want).any(-1).sum())
            counts["rerouted"] += int(torch.stack(self.differs, 1)[recorded].any(1).sum())

    moe_training.RouteTap = Checked
    return counts


def reward(completions, **kw):
    return [len(set(c[0]["content"])) / 8.0 for c in completions]


def failing_reward(fail_rank):
    def boom(completions, **kw):
        if rank_and_world()[0] == fail_rank:
            raise RuntimeError(f"deliberate failure on rank {fail_rank}")
        return reward(completions)

    return boom


class CpuFSDPTrainer(GRPOTrainer):
    """accelerate turns FSDP on only for accelerator devices; on CPU, set its state to FSDP ourselves."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        from_launcher = FSDP_FROM_LAUNCHER
        if self.args.fsdp_plugin_args is not None or from_launcher:
            from accelerate.state import PartialState
            from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

            state = self.accelerator.state
            state.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # AcceleratorState() copies it
            kwargs = {} if from_launcher else self.args.fsdp_plugin_args  # the plugin reads the launcher's env
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**kwargs)
            self.is_fsdp_enabled = True


def shard_args(shard: str | None) -> dict:
    if shard == "fsdp2" and FSDP_FROM_LAUNCHER:
        return {}  # configured by the launcher's environment (examples/accelerate/fsdp2.yaml)
    if shard == "fsdp2":
        return dict(fsdp="full_shard", fsdp_config={"version": 2, "reshard_after_forward": True,
                                                    "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    if shard == "zero3":
        from deepspeed_cpu import skip_inference_shm_build

        skip_inference_shm_build()
        return dict(deepspeed={
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # shard even tiny tensors
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
        })
    return {}


def run(out_dir: str, per_device: int, ga: int, loss_types: list[str], fail_rank: int | None = None,
        num_generations: int = 4, shard: str | None = None, real_rollout: bool = False, gather: bool = True,
        fake_server: bool = False, top_entropy: float = 1.0, lora: bool = False, adamw: bool = False,
        save_steps: bool = False, resume: str | None = None, moe: bool = False, workers: bool = False) -> None:
    tok = tiny_tokenizer()
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i} + {i}"}] for i in range(32)]})
    servers = []
    if fake_server:
        from grpokit.rollout.vllm_backend import VLLMRollout

        def make_client(args, model_name_or_path):
            servers.append(FakeServer())
            return servers[-1]

        VLLMRollout._make_client = staticmethod(make_client)
    for loss_type in loss_types:
        model = tiny_model(tok, seed=7) if not moe else tiny_moe_model("qwen3_moe", tok, seed=7)
        replay = moe_replay_counts(moe)
        args = GRPOConfig(
            output_dir=os.path.join(out_dir, f"run-{loss_type}"), per_device_train_batch_size=per_device,
            gradient_accumulation_steps=ga, num_generations=num_generations, max_completion_length=COMPLETION_LEN,
            max_steps=2, loss_type=loss_type, optim="adamw_torch" if adamw else "sgd",
            learning_rate=0.01 if adamw else 0.5, max_grad_norm=0.0,
            logging_steps=1, save_strategy="steps" if save_steps else "no", save_steps=1, report_to="none",
            use_cpu=True, shuffle_dataset=False,
            gradient_checkpointing=False, disable_tqdm=True, seed=0, ddp_timeout=1800,
            ds3_gather_for_generation=gather, temperature=1.0, top_entropy_quantile=top_entropy,
            generation_kwargs={"eos_token_id": STOP_IDS} if real_rollout else None, **shard_args(shard),
            **(dict(use_vllm=True, vllm_mode="server") if fake_server else {}),
            **(dict(routing_replay="rollout") if moe else {}),
            **(dict(rollout_workers=1, max_staleness=1) if workers else {}),
        )
        rewards = [reward if fail_rank is None else failing_reward(fail_rank)]
        peft_config = None
        if lora:
            from peft import LoraConfig

            peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        trainer = CpuFSDPTrainer(model, rewards, args=args, train_dataset=ds, processing_class=tok,
                                 rollout_backend=ShiftedRouters(tok) if moe else None if real_rollout or fake_server
                                 or workers else GlobalRowRollout(tok),
                                 peft_config=peft_config)
        advantages, completions, prompts, checksums = [], [], [], []
        if workers:  # the trained weights after every step, to compare across ranks
            from transformers import TrainerCallback

            class Checksums(TrainerCallback):
                def on_step_end(self, args, state, control, trainer=trainer, checksums=checksums, **kw):
                    checksums.append(sum(float(p.double().sum()) for p in trainer.model.parameters()))

            trainer.add_callback(Checksums())

        def recording(original, trainer=trainer, advantages=advantages, completions=completions, prompts=prompts):
            def run(rows, driver):
                # the same stream in every run, a resumed one included: seeded by rank and step
                torch.manual_seed(1234 + 100 * rank_and_world()[0] + trainer.state.global_step)
                batch, stats = original(rows, driver)
                advantages.append(batch.advantages.detach().clone())
                completions.append((batch.completion_ids * batch.completion_mask).detach().clone())
                prompts.append([tuple(r[m.bool()].tolist()) for r, m in zip(batch.prompt_ids, batch.prompt_mask)])
                return batch, stats
            return run

        trainer.pipeline.next_batch = recording(trainer.pipeline.next_batch)
        trainer.pipeline.evaluation_batch = recording(trainer.pipeline.evaluation_batch)
        trainer.train(resume_from_checkpoint=resume)
        rank, _ = rank_and_world()
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        with full_weights(trainer.model_wrapped):  # whole parameters under FSDP / ZeRO-3
            params = {k: v.detach().cpu().clone() for k, v in unwrapped.named_parameters()}
        torch.save({
            "params": params,
            "sharding": sharding_kind(trainer.model_wrapped),
            "fsdp_plugin": None if not trainer.is_fsdp_enabled else {
                k: str(getattr(trainer.accelerator.state.fsdp_plugin, k))
                for k in ("fsdp_version", "reshard_after_forward", "state_dict_type", "auto_wrap_policy")},
            "server": None if not servers or getattr(trainer.rollout, "client", None) is None else {
                "requests": servers[-1].requests, "pushed": servers[-1].pushed, "resets": servers[-1].resets},
            "completions": completions,
            "advantages": advantages,
            "logs": trainer.state.log_history,
            "moe": replay,
            "prompts": prompts,
            "checksums": checksums,
        }, os.path.join(out_dir, f"{loss_type}-rank{rank}.pt"))


def parse(argv: list[str]) -> dict:
    """One run's arguments: ``OUT PER_DEVICE GA LOSS[,LOSS...]`` and its flags, as :func:`run`'s keywords."""
    argv = list(argv)
    options = {"--fail-rank": ("fail_rank", int), "--num-generations": ("num_generations", int),
               "--top-entropy": ("top_entropy", float), "--shard": ("shard", str), "--resume": ("resume", str)}
    kw = {}
    for option, (name, kind) in options.items():
        if option in argv:
            i = argv.index(option)
            kw[name] = kind(argv[i + 1])
            argv = argv[:i] + argv[i + 2:]
    switches = {"--real-rollout": "real_rollout", "--fake-vllm-server": "fake_server", "--lora": "lora",
                "--adamw": "adamw", "--save-steps": "save_steps", "--moe": "moe", "--workers": "workers"}
    kw.update({name: flag in argv for flag, name in switches.items()})
    kw["gather"] = "--no-gather" not in argv
    argv = [a for a in argv if a not in switches and a != "--no-gather"]
    out, per_device, ga, losses = argv
    return dict(kw, out_dir=out, per_device=int(per_device), ga=int(ga), loss_types=losses.split(","))


if __name__ == "__main__":
    # several runs in the same processes, one after another: RUN ++ RUN ++ ... (saves a launch per run)
    runs, current = [], []
    for arg in sys.argv[1:] + ["++"]:
        if arg == "++":
            runs.append(parse(current))
            current = []
        else:
            current.append(arg)
    for kw in runs:
        run(**kw)
    exit_process(0)  # a finished gloo all-gather must not meet the interpreter's teardown
