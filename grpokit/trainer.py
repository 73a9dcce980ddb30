"""``GRPOTrainer``: orchestration of rollouts, rewards, advantages and policy updates on ``transformers.Trainer``.

The math comes from :mod:`grpokit.algorithms`; this file only moves data between the stages:

    prompts ──> rollout ──> rewards ──> advantages ──> policy_loss ──> optimizer (Trainer)

One dataloader batch is one *generation batch* (see :class:`grpokit.data.GroupRepeatSampler`): on the first of
its ``steps_per_generation × num_iterations`` micro-steps the trainer generates and scores it, splits it into
``steps_per_generation`` micro-batches and serves them from a buffer on the following micro-steps.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from collections import defaultdict
from typing import Any

import torch
import transformers
from accelerate.utils import gather_object
from transformers import PreTrainedModel, Trainer, TrainerCallback

from .algorithms import policy_loss
from .algorithms.advantages import group_advantages, nanstd, overlong_penalty
from .algorithms.entropy import entropy_bonus
from .algorithms.importance import sampler_importance_ratio
from .checkpoints import CheckpointingMixin, load_rollout_buffer
from .config import GRPOConfig
from .data import GroupRepeatSampler, check_prompt_count, is_conversational, prompt_text, tokenize_prompts
from .logprobs import completion_logps
from .rollout.base import SamplingParams
from .rollout.transformers_backend import TransformersRollout
from .scoring import resolve_reward_funcs, reward_func_name, score_completions
from .sharding import full_weights, weights_for_generation

logger = logging.getLogger("grpokit")


def _identity(batch: list) -> list:
    return batch


class _TrainerHooks(TrainerCallback):
    """Wall time of each optimizer step (generation included) for the ``step_time`` metric, and the micro-step
    counter on (re)start: a resumed run regenerates its first batch and then follows the same schedule."""

    def __init__(self, trainer: "GRPOTrainer"):
        self.trainer = trainer
        self.start = None

    def on_train_begin(self, args, state, control, **kw):
        self.trainer._micro_step = state.global_step * args.gradient_accumulation_steps
        self.trainer._buffer = []
        self.trainer._total_tokens = int(state.num_input_tokens_seen or 0)
        if self.trainer._resume_checkpoint:  # a checkpoint inside a generation batch: its saved rollouts
            load_rollout_buffer(self.trainer, self.trainer._resume_checkpoint)

    def on_pre_optimizer_step(self, args, state, control, **kw):
        """A non-finite gradient never reaches the weights: raise (the step is not taken) or, with
        ``skip_nonfinite_steps``, drop the gradients so the optimizer leaves every parameter and its state as is."""
        t = self.trainer
        if t.is_deepspeed_enabled or getattr(t.accelerator, "scaler", None) is not None:
            return  # DeepSpeed and the fp16 grad scaler skip overflowing steps themselves
        norm, t._last_grad_norm = getattr(t, "_last_grad_norm", None), None
        if norm is not None and bool(torch.isfinite(torch.as_tensor(norm))):
            return  # the Trainer's gradient norm, taken just before, is finite: so is every gradient (no 2nd pass)
        params = [(n, p) for n, p in t.model.named_parameters() if p.grad is not None]
        if not params or torch.stack([torch.isfinite(p.grad).all() for _, p in params]).all():
            return
        bad = [n for n, p in params if not torch.isfinite(p.grad).all()]
        t.model.zero_grad(set_to_none=True)
        if args.skip_nonfinite_steps:
            t._metrics["train"]["skipped_nonfinite"].append(1.0)
            return
        raise FloatingPointError(
            f"non-finite gradients in {len(bad)} of {len(params)} parameters (first: {bad[0]}) at step "
            f"{state.global_step + 1}; the weights were not updated. Lower the learning rate or max_grad_norm, check "
            "the rewards, or set skip_nonfinite_steps=True to skip such steps"
        )

    def on_step_begin(self, args, state, control, **kw):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        if self.start is not None:
            self.trainer._metrics["train"]["step_time"].append(time.perf_counter() - self.start)


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
        _check_dataset("train_dataset", train_dataset)
        if eval_dataset is not None and not isinstance(eval_dataset, dict):
            _check_dataset("eval_dataset", eval_dataset)
        if train_dataset is not None and hasattr(train_dataset, "__len__"):  # before a model is loaded
            check_prompt_count(len(train_dataset), args.generation_batch_size // args.num_generations,
                               f"generation_batch_size {args.generation_batch_size} / num_generations "
                               f"{args.num_generations}")

        if isinstance(model, str):
            from .models import load_model

            init_kwargs = dict(args.model_init_kwargs or {})
            model = load_model(model, trust_remote_code=args.trust_remote_code, **init_kwargs)
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

        self.ref_model = None
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
            if args.gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()
        elif args.beta != 0.0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)

        # Rewards
        self.reward_funcs = resolve_reward_funcs(reward_funcs, _lookup_reward)
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
        if args.reward_weights is not None and len(args.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(args.reward_weights)} values for {len(self.reward_funcs)} reward functions "
                f"({', '.join(self.reward_func_names)}); give one weight per function"
            )
        weights = list(args.reward_weights or [1.0] * len(self.reward_funcs))
        if args.overlong_buffer_length is not None:
            weights.append(1.0)  # the overlong penalty enters as one more reward column
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)

        if rollout_backend is None and args.use_vllm:
            from .rollout.vllm_backend import VLLMRollout

            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            rollout_backend = VLLMRollout(base.name_or_path, processing_class, args, process_index=args.process_index)
        self.rollout = rollout_backend or TransformersRollout(processing_class)
        self._metrics: dict[str, dict[str, list]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._buffer: list[dict[str, Any]] = []
        self._micro_step = 0
        self._synced_step = 0  # a sampler with its own weights (vLLM) starts from the same checkpoint
        self._total_tokens = 0
        self._last_samples: dict[str, list] | None = None

        super().__init__(
            model=model,
            args=args,
            data_collator=_identity,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.add_callback(_TrainerHooks(self))
        if self.ref_model is not None:
            self.ref_model = self.accelerator.prepare_model(self.ref_model, evaluation_mode=True)
        for i, func in enumerate(self.reward_funcs):
            if isinstance(func, torch.nn.Module):
                self.reward_funcs[i] = self.accelerator.prepare_model(func.eval(), evaluation_mode=True)

    # -- data ------------------------------------------------------------------------------------------------------
    @property
    def _generate_every(self) -> int:
        return self.args.steps_per_generation * self.args.num_iterations

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return GroupRepeatSampler(
            num_prompts=len(dataset),
            num_generations=self.args.num_generations,
            prompts_per_batch=self.args.generation_batch_size // self.args.num_generations,
            repeats=self._generate_every,
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
    def _prepare_inputs(self, generation_batch: list[dict]) -> dict[str, Any]:
        if not self.model.training:
            return self._generate_and_score(generation_batch, mode="eval")
        if self._micro_step % self._generate_every == 0 or not self._buffer:
            batch = self._generate_and_score(generation_batch, mode="train")
            self._buffer = _split_rows(batch, self.args.steps_per_generation)
        inputs = self._buffer[self._micro_step % self.args.steps_per_generation]
        self._micro_step += 1
        return inputs

    def _sampling_params(self, mode: str) -> SamplingParams:
        a = self.args
        return SamplingParams(
            max_new_tokens=a.max_completion_length, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
            min_p=a.min_p, repetition_penalty=a.repetition_penalty, do_sample=True,
            extra=dict(a.generation_kwargs or {}) | ({"cache_implementation": a.cache_implementation}
                                                      if a.cache_implementation else {}),
        )

    def _generate_and_score(self, rows: list[dict], mode: str) -> dict[str, Any]:
        a, device, tok = self.args, self.accelerator.device, self.processing_class
        prompts = [r["prompt"] for r in rows]
        conversational = [is_conversational(p) for p in prompts]
        texts = [prompt_text(p, tok, a.chat_template_kwargs) for p in prompts]
        prompt_ids, prompt_mask, n_cut = tokenize_prompts(texts, tok, a.max_prompt_length, tok.pad_token_id, conversational)
        if n_cut:
            self._metrics[mode]["prompts/truncated_frac"].append(n_cut / len(rows))
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)

        wrapped = self.model_wrapped if self.model_wrapped is not None else self.model
        unwrapped = self.accelerator.unwrap_model(self.model)
        params = self._sampling_params(mode)
        holds = getattr(self.rollout, "holds_weights", False)  # an engine with its own copy of the weights (vLLM)
        if self._synced_step != self.state.global_step:  # the weights changed since the sampler last saw them
            with full_weights(wrapped) if holds else contextlib.nullcontext():
                self.rollout.sync_weights(unwrapped)
            self._synced_step = self.state.global_step
        if holds:
            rollout = self.rollout.generate(unwrapped, prompt_ids, prompt_mask, params)
        else:
            with weights_for_generation(wrapped, unwrapped, gather=a.ds3_gather_for_generation) as weights:
                params.lockstep = weights.lockstep
                rollout = self.rollout.generate(weights.model, prompt_ids, prompt_mask, params)
        completion_ids = rollout.completion_ids.to(device)
        completion_mask = rollout.completion_mask.to(device)
        truncated = rollout.is_truncated.to(device)

        ids_list = [row[m.bool()].tolist() for row, m in zip(completion_ids, completion_mask)]
        texts_out = tok.batch_decode(ids_list, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts_out, conversational)]

        rewards_local = score_completions(
            self.reward_funcs, self.reward_processing_classes, prompts=prompts, completions=completions,
            completion_ids=ids_list, rows=rows, trainer_state=self.state,
        ).to(device)
        lengths_local = completion_mask.sum(1)
        if a.overlong_buffer_length is not None:
            penalty = overlong_penalty(lengths_local, a.max_completion_length, a.overlong_buffer_length,
                                       a.overlong_penalty_factor)
            rewards_local = torch.cat([rewards_local, penalty.unsqueeze(1).to(rewards_local)], 1)

        # Advantages need whole groups: gather every rank's rewards, compute, keep this rank's slice.
        rewards = self.accelerator.gather(rewards_local)
        g = a.num_generations if mode == "train" else (a.num_generations_eval or a.num_generations)
        result = group_advantages(
            rewards, g, reward_weights=self.reward_weights.to(rewards.device), scale_rewards=a.scale_rewards,
            multi_objective_aggregation=a.multi_objective_aggregation, advantage_estimator=a.advantage_estimator,
        )
        n, rank = len(rows), self.accelerator.process_index
        advantages = result.advantages[rank * n:(rank + 1) * n].to(device)

        if a.mask_truncated_completions:
            completion_mask = completion_mask * (~truncated).unsqueeze(1).long()

        old_logps = ref_logps = None
        sampler_logps = rollout.sampler_logps.to(device) if rollout.sampler_logps is not None else None
        with torch.no_grad():
            reused = mode == "train" and a.gradient_accumulation_steps % self._generate_every != 0
            if reused or sampler_logps is not None:
                old_logps, _ = completion_logps(
                    self.model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                    temperature=a.temperature, compute_entropy=False, batch_size=a.per_device_train_batch_size,
                )
            if a.beta != 0.0:
                ref_logps = self._reference_logps(prompt_ids, prompt_mask, completion_ids, completion_mask)
        sampler_ratio = None
        if sampler_logps is not None and a.vllm_importance_sampling_correction:
            sampler_ratio = sampler_importance_ratio(
                old_logps, sampler_logps, completion_mask.float(), a.vllm_importance_sampling_mode,
                a.vllm_importance_sampling_clip_min, a.vllm_importance_sampling_clip_max,
            )

        if sampler_logps is not None and old_logps is not None:
            valid = completion_mask.bool()
            gap = (old_logps - sampler_logps)[valid].abs()
            self._metrics[mode]["sampling/sampling_logp_difference/mean"].append(gap.mean() if gap.numel() else gap.sum())
            if sampler_ratio is not None:
                rho = sampler_ratio.expand_as(completion_mask)[valid] if sampler_ratio.shape[-1] != 1 else sampler_ratio
                self._metrics[mode]["sampling/importance_sampling_ratio/mean"].append(rho.float().mean())
        num_items = self.accelerator.gather(completion_mask.sum().reshape(1)).sum()
        self._log_rollout_metrics(mode, rewards, result, lengths_local, truncated, prompt_mask, completion_mask)
        self._last_samples = {
            "prompt": texts, "completion": texts_out, "advantage": advantages.tolist(),
            **{name: rewards_local[:, k].tolist() for k, name in enumerate(self.reward_func_names)},
        }
        return {
            "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
            "completion_ids": completion_ids, "completion_mask": completion_mask,
            "advantages": advantages, "old_logps": old_logps, "ref_logps": ref_logps,
            "sampler_logps": sampler_logps, "sampler_ratio": sampler_ratio, "num_items_in_batch": num_items,
        }

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
                m[f"rewards/{name}/std"].append(_finite(nanstd(col).item()))
        total = result.rewards
        mean_reward = torch.nanmean(total).item()
        if mean_reward != mean_reward:  # NaN: dropped at log time rather than logged as a reward of 0
            logger.warning("no completion of this %s batch got a reward (every reward function returned None): "
                           "it contributes no gradient", mode)
        m["reward"].append(mean_reward)
        m["reward_std"].append(_finite(nanstd(total).item()))
        m["frac_reward_zero_std"].append(result.zero_std.float().mean().item())

    # -- loss ------------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("GRPOTrainer.compute_loss does not return outputs")
        a = self.args
        mode = "train" if self.model.training else "eval"
        mask = inputs["completion_mask"].float()
        logps, entropies = completion_logps(
            model, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], inputs["completion_mask"],
            temperature=a.temperature, compute_entropy=True, entropy_grad=a.entropy_coef > 0,
        )
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1
        out = policy_loss(
            logps, inputs["old_logps"], inputs["advantages"], mask,
            loss_type=a.loss_type, importance_sampling_level=a.importance_sampling_level,
            epsilon=a.epsilon, epsilon_high=a.epsilon_high, delta=a.delta,
            beta=a.beta, ref_logps=inputs["ref_logps"], use_bias_correction_kl=a.use_bias_correction_kl,
            sampler_ratio=inputs["sampler_ratio"], entropies=entropies, top_entropy_quantile=a.top_entropy_quantile,
            entropy_gather=self._gather_entropies if self.accelerator.num_processes > 1 else None,
            off_policy_mask_threshold=a.off_policy_mask_threshold, sampler_logps=inputs["sampler_logps"],
            vespo_k_pos=a.vespo_k_pos, vespo_lambda_pos=a.vespo_lambda_pos,
            vespo_k_neg=a.vespo_k_neg, vespo_lambda_neg=a.vespo_lambda_neg,
            sapo_temperature_pos=a.sapo_temperature_pos, sapo_temperature_neg=a.sapo_temperature_neg,
            max_completion_length=a.max_completion_length, num_items_in_batch=inputs["num_items_in_batch"],
            gradient_accumulation_steps=ga,
            steps_per_generation=a.steps_per_generation if mode == "train" else 1,
            num_processes=self.accelerator.num_processes,
        )
        loss = out.loss
        if a.entropy_coef > 0:
            loss = loss + entropy_bonus(entropies, mask, a.entropy_coef, ga)
        # one check (one host sync) for the loss and the policy log-probs it came from: exactly on-policy the loss
        # value does not depend on the log-probs, so a NaN there would not show in the loss
        if not (torch.isfinite(loss) & (torch.isfinite(logps.detach()) | (mask == 0)).all()):
            if a.skip_nonfinite_steps:
                self._metrics[mode]["skipped_nonfinite"].append(1.0)
                return self._skipped_loss(model)
            raise FloatingPointError(
                f"non-finite values in optimizer step {self.state.global_step + 1}: the {a.loss_type} loss is "
                f"{loss.item()}{_nonfinite_cause(logps, inputs, mask)}; the weights were not updated. Lower the "
                "learning rate, check the rewards, or set skip_nonfinite_steps=True to skip such micro-steps"
            )
        for key, value in out.metrics.items():
            self._metrics[mode][key].append(value)
        return loss

    def _gather_entropies(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's valid-token entropies (ranks hold different counts: padded with NaN, gathered, dropped)."""
        padded = self.accelerator.pad_across_processes(values, dim=0, pad_index=float("nan"))
        everyone = self.accelerator.gather(padded)
        return everyone[~torch.isnan(everyone)]

    def _get_grad_norm(self, model, grad_norm=None):
        # kept for the non-finite gradient check of _TrainerHooks.on_pre_optimizer_step, which runs right after
        self._last_grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        return self._last_grad_norm

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


