"""``GRPOTrainer``: orchestration of rollouts, rewards, advantages and policy updates on ``transformers.Trainer``.

The math comes from :mod:`grpokit.algorithms`; this file only moves data between the stages:

    prompts ──> rollout ──> rewards ──> advantages ──> policy_loss ──> optimizer (Trainer)

One dataloader batch is one *generation batch* (see :class:`grpokit.data.GroupRepeatSampler`): on the first of
its ``steps_per_generation × num_iterations`` micro-steps the trainer generates and scores it into a
:class:`grpokit.batch.RolloutBatch`, splits it into ``steps_per_generation`` micro-batches and serves them from its
:class:`grpokit.batch.RolloutBuffer` on the following micro-steps.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections import defaultdict
from typing import Any

import torch
import transformers
from accelerate.utils import gather_object
from transformers import PreTrainedModel, Trainer, TrainerCallback

from .algorithms import LossScale, LossSettings, policy_loss
from .algorithms.advantages import group_advantages, nanstd, overlong_penalty
from .algorithms.entropy import entropy_bonus
from .algorithms.importance import sampler_importance_ratio
from .batch import RolloutBatch, RolloutBuffer
from .callbacks import TrainerHooks
from .checkpoints import CheckpointingMixin, load_rollout_buffer, save_rollout_buffer
from .config import GRPOConfig
from .data import GroupRepeatSampler, check_dataset, check_prompt_count
from .logprobs import completion_logps
from .rewards import check_reward_weights, resolve_reward_funcs, reward_func_name
from .rollout.base import Generation, SamplingParams
from .rollout.sample import ScoredSamples, sample_and_score
from .rollout.transformers_backend import TransformersRollout
from .sharding import full_weights, weights_for_generation

logger = logging.getLogger("grpokit")


def _identity(batch: list) -> list:
    return batch


class GRPOTrainer(CheckpointingMixin, Trainer):
    """Group Relative Policy Optimization and its family; a drop-in for ``trl.GRPOTrainer``.

    Checkpoints are written atomically, checked before a resume (``resume_from_checkpoint`` also takes
    ``"auto"``), and a first SIGINT/SIGTERM during ``train()`` saves one at the next step boundary and stops
    (:mod:`grpokit.checkpoints`).

    Args:
        model: a ``PreTrainedModel``, a local directory, a hub id, a ``.gguf`` file, or ``"smollm2-135m-instruct"``.
        reward_funcs: a function, a reward model, a built-in reward name or ``module:function``, or a list.
        args: :class:`GRPOConfig`.
        train_dataset / eval_dataset: datasets with a ``prompt`` column (text or chat messages); every other
            column is passed to the reward functions by name.
        processing_class: the tokenizer (loaded from the model when None); padding is set to the left.
        reward_processing_classes: tokenizers of reward models, in the order of ``reward_funcs``.
        peft_config: a ``peft`` config; the model is wrapped with it (LoRA) and the reference policy, when
            ``beta != 0``, is the same model with the adapter disabled.
        rollout_backend: an object with the :class:`grpokit.rollout.base.RolloutBackend` interface
            (default: transformers ``generate``).
    """

    _tag_names = ["grpokit", "grpo"]
    loss_is_scaled_for_ga = True  # policy_loss divides by gradient_accumulation_steps itself

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Any,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers=(None, None),
        peft_config=None,
        rollout_backend=None,
    ):
        model_id = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "model")
        if args is None:
            args = GRPOConfig(output_dir=f"{str(model_id).rstrip('/').split('/')[-1]}-GRPO")
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be a grpokit.GRPOConfig, got {type(args).__name__}")
        _check_datasets(args, train_dataset, eval_dataset)
        model, processing_class = _load_policy(model, model_id, processing_class, args)
        self.ref_model = None
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
            if args.gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()
        elif args.beta != 0.0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self._setup_rewards(reward_funcs, reward_processing_classes, args)
        self.loss_settings = LossSettings.from_config(args)
        if rollout_backend is None and args.use_vllm:
            from .rollout.vllm_backend import VLLMRollout

            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            rollout_backend = VLLMRollout(base.name_or_path, processing_class, args, process_index=args.process_index)
        self.rollout = rollout_backend or TransformersRollout(processing_class)
        self._metrics: dict[str, dict[str, list]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._rollouts = RolloutBuffer(args.steps_per_generation, args.steps_per_generation * args.num_iterations)
        self._synced_step = 0  # a sampler with its own weights (vLLM) starts from the same checkpoint
        self._total_tokens = 0
        self._last_samples: dict[str, list] | None = None

        super().__init__(model=model, args=args, data_collator=_identity, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)
        self.add_callback(TrainerHooks(self))
        if self.ref_model is not None:
            self.ref_model = self.accelerator.prepare_model(self.ref_model, evaluation_mode=True)
        for i, func in enumerate(self.reward_funcs):
            if isinstance(func, torch.nn.Module):
                self.reward_funcs[i] = self.accelerator.prepare_model(func.eval(), evaluation_mode=True)

    def _setup_rewards(self, reward_funcs, reward_processing_classes, args: GRPOConfig) -> None:
        self.reward_funcs = resolve_reward_funcs(reward_funcs)
        if reward_processing_classes is None:
            reward_processing_classes = [None] * len(self.reward_funcs)
        elif not isinstance(reward_processing_classes, (list, tuple)):
            reward_processing_classes = [reward_processing_classes]
        if len(reward_processing_classes) != len(self.reward_funcs):
            raise ValueError(
                f"reward_processing_classes has {len(reward_processing_classes)} entries for "
                f"{len(self.reward_funcs)} reward functions"
            )
        self.reward_processing_classes = []
        for func, proc in zip(self.reward_funcs, reward_processing_classes):
            if isinstance(func, torch.nn.Module) and proc is None:
                proc = transformers.AutoTokenizer.from_pretrained(func.config._name_or_path)
            if proc is not None and proc.pad_token_id is None:
                proc.pad_token = proc.eos_token
            self.reward_processing_classes.append(proc)
        self.reward_func_names = [reward_func_name(f) for f in self.reward_funcs]
        check_reward_weights(args.reward_weights, self.reward_func_names)
        weights = list(args.reward_weights or [1.0] * len(self.reward_funcs))
        if args.overlong_buffer_length is not None:
            weights.append(1.0)  # the overlong penalty enters as one more reward column
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)

    # -- the trainer's state, changed by these methods only ------------------------------------------------------
    def begin_rollout_schedule(self, state) -> None:
        """On (re)start: the micro-step counter follows ``global_step``, nothing is buffered, and a checkpoint taken
        inside a generation batch gives back its saved rollouts (a resumed run then follows the same schedule)."""
        self._rollouts.reset(state.global_step * self.args.gradient_accumulation_steps)
        self._total_tokens = int(state.num_input_tokens_seen or 0)
        if self._resume_checkpoint:
            load_rollout_buffer(self._rollouts, self._resume_checkpoint, self.accelerator.device,
                                self.args.process_index, self.args.world_size)

    def _save_rollout_state(self, checkpoint_dir: str) -> None:
        save_rollout_buffer(self._rollouts, checkpoint_dir, self.args.process_index, self.args.world_size)

    def record_metric(self, name: str, value: float | torch.Tensor, mode: str = "train") -> None:
        """Add a value to the metrics averaged (counters: summed) into the next log line."""
        self._metrics[mode][name].append(value)

    def save_checkpoint(self) -> str:
        """Save a checkpoint of the current state now (atomically, as the periodic ones); returns its path."""
        self._save_checkpoint(self.model, None)
        return f"{self.args.output_dir}/checkpoint-{self.state.global_step}"

    def guard_gradients(self, state) -> None:
        """Before an optimizer step: a non-finite gradient never reaches the weights. Raise (the step is not taken)
        or, with ``skip_nonfinite_steps``, drop the gradients so the optimizer leaves every parameter and its state
        as is."""
        if self.is_deepspeed_enabled or getattr(self.accelerator, "scaler", None) is not None:
            return  # DeepSpeed and the fp16 grad scaler skip overflowing steps themselves
        norm, self._last_grad_norm = getattr(self, "_last_grad_norm", None), None
        if norm is not None and bool(torch.isfinite(torch.as_tensor(norm))):
            return  # the Trainer's gradient norm, taken just before, is finite: so is every gradient (no 2nd pass)
        params = [(n, p) for n, p in self.model.named_parameters() if p.grad is not None]
        if not params or torch.stack([torch.isfinite(p.grad).all() for _, p in params]).all():
            return
        bad = [n for n, p in params if not torch.isfinite(p.grad).all()]
        self.model.zero_grad(set_to_none=True)
        if self.args.skip_nonfinite_steps:
            self.record_metric("skipped_nonfinite", 1.0)
            return
        raise FloatingPointError(
            f"non-finite gradients in {len(bad)} of {len(params)} parameters (first: {bad[0]}) at step "
            f"{state.global_step + 1}; the weights were not updated. Lower the learning rate or max_grad_norm, check "
            "the rewards, or set skip_nonfinite_steps=True to skip such steps"
        )

    def _get_grad_norm(self, model, grad_norm=None):
        # kept for guard_gradients, which runs right after (on_pre_optimizer_step)
        self._last_grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        return self._last_grad_norm

    # -- data ------------------------------------------------------------------------------------------------------
    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return GroupRepeatSampler(
            num_prompts=len(dataset),
            num_generations=self.args.num_generations,
            prompts_per_batch=self.args.generation_batch_size // self.args.num_generations,
            repeats=self._rollouts.generate_every,
            shuffle=bool(self.args.shuffle_dataset),
            seed=self.args.seed,
        )

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("GRPOTrainer.train() needs a train_dataset")
        return self._get_dataloader(
            dataset=self.train_dataset,
            description="Training",
            batch_size=self.args.per_device_train_batch_size * self.args.steps_per_generation,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def _get_eval_sampler(self, eval_dataset):
        g = self.args.num_generations_eval or self.args.num_generations
        return GroupRepeatSampler(len(eval_dataset), g, 1, repeats=1, shuffle=False)

    # -- rollouts and scoring ----------------------------------------------------------------------------------------
    def _prepare_inputs(self, generation_batch: list[dict]) -> RolloutBatch:
        if not self.model.training:
            return self._generate_and_score(generation_batch, mode="eval")
        if self._rollouts.needs_generation():
            self._rollouts.fill(self._generate_and_score(generation_batch, mode="train"))
        return self._rollouts.next()

    def _sampling_params(self, mode: str) -> SamplingParams:
        a = self.args
        return SamplingParams(
            max_new_tokens=a.max_completion_length, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
            min_p=a.min_p, repetition_penalty=a.repetition_penalty, do_sample=True,
            extra=dict(a.generation_kwargs or {}) | ({"cache_implementation": a.cache_implementation}
                                                      if a.cache_implementation else {}),
        )

    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, mode: str) -> Generation:
        """Sample one completion per row with the current policy: an engine with its own copy of the weights (vLLM)
        gets them pushed first when they changed; otherwise the trainer's model generates (sharded weights gathered
        as ``ds3_gather_for_generation`` says)."""
        wrapped = self.model_wrapped if self.model_wrapped is not None else self.model
        unwrapped = self.accelerator.unwrap_model(self.model)
        params = self._sampling_params(mode)
        holds = getattr(self.rollout, "holds_weights", False)
        if self._synced_step != self.state.global_step:  # the weights changed since the sampler last saw them
            with full_weights(wrapped) if holds else contextlib.nullcontext():
                self.rollout.sync_weights(unwrapped)
            self._synced_step = self.state.global_step
        if holds:
            return self.rollout.generate(unwrapped, prompt_ids, prompt_mask, params)
        with weights_for_generation(wrapped, unwrapped, gather=self.args.ds3_gather_for_generation) as weights:
            params.lockstep = weights.lockstep
            return self.rollout.generate(weights.model, prompt_ids, prompt_mask, params)

    def _generate_and_score(self, rows: list[dict], mode: str) -> RolloutBatch:
        a, device = self.args, self.accelerator.device
        s = sample_and_score(rows, self.processing_class, lambda ids, mask: self._generate(ids, mask, mode),
                             self.reward_funcs, self.reward_processing_classes,
                             chat_template_kwargs=a.chat_template_kwargs, max_prompt_length=a.max_prompt_length,
                             device=device, reward_kwargs={"trainer_state": self.state})
        if s.n_truncated_prompts:
            self.record_metric("prompts/truncated_frac", s.n_truncated_prompts / len(rows), mode)
        completion_ids = s.generation.completion_ids.to(device)
        completion_mask = s.generation.completion_mask.to(device)
        truncated = s.generation.is_truncated.to(device)
        rewards_local = s.rewards.to(device)
        lengths_local = completion_mask.sum(1)
        if a.overlong_buffer_length is not None:
            penalty = overlong_penalty(lengths_local, a.max_completion_length, a.overlong_buffer_length,
                                       a.overlong_penalty_factor)
            rewards_local = torch.cat([rewards_local, penalty.unsqueeze(1).to(rewards_local)], 1)
        rewards, result, advantages = self._advantages(rewards_local, mode)
        if a.mask_truncated_completions:
            completion_mask = completion_mask * (~truncated).unsqueeze(1).long()
        batch = RolloutBatch(
            prompt_ids=s.prompt_ids, prompt_mask=s.prompt_mask, completion_ids=completion_ids,
            completion_mask=completion_mask, advantages=advantages,
            num_items_in_batch=self.accelerator.gather(completion_mask.sum().reshape(1)).sum(),
            sampler_logps=s.generation.sampler_logps.to(device) if s.generation.sampler_logps is not None else None,
        )
        self._add_behaviour_logps(batch, mode)
        self._log_rollout_metrics(mode, rewards, result, lengths_local, truncated, s.prompt_mask, completion_mask)
        self._remember_samples(s, advantages, rewards_local)
        return batch

    def _advantages(self, rewards_local: torch.Tensor, mode: str):
        """Advantages need whole groups: every rank's rewards are gathered, advantages computed, this rank's slice
        kept. Returns ``(all rewards, the AdvantageResult, this rank's advantages)``."""
        a = self.args
        rewards = self.accelerator.gather(rewards_local)
        g = a.num_generations if mode == "train" else (a.num_generations_eval or a.num_generations)
        result = group_advantages(
            rewards, g, reward_weights=self.reward_weights.to(rewards.device), scale_rewards=a.scale_rewards,
            multi_objective_aggregation=a.multi_objective_aggregation, advantage_estimator=a.advantage_estimator,
        )
        n, rank = rewards_local.shape[0], self.accelerator.process_index
        return rewards, result, result.advantages[rank * n:(rank + 1) * n].to(self.accelerator.device)

    def _add_behaviour_logps(self, batch: RolloutBatch, mode: str) -> None:
        """The log-probs the loss needs besides the current policy's: the rollout policy's (``old_logps``) when the
        batch is reused across optimizer steps or the sampler is not the trainer; the reference model's when
        ``beta != 0``; and the sampler/trainer mismatch ratio with its metrics."""
        a = self.args
        ids = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
        with torch.no_grad():
            reused = mode == "train" and a.gradient_accumulation_steps % self._rollouts.generate_every != 0
            if reused or batch.sampler_logps is not None:
                batch.old_logps, _ = completion_logps(self.model, *ids, temperature=a.temperature,
                                                      compute_entropy=False, batch_size=a.per_device_train_batch_size)
            if a.beta != 0.0:
                batch.ref_logps = self._reference_logps(*ids)
        if batch.sampler_logps is None or batch.old_logps is None:
            return
        if a.vllm_importance_sampling_correction:
            batch.sampler_ratio = sampler_importance_ratio(
                batch.old_logps, batch.sampler_logps, batch.completion_mask.float(), a.vllm_importance_sampling_mode,
                a.vllm_importance_sampling_clip_min, a.vllm_importance_sampling_clip_max,
            )
        valid = batch.completion_mask.bool()
        gap = (batch.old_logps - batch.sampler_logps)[valid].abs()
        self.record_metric("sampling/sampling_logp_difference/mean", gap.mean() if gap.numel() else gap.sum(), mode)
        if batch.sampler_ratio is not None:
            rho = batch.sampler_ratio
            rho = rho.expand_as(batch.completion_mask)[valid] if rho.shape[-1] != 1 else rho
            self.record_metric("sampling/importance_sampling_ratio/mean", rho.float().mean(), mode)

    def _reference_logps(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
        kwargs = dict(temperature=self.args.temperature, compute_entropy=False,
                      batch_size=self.args.per_device_train_batch_size)
        if self.ref_model is not None:
            return completion_logps(self.ref_model, prompt_ids, prompt_mask, completion_ids, completion_mask, **kwargs)[0]
        model = self.accelerator.unwrap_model(self.model)
        with model.disable_adapter():  # PEFT: the base model is the reference
            return completion_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, **kwargs)[0]

    def _log_rollout_metrics(self, mode, rewards, result, lengths_local, truncated, prompt_mask, completion_mask):
        m = self._metrics[mode]
        gather = self.accelerator.gather
        lengths = gather(lengths_local).float()
        trunc = gather(truncated.float())
        if mode == "train":
            self._total_tokens += int(gather((prompt_mask.sum() + completion_mask.sum()).reshape(1)).sum())
            self.state.num_input_tokens_seen = self._total_tokens
        m["num_tokens"].append(float(self._total_tokens))
        m["completions/mean_length"].append(lengths.mean().item())
        m["completions/min_length"].append(lengths.min().item())
        m["completions/max_length"].append(lengths.max().item())
        m["completions/clipped_ratio"].append(trunc.mean().item())
        done = lengths[trunc == 0]
        if done.numel():
            m["completions/mean_terminated_length"].append(done.mean().item())
        for k, name in enumerate(self.reward_func_names):
            col = rewards[:, k]
            if (~torch.isnan(col)).any():
                m[f"rewards/{name}/mean"].append(torch.nanmean(col).item())
                m[f"rewards/{name}/std"].append(nanstd(col).item())
        total = result.rewards
        mean_reward = torch.nanmean(total).item()
        if mean_reward != mean_reward:  # NaN: dropped at log time rather than logged as a reward of 0
            logger.warning("no completion of this %s batch got a reward (every reward function returned None): "
                           "it contributes no gradient", mode)
        m["reward"].append(mean_reward)
        m["reward_std"].append(nanstd(total).item())
        m["frac_reward_zero_std"].append(result.zero_std.float().mean().item())

    def _remember_samples(self, s: ScoredSamples, advantages: torch.Tensor, rewards_local: torch.Tensor) -> None:
        """The last batch's prompts, completions, rewards and advantages, for the completions table."""
        self._last_samples = {
            "prompt": s.prompt_texts, "completion": s.completion_texts, "advantage": advantages.tolist(),
            **{name: rewards_local[:, k].tolist() for k, name in enumerate(self.reward_func_names)},
        }

    # -- loss ------------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs: RolloutBatch, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("GRPOTrainer.compute_loss does not return outputs")
        a = self.args
        mode = "train" if self.model.training else "eval"
        mask = inputs.completion_mask.float()
        logps, entropies = completion_logps(
            model, inputs.prompt_ids, inputs.prompt_mask, inputs.completion_ids, inputs.completion_mask,
            temperature=a.temperature, compute_entropy=True, entropy_grad=a.entropy_coef > 0,
        )
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1
        scale = LossScale(max_completion_length=a.max_completion_length, num_items_in_batch=inputs.num_items_in_batch,
                          gradient_accumulation_steps=ga,
                          steps_per_generation=a.steps_per_generation if mode == "train" else 1,
                          num_processes=self.accelerator.num_processes)
        out = policy_loss(
            logps, inputs.old_logps, inputs.advantages, mask, self.loss_settings, scale=scale,
            ref_logps=inputs.ref_logps, sampler_ratio=inputs.sampler_ratio, sampler_logps=inputs.sampler_logps,
            entropies=entropies, entropy_gather=self._gather_entropies if self.accelerator.num_processes > 1 else None,
        )
        loss = out.loss
        if a.entropy_coef > 0:
            loss = loss + entropy_bonus(entropies, mask, a.entropy_coef, ga)
        # one check (one host sync) for the loss and the policy log-probs it came from: exactly on-policy the loss
        # value does not depend on the log-probs, so a NaN there would not show in the loss
        if not (torch.isfinite(loss) & (torch.isfinite(logps.detach()) | (mask == 0)).all()):
            if a.skip_nonfinite_steps:
                self.record_metric("skipped_nonfinite", 1.0, mode)
                return self._skipped_loss(model)
            raise FloatingPointError(
                f"non-finite values in optimizer step {self.state.global_step + 1}: the {a.loss_type} loss is "
                f"{loss.item()}{_nonfinite_cause(logps, inputs, mask)}; the weights were not updated. Lower the "
                "learning rate, check the rewards, or set skip_nonfinite_steps=True to skip such micro-steps"
            )
        for key, value in out.metrics.items():
            self.record_metric(key, value, mode)
        return loss

    def _gather_entropies(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's valid-token entropies (ranks hold different counts: padded with NaN, gathered, dropped)."""
        padded = self.accelerator.pad_across_processes(values, dim=0, pad_index=float("nan"))
        everyone = self.accelerator.gather(padded)
        return everyone[~torch.isnan(everyone)]

    def _skipped_loss(self, model) -> torch.Tensor:
        """The loss of a skipped micro-step: zero, and not computed from the non-finite values (0·NaN is NaN). On one
        process it reaches no parameter, so a step whose micro-steps are all skipped leaves the weights and the
        optimizer state untouched; under DDP every parameter must take part in backward, so it is 0·θ."""
        if self.accelerator.num_processes > 1:
            return sum(p.view(-1)[:1].sum() for p in model.parameters() if p.requires_grad) * 0.0
        return torch.zeros((), device=self.accelerator.device, requires_grad=True)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # -- logging ---------------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = _reduce_metrics(self._metrics[mode])
        if self.accelerator.num_processes > 1:  # every rank logs at the same steps: average over ranks
            per_rank = gather_object([metrics])
            metrics = _reduce_metrics({k: [m[k] for m in per_rank if k in m] for k in set().union(*per_rank)})
        if mode == "eval":
            metrics = {f"eval_{k}": v for k, v in metrics.items()}
        logs = {**logs, **metrics}
        super().log(logs, start_time)
        self._metrics[mode].clear()
        if self.args.log_completions and self._last_samples and self.accelerator.is_main_process:
            from .reporting import log_completions_table

            s = self._last_samples
            rewards = {name: s[name] for name in self.reward_func_names if name in s}
            log_completions_table(s["prompt"], s["completion"], rewards, s["advantage"], self.state.global_step,
                                  max_rows=self.args.num_completions_to_print or 8)


def _load_policy(model, model_id, processing_class, args: GRPOConfig):
    """The policy model (loaded when given by name) and its tokenizer, padded on the left; dropout off with
    ``disable_dropout``."""
    if isinstance(model, str):
        from .models import load_model

        model = load_model(model, trust_remote_code=args.trust_remote_code, **dict(args.model_init_kwargs or {}))
    if processing_class is None:
        from .models import load_tokenizer

        processing_class = load_tokenizer(model_id if isinstance(model_id, str) else model.name_or_path,
                                          trust_remote_code=args.trust_remote_code)
    processing_class.padding_side = "left"
    if processing_class.pad_token_id is None:
        processing_class.pad_token = processing_class.eos_token
    if args.disable_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    return model, processing_class


def _check_datasets(args: GRPOConfig, train_dataset, eval_dataset) -> None:
    """Before a model is loaded: the datasets have prompts, and enough of them for one generation batch."""
    check_dataset("train_dataset", train_dataset)
    if eval_dataset is not None and not isinstance(eval_dataset, dict):
        check_dataset("eval_dataset", eval_dataset)
    if train_dataset is not None and hasattr(train_dataset, "__len__"):
        check_prompt_count(len(train_dataset), args.generation_batch_size // args.num_generations,
                           f"generation_batch_size {args.generation_batch_size} / num_generations "
                           f"{args.num_generations}")


def _reduce_metrics(values_by_key: dict[str, list]) -> dict[str, float]:
    """Mean of each metric's values (tensors converted here, at log time: no host sync per micro-step); NaNs are
    skipped; counters (``skipped_nonfinite``) are summed."""
    out = {}
    for key, values in values_by_key.items():
        nums = [float(v.item()) if isinstance(v, torch.Tensor) else float(v) for v in values]
        nums = [v for v in nums if v == v]
        if nums:
            out[key] = sum(nums) if key == "skipped_nonfinite" else sum(nums) / len(nums)
    return out


def _nonfinite_cause(logps: torch.Tensor, inputs: RolloutBatch, mask: torch.Tensor) -> str:
    """Which input of a non-finite loss is itself non-finite, for the error message."""
    on = mask.bool()
    causes = []
    for label, value in (("policy log-probs", logps), ("old log-probs", inputs.old_logps),
                         ("reference log-probs", inputs.ref_logps)):
        if isinstance(value, torch.Tensor) and value.shape == on.shape:
            bad = int((~torch.isfinite(value.detach()) & on).sum())
            if bad:
                causes.append(f"non-finite {label} at {bad} of {int(on.sum())} completion tokens")
    if not torch.isfinite(inputs.advantages).all():
        causes.append("non-finite advantages")
    return f" ({'; '.join(causes)})" if causes else ""