def _nonfinite_cause(logps: torch.Tensor, inputs: dict[str, Any], mask: torch.Tensor) -> str:
    """Which input of a non-finite loss is itself non-finite, for the error message."""
    on = mask.bool()
    causes = []
    for label, value in (("policy log-probs", logps), ("old log-probs", inputs.get("old_logps")),
                         ("reference log-probs", inputs.get("ref_logps"))):
        if isinstance(value, torch.Tensor) and value.shape == on.shape:
            bad = int((~torch.isfinite(value.detach()) & on).sum())
            if bad:
                causes.append(f"non-finite {label} at {bad} of {int(on.sum())} completion tokens")
    adv = inputs.get("advantages")
    if isinstance(adv, torch.Tensor) and not torch.isfinite(adv).all():
        causes.append("non-finite advantages")
    return f" ({'; '.join(causes)})" if causes else ""


def _finite(x: float) -> float:
    return x if x == x and abs(x) != float("inf") else 0.0


def _split_rows(batch: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    n = batch["completion_ids"].shape[0]
    if n % parts:
        raise ValueError(f"generation batch of {n} rows does not split into steps_per_generation={parts} micro-batches")
    size = n // parts
    out = []
    for p in range(parts):
        sl = slice(p * size, (p + 1) * size)
        out.append({k: (v[sl] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in batch.items()})
    return out


def _check_dataset(name: str, dataset) -> None:
    if dataset is None:
        return
    columns = getattr(dataset, "column_names", None)
    if columns is None and hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__") and len(dataset):
        first = dataset[0]
        columns = list(first) if isinstance(first, dict) else None
    if hasattr(dataset, "__len__") and len(dataset) == 0:
        raise ValueError(f"{name} is empty; it needs at least one prompt")
    if columns is not None and "prompt" not in columns:
        raise ValueError(f"{name} has no 'prompt' column (columns: {', '.join(map(str, columns))}); add one")


def _lookup_reward(spec: str):
    from .rewards import get_reward_func

    try:
        return get_reward_func(spec)
    except ValueError:
        if os.path.isdir(spec) or "/" in spec:
            return transformers.AutoModelForSequenceClassification.from_pretrained(
                spec, num_labels=1, use_safetensors=True, trust_remote_code=False)
        raise
