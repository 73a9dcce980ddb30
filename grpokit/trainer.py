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
import json
import logging
import os
from collections import defaultdict
from typing import Any

import torch
import transformers
from accelerate.utils import gather_object
from transformers import PreTrainedModel, Trainer, TrainerCallback

from .algorithms import LossScale, LossSettings, policy_loss
from .algorithms.advantages import group_advantages, nanstd, overlong_penalty
from .algorithms.entropy import AdaptiveEntropyCoef, entropy_bonus
from .algorithms.importance import sampler_importance_ratio
from .algorithms.masks import high_entropy_mask, off_policy_sequence_mask
from .batch import RolloutBatch, RolloutBuffer
from .callbacks import install_hooks
from .checkpoints import CheckpointingMixin, load_rollout_buffer, save_rollout_buffer
from .config import GRPOConfig
from .data import GroupRepeatIterable, GroupRepeatSampler, check_dataset, check_prompt_count, is_iterable_dataset
from .files import atomic_write_bytes, atomic_write_text
from .logprobs import completion_logps
from .models import cast_lm_head_to_fp32
from .process_group import any_process, stop_together
from .reference import check_sync_ref_model, load_reference, mix_into_reference, save_reference
from .rewards import check_reward_weights, resolve_reward_funcs, reward_func_name
from .rollout.base import Generation, SamplingParams, context_length, stop_token_ids
from .rollout.dynamic_sampling import fill_with_informative_groups, first_round_groups
from .rollout.prompt_skipping import prompt_skipper
from .rollout.sample import ScoredSamples, sample_and_score
from .rollout.transformers_backend import TransformersRollout
from .run_dir import run_signature, save_signature
from .sharding import full_weights, sharding_kind, weights_for_generation
from .tools import TurnLimits
from .user_calls import CallBounds
from .validation import short_repr

logger = logging.getLogger("grpokit")

ENTROPY_STATE_FILE = "entropy_ctrl_state.json"
"""The adaptive entropy controller's state in a checkpoint (TRL's file name)."""


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
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
        *,
        rollout_backend=None,
    ):
        model_id = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "model")
        if args is None:
            args = GRPOConfig(output_dir=f"{str(model_id).rstrip('/').split('/')[-1]}-GRPO")
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be a grpokit.GRPOConfig, got {type(args).__name__}")
        self.multiturn = _multiturn(tools, environment_factory, args)  # tools checked before a model is loaded
        if rollout_func is not None and not callable(rollout_func):
            raise ValueError(f"rollout_func={rollout_func!r:.80} is not callable; expected rollout_func(prompts, trainer)")
        self.rollout_func = rollout_func
        train_dataset = _default_dataset(train_dataset, environment_factory, args)
        _check_datasets(args, train_dataset, eval_dataset)
        transformers.set_seed(args.seed)  # before the model and its adapter are made: LoRA's init is random
        model, processing_class = _load_policy(model, model_id, processing_class, args, quantization_config)
        _check_vocabulary(model, processing_class)
        if self.multiturn is not None:
            self.multiturn.check_template(processing_class)
        self.ref_model = None
        if peft_config is not None:
            model = _add_adapter(model, peft_config, args)
        elif args.beta != 0.0:  # a PeftModel passed in: its adapter as it is now is the reference (TRL's "ref" copy)
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        check_sync_ref_model(args, peft=_is_peft(model), sharding=None)
        if args.cast_lm_head_to_fp32:
            for m in (model, self.ref_model):
                if m is not None:
                    cast_lm_head_to_fp32(m)
        _keep_4bit_layers_trainable(model)
        self._setup_rewards(reward_funcs, reward_processing_classes, args)
        self.loss_settings = LossSettings.from_config(args)
        self._entropy_ctrl = AdaptiveEntropyCoef(
            coef=args.entropy_coef, target=args.entropy_target, delta=args.entropy_coef_delta, lo=args.entropy_coef_min,
            hi=args.entropy_coef_max) if args.use_adaptive_entropy else None
        self._entropy_window: torch.Tensor | None = None
        self.router_aux_loss_coef = _router_aux_loss_coef(model, args)
        self.aux_loss_enabled = self.router_aux_loss_coef != 0.0  # TRL's attribute: the MoE router loss is added
        self.rollout = rollout_backend or _default_rollout(model, processing_class, args)
        self._metrics: dict[str, dict[str, list]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._rollouts = RolloutBuffer(args.steps_per_generation, args.steps_per_generation * args.num_iterations)
        self._synced_step = 0  # a sampler with its own weights (vLLM) starts from the same checkpoint
        self._total_tokens = 0
        self._last_samples: dict[str, Any] | None = None
        self._pending_reward_metrics: dict[str, list[float]] = defaultdict(list)
        self._refill_position = 0  # dynamic sampling's own stream of prompts
        self._last_keep_rate = None  # dynamic sampling: the share of groups the last batch kept (sizes the next)
        self._prompt_skipper = prompt_skipper(args)  # dynamic sampling's GRESO filter, None when off
        self._weight_average = None  # ema_decay's average of the trained weights, made when training starts
        self._async = None
        if args.max_staleness > 0:
            from .async_rollouts import AsyncRollouts

            self._async = AsyncRollouts(self)

        super().__init__(model=model, args=args, data_collator=_identity, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)
        self._stall = install_hooks(self)  # TrainerHooks, and with stall_timeout_s the watchdog (grpokit/watchdog.py)
        if self.ref_model is not None:
            self.ref_model = self.accelerator.prepare_model(self.ref_model, evaluation_mode=True)
        for i, func in enumerate(self.reward_funcs):
            if isinstance(func, torch.nn.Module):
                self.reward_funcs[i] = self.accelerator.prepare_model(func.eval(), evaluation_mode=True)

    def _setup_rewards(self, reward_funcs, reward_processing_classes, args: GRPOConfig) -> None:
        extra = self.multiturn.reward_funcs() if self.multiturn is not None else []  # environments' get_reward
        if reward_funcs is None or (isinstance(reward_funcs, (list, tuple)) and not reward_funcs):
            if not extra:
                raise ValueError("No reward source provided: pass reward_funcs, or an environment_factory whose "
                                 "environments have a get_reward() method")
            user = []
        else:
            user = resolve_reward_funcs(reward_funcs)
        check_reward_weights(args.reward_weights, [reward_func_name(f) for f in user])
        self.reward_funcs = user + extra
        self.call_bounds = CallBounds.from_config(args)  # time bounds on user code in rollouts (grpokit/user_calls.py)
        if reward_processing_classes is None:
            reward_processing_classes = [None] * len(user)
        elif not isinstance(reward_processing_classes, (list, tuple)):
            reward_processing_classes = [reward_processing_classes]
        if len(reward_processing_classes) != len(user):
            raise ValueError(
                f"reward_processing_classes has {len(reward_processing_classes)} entries for "
                f"{len(user)} reward functions: the lengths must match (None for a reward function that is not a model)"
            )
        reward_processing_classes = list(reward_processing_classes) + [None] * len(extra)
        self.reward_processing_classes = []
        for func, proc in zip(self.reward_funcs, reward_processing_classes):
            if isinstance(func, torch.nn.Module) and proc is None:
                proc = transformers.AutoTokenizer.from_pretrained(func.config._name_or_path)
            if proc is not None and proc.pad_token_id is None:
                proc.pad_token = proc.eos_token
            if isinstance(func, torch.nn.Module) and proc is not None:
                # the reward is read at the last non-padding token: the model must know which token pads
                config = func.config.get_text_config() if hasattr(func.config, "get_text_config") else func.config
                config.pad_token_id = proc.pad_token_id
            self.reward_processing_classes.append(proc)
        self.reward_func_names = [reward_func_name(f) for f in self.reward_funcs]
        weights = list(args.reward_weights or [1.0] * len(user)) + [1.0] * len(extra)
        if args.overlong_buffer_length is not None:
            weights.append(1.0)  # the overlong penalty enters as one more reward column
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)

    # -- the trainer's state, changed by these methods only ------------------------------------------------------
    def begin_training(self, state) -> None:
        """On (re)start: the micro-step counter follows ``global_step``, nothing is buffered, and a checkpoint
        gives back what the trainer saved in it — the rollouts of a generation batch it fell inside (a resumed run
        then follows the same schedule) and the adaptive entropy controller."""
        self._rollouts.reset(state.global_step * self.args.gradient_accumulation_steps)
        self.call_bounds.clear_stop()  # a stop belongs to the train() that asked for it
        self._total_tokens = int(state.num_input_tokens_seen or 0)
        if self.args.sync_ref_model:
            check_sync_ref_model(self.args, peft=False, sharding=sharding_kind(self.model_wrapped or self.model))
        self._weight_average = self._start_weight_average()
        if self._resume_checkpoint:
            if self.args.sync_ref_model:
                load_reference(self.accelerator.unwrap_model(self.ref_model), self._resume_checkpoint)
            if self._weight_average is not None:
                self._weight_average.load(self._resume_checkpoint)
            load_rollout_buffer(self._rollouts, self._resume_checkpoint, self.accelerator.device,
                                self.args.process_index, self.args.world_size)
            path = os.path.join(self._resume_checkpoint, ENTROPY_STATE_FILE)
            if self._entropy_ctrl is not None and os.path.isfile(path):
                self._entropy_ctrl.load_state_dict(json.loads(open(path).read()))
            path = os.path.join(self._resume_checkpoint, self._state_file_name())
            if os.path.isfile(path):
                saved = json.loads(open(path).read())
                self._refill_position = int(saved.get("refill_position", 0))
                self._last_keep_rate = saved.get("last_keep_rate")
                if self._prompt_skipper is not None and "prompt_skipper" in saved:
                    self._prompt_skipper.load_state_dict(saved["prompt_skipper"])
        if self._async is not None:
            self._async.start(state)

    def _start_weight_average(self):
        """``ema_decay``'s average, starting from the weights as they are (a resume then loads the saved one)."""
        if self.args.ema_decay is None:
            return None
        kind = sharding_kind(self.model_wrapped or self.model)
        if kind is not None:
            name = "FSDP" if kind.startswith("fsdp") else "DeepSpeed ZeRO-3"
            raise ValueError(f"ema_decay={self.args.ema_decay!r} is not supported with {name} yet (each process holds "
                             "only a shard of the weights); use DDP or ZeRO-1/2, or leave ema_decay at None")
        from .weight_average import WeightAverage

        return WeightAverage(self.accelerator.unwrap_model(self.model), self.args.ema_decay)

    def averaged_weights(self):
        """A context in which the model holds ``ema_decay``'s averaged weights (what training would deliver if it
        ended now), the trained ones restored after; without ``ema_decay``, or before training, the model as it is."""
        return self._weight_average.applied() if self._weight_average is not None else contextlib.nullcontext()

    def end_training(self, completed: bool = False) -> None:
        """After training, normally or not: the rollout producer stops; a run that completed (not interrupted, no
        error) gets ``ema_decay``'s averaged weights."""
        if self._async is not None:
            self._async.close()
        if self._stall is not None:  # after the producer's last batch: the watchdog also watches that
            self._stall.stop()
        if completed and self._weight_average is not None:
            self._weight_average.copy_to_model()

    def after_optimizer_step(self, state) -> None:
        """The reference takes its share of the policy (``sync_ref_model``, every ``ref_model_sync_steps`` steps);
        ``ema_decay``'s average moves toward the new weights; asynchronous rollouts get them (every
        ``weight_sync_steps`` steps)."""
        a = self.args
        if a.sync_ref_model and state.global_step % a.ref_model_sync_steps == 0:
            unwrap = self.accelerator.unwrap_model
            mix_into_reference(unwrap(self.model), unwrap(self.ref_model), a.ref_model_mixup_alpha)
        if self._weight_average is not None:
            self._weight_average.update()
        if self._async is not None:
            self._async.after_step(state)

    def _save_trainer_state(self, checkpoint_dir: str) -> None:
        """What a checkpoint needs beyond transformers' files (called by the checkpoint writer)."""
        save_rollout_buffer(self._rollouts, checkpoint_dir, self.args.process_index, self.args.world_size)
        if self.args.sync_ref_model and self.args.should_save:
            save_reference(self.accelerator.unwrap_model(self.ref_model), checkpoint_dir)
        if self._weight_average is not None and self.args.should_save:
            self._weight_average.save(checkpoint_dir)
        if self._entropy_ctrl is not None and self.args.should_save:
            atomic_write_text(os.path.join(checkpoint_dir, ENTROPY_STATE_FILE),
                              json.dumps(self._entropy_ctrl.state_dict()))
        atomic_write_text(os.path.join(checkpoint_dir, self._state_file_name()),
                          json.dumps({"refill_position": self._refill_position,
                                      "last_keep_rate": self._last_keep_rate,
                                      **({"prompt_skipper": self._prompt_skipper.state_dict()}
                                         if self._prompt_skipper is not None else {})}))
        if self.args.should_save:
            save_signature(self.run_signature(), checkpoint_dir)

    def run_signature(self) -> dict[str, Any]:
        """What this run's checkpoints mean (grpokit/run_dir.py): a resume with any of it changed is refused."""
        model = self.accelerator.unwrap_model(self.model)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        name = getattr(getattr(base, "config", None), "_name_or_path", None) or None
        return run_signature(self.args, name, adapter=_is_peft(model))

    def _state_file_name(self) -> str:
        """This process's own trainer state in a checkpoint (dynamic sampling's position)."""
        return f"grpokit_state_{self.args.process_index}.json"

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

    def create_optimizer(self, model=None):
        """transformers' optimizer; with ``loraplus_lr_ratio`` the adapters' B matrices in groups of their own at that
        multiple of the learning rate (:mod:`grpokit.lora_plus`). An optimizer passed in ``optimizers`` is left as
        it is."""
        given = self.optimizer is not None
        optimizer = super().create_optimizer(model)
        if self.args.loraplus_lr_ratio is not None and not given:
            from .lora_plus import split_lora_b_groups

            split_lora_b_groups(optimizer, self.model if model is None else model, self.args.loraplus_lr_ratio)
        return optimizer

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
        dataset = self.train_dataset
        if is_iterable_dataset(dataset):
            dataset = GroupRepeatIterable(dataset, self.args.num_generations,
                                          self.args.generation_batch_size // self.args.num_generations,
                                          repeats=self._rollouts.generate_every, shuffle=bool(self.args.shuffle_dataset),
                                          seed=self.args.seed)
        return self._get_dataloader(
            dataset=dataset,
            description="Training",
            batch_size=self.args.per_device_train_batch_size * self.args.steps_per_generation,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if is_iterable_dataset(dataset):  # TRL: an eval stream is shuffled with the seed and grouped
            # also for a stream first seen here (evaluate(eval_dataset=...)): every process reads it, one worker
            self.accelerator.dataloader_config.dispatch_batches = _no_dispatch(self.args)
            g = self.args.num_generations_eval or self.args.num_generations
            per_rank = self.args.per_device_eval_batch_size
            grouped = GroupRepeatIterable(dataset, g, max(1, per_rank * self.args.world_size // g), seed=self.args.seed)
            workers, self.args.dataloader_num_workers = self.args.dataloader_num_workers, 0  # for this loader only
            try:
                return self._get_dataloader(dataset=grouped, description="Evaluation", batch_size=per_rank)
            finally:
                self.args.dataloader_num_workers = workers
        return super().get_eval_dataloader(eval_dataset)

    def _get_eval_sampler(self, eval_dataset):
        g = self.args.num_generations_eval or self.args.num_generations
        return GroupRepeatSampler(len(eval_dataset), g, 1, repeats=1, shuffle=False)

    # -- rollouts and scoring ----------------------------------------------------------------------------------------
    def _prepare_inputs(self, generation_batch: list[dict]) -> RolloutBatch:
        if not self.model.training:
            return self._generate_and_score(generation_batch, mode="eval")
        if self._rollouts.needs_generation():
            if self._async is not None:  # produced ahead, from the same sampler order (the rows given are not used)
                self._rollouts.fill(self._async.next_batch())
            else:
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

    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, mode: str,
                  max_new_tokens: int | None = None) -> Generation:
        """Sample one completion per row with the current policy: an engine with its own copy of the weights (vLLM)
        gets them pushed first when they changed; otherwise the trainer's model generates (sharded weights gathered
        as ``ds3_gather_for_generation`` says)."""
        wrapped = self.model_wrapped if self.model_wrapped is not None else self.model
        unwrapped = self.accelerator.unwrap_model(self.model)
        params = self._sampling_params(mode)
        if max_new_tokens is not None:
            params.max_new_tokens = max_new_tokens
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
        """One generation batch, scored and made into the batch the loss takes: with ``dynamic_sampling`` (training)
        groups without reward spread are replaced by fresh ones first."""
        with self._adapter_merged_for_batch():
            if mode == "train" and self.args.dynamic_sampling:
                lockstep = (self.accelerator.num_processes > 1
                            and sharding_kind(self.model_wrapped or self.model) is not None)
                samples = self._sample_informative(
                    rows, lambda r: self._score_rows(r, mode), lambda name, value: self.record_metric(name, value, mode),
                    (lambda short: any_process(short, self.accelerator.device)) if lockstep else None)
            else:
                samples = self._score_rows(rows, mode)
        return self._finish_batch(samples, mode)

    def _adapter_merged_for_batch(self):
        """The backend's ``generation_batch`` context around every generation call of one batch (the LoRA merge,
        once, for the default backend), where the weights are not sharded; the log-probs (:meth:`_finish_batch`)
        are computed after it, on the restored weights."""
        enter = getattr(self.rollout, "generation_batch", None)
        if enter is None or sharding_kind(self.model_wrapped or self.model) is not None:
            return contextlib.nullcontext()
        return enter(self.accelerator.unwrap_model(self.model))

    def _score_rows(self, rows: list[dict], mode: str, generate=None, logs: dict | None = None) -> ScoredSamples:
        """Generate one completion per row (with ``rollout_func``, or the rollout backend and, with tools, the
        multi-turn loop) and score it; DAPO's overlong penalty joins the rewards as one more column. Local to this
        process (no collective), so it can run any number of times per batch. ``generate(ids, mask, max_new_tokens)``
        replaces the trainer's own sampling (a producer's copy); ``logs``: where metrics and reward-function logs go
        instead of the trainer's (a producer thread's batch keeps its own)."""
        a = self.args
        generate = generate or (lambda ids, mask, max_new_tokens=None: self._generate(ids, mask, mode, max_new_tokens))
        logs = logs if logs is not None else {"metrics": [], "reward_metrics": self._pending_reward_metrics}
        extra: dict[str, list] = defaultdict(list)
        reward_kwargs = {
            "trainer_state": self.state,
            "log_metric": lambda name, value: logs["reward_metrics"].setdefault(str(name), []).append(float(value)),
            "log_extra": lambda column, values: extra[str(column)].extend(list(values)),
        }
        limits = TurnLimits(stop_token_ids(self.model, self.processing_class), a.max_completion_length,
                            context_length(self.model))
        s = sample_and_score(rows, self.processing_class, generate, self.reward_funcs, self.reward_processing_classes,
                             chat_template_kwargs=a.chat_template_kwargs, max_prompt_length=a.max_prompt_length,
                             device=self.accelerator.device, reward_kwargs=reward_kwargs, multiturn=self.multiturn,
                             limits=limits, first_turn=self._rollout_func_turn if self.rollout_func is not None else None,
                             bounds=self.call_bounds)
        logs["metrics"] += list(s.incidents.counts.items())  # timeouts, cut tool results
        if s.tool_calls is not None:
            logs["metrics"] += [("tools/call_frequency", s.tool_calls / len(rows)),
                                ("tools/failure_frequency", s.tool_failures / s.tool_calls if s.tool_calls else 0.0)]
        s.extra_columns = {k: (list(v) + [None] * len(rows))[:len(rows)] for k, v in extra.items()}
        if s.n_truncated_prompts:
            logs["metrics"].append(("prompts/truncated_frac", s.n_truncated_prompts / len(rows)))
        if logs.get("reward_metrics") is self._pending_reward_metrics:  # the trainer's own: record now
            for name, value in logs["metrics"]:
                self.record_metric(name, value, mode)
        if a.overlong_buffer_length is not None:
            lengths = s.generation.completion_mask.sum(1)
            penalty = overlong_penalty(lengths, a.max_completion_length, a.overlong_buffer_length,
                                       a.overlong_penalty_factor)
            s.rewards = torch.cat([s.rewards, penalty.unsqueeze(1).to(s.rewards)], 1)
        return s

    def _rollout_func_turn(self, rows: list[dict], tools_per_row) -> tuple:
        """The prompts and first replies from ``rollout_func`` (TRL's contract); its extra fields join the rows."""
        from .rollout.custom import call_rollout_func, merge_fields

        prepared, generation, fields = call_rollout_func(
            self.rollout_func, [r.get("prompt") for r in rows], self, self.processing_class,
            stop_token_ids(self.model, self.processing_class), use_logprobs=self.args.use_vllm,
            has_tools=self.multiturn is not None and self.multiturn.has_tools)
        device = self.accelerator.device
        prepared.ids, prepared.mask = prepared.ids.to(device), prepared.mask.to(device)
        return prepared, generation, merge_fields(rows, fields)

    def _first_round_groups(self, need: int) -> int:
        """The groups the first generation round of a batch asks for: the batch's ``need`` and the refill prompts the
        last batch's keep rate says will be needed (:func:`grpokit.rollout.dynamic_sampling.first_round_groups`)."""
        return first_round_groups(need, self._last_keep_rate, self.args.dynamic_sampling_oversample)

    def _sample_informative(self, rows: list[dict], score, record, any_rank_short=None) -> ScoredSamples:
        """DAPO dynamic sampling (:mod:`grpokit.rollout.dynamic_sampling`) for one generation batch, the synchronous
        trainer's and the asynchronous producer's alike: ``score(rows)`` generates and scores, ``record(name, value)``
        logs. The first round holds ``rows`` and the refill prompts the last batch's keep rate asks for; extra rounds
        draw from :meth:`_refill_rows` until the batch's groups have reward spread; logs the share of generated groups
        dropped, the rounds used and what stayed unfilled, and keeps the keep rate for the next batch."""
        a, g, skipper = self.args, self.args.num_generations, self._prompt_skipper
        need = len(rows) // g
        if skipper is not None:  # GRESO: prompts on a streak of groups that scored alike, skipped before generating
            rows = skipper.keep_groups(rows, g)
        first = score(rows + self._refill_rows(self._first_round_groups(need) - len(rows) // g))
        filled, stats = fill_with_informative_groups(
            first, lambda n: score(self._refill_rows(n)), g, self.reward_weights,
            a.dynamic_sampling_max_rounds, self.processing_class.pad_token_id, any_rank_short,
            max_round_factor=a.dynamic_sampling_oversample, need=need,
            on_round=None if skipper is None else lambda batch, keep: skipper.observe(batch.prompts, g, keep))
        self._last_keep_rate = stats.keep_rate
        record("dynamic_sampling/filtered_frac", stats.dropped_groups / stats.generated_groups)
        record("dynamic_sampling/rounds", float(stats.rounds))
        record("dynamic_sampling/unfilled_frac", stats.unfilled_groups / need)
        if skipper is not None:
            record("dynamic_sampling/skipped_frac", skipper.take_skipped_frac() or 0.0)
        return filled

    def _refill_rows(self, n_groups: int) -> list[dict]:
        """``n_groups`` more prompts × ``num_generations`` for dynamic sampling, from a stream of the training set
        of its own (a seeded permutation per pass, this process taking every ``world_size``-th entry): other
        processes draw other prompts, and a resumed run draws the same ones (the position is checkpointed). With
        ``shuffle_dataset=False`` the stream walks the dataset in its order (a curriculum stays one), from the
        prompts after the sampler's first generation batch. With ``dynamic_sampling_explore_prob`` < 1 the prompts
        GRESO's filter passes over are skipped (the stream moves on past them)."""
        n, world, rank = len(self.train_dataset), self.args.world_size, self.args.process_index
        rows = []
        scanned = 0
        while len(rows) < n_groups * self.args.num_generations:
            global_pos = self._refill_position * world + rank
            index = global_pos % n
            if not self.args.shuffle_dataset:  # after the first generation batch's prompts (a global count)
                index = (global_pos + self.args.generation_batch_size // self.args.num_generations) % n
            else:
                generator = torch.Generator().manual_seed(self.args.seed + 7919 + global_pos // n)
                index = int(torch.randperm(n, generator=generator)[index])
            row = dict(self.train_dataset[index])
            self._refill_position += 1
            scanned += 1
            # a skipped prompt is passed over; after a whole pass of skips every prompt is taken (all on streaks)
            if self._prompt_skipper is None or scanned > n or self._prompt_skipper.keep(row):
                rows += [row] * self.args.num_generations
        return rows

    def _finish_batch(self, s: ScoredSamples, mode: str, behaviour_logps: torch.Tensor | None = None) -> RolloutBatch:
        """Advantages over every process's groups, the loss mask, the log-probs the loss needs, and the metrics.
        ``behaviour_logps``: the log-probs of the policy that generated the batch, when that is not the current one
        (asynchronous rollouts)."""
        a, device = self.args, self.accelerator.device
        stop_together(s.incidents.stop_cause, device)  # a stop a user-code timeout asked for: every rank, together
        self._flush_reward_logs(mode)
        gen = s.generation
        completion_mask = gen.completion_mask.to(device)
        truncated = gen.is_truncated.to(device)
        rewards_local = s.rewards.to(device)
        rewards, result, advantages = self._advantages(rewards_local, mode)
        if a.mask_truncated_completions:
            completion_mask = completion_mask * (~truncated).unsqueeze(1).long()
        batch = RolloutBatch(
            prompt_ids=s.prompt_ids.to(device), prompt_mask=s.prompt_mask.to(device),
            completion_ids=gen.completion_ids.to(device), completion_mask=completion_mask, advantages=advantages,
            num_items_in_batch=torch.zeros(()),
            sampler_logps=gen.sampler_logps.to(device) if gen.sampler_logps is not None else None,
            tool_mask=gen.tool_mask.to(device) if gen.tool_mask is not None else None,
        )
        batch.num_items_in_batch = self.accelerator.gather(batch.loss_mask.sum().reshape(1)).sum()
        if behaviour_logps is not None:
            batch.old_logps = behaviour_logps.to(device)
        self._add_behaviour_logps(batch, mode)
        lengths_local = (gen.completion_mask if gen.tool_mask is None else gen.completion_mask * gen.tool_mask).sum(1)
        self._log_rollout_metrics(mode, rewards, result, lengths_local.to(device), truncated, s.prompt_mask,
                                  batch.loss_mask)
        self._remember_samples(s, advantages, rewards_local)
        return batch

    def _flush_reward_logs(self, mode: str) -> None:
        """Reduce the metrics reward functions logged for this batch: every rank takes part for every name any rank
        used."""
        pending, self._pending_reward_metrics = self._pending_reward_metrics, defaultdict(list)
        names = sorted(pending)
        if self.accelerator.num_processes > 1:
            names = sorted(set().union(*gather_object([names])))
        for name in names:
            values = pending.get(name, [])
            totals = self.accelerator.reduce(torch.tensor([sum(values), float(len(values))],
                                                          device=self.accelerator.device), reduction="sum")
            if totals[1] > 0:
                self.record_metric(name, (totals[0] / totals[1]).item(), mode)

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
            if batch.old_logps is None and (reused or batch.sampler_logps is not None):
                batch.old_logps, _ = completion_logps(self.model, *ids, temperature=a.temperature,
                                                      compute_entropy=False, batch_size=a.per_device_train_batch_size)
            if a.beta != 0.0:
                batch.ref_logps = self._reference_logps(*ids)
        if batch.sampler_logps is None or batch.old_logps is None:
            return
        if a.vllm_importance_sampling_correction:
            batch.sampler_ratio = sampler_importance_ratio(
                batch.old_logps, batch.sampler_logps, batch.loss_mask.float(), a.vllm_importance_sampling_mode,
                a.vllm_importance_sampling_clip_min, a.vllm_importance_sampling_clip_max,
            )
        valid = batch.loss_mask.bool()
        gap = (batch.old_logps - batch.sampler_logps)[valid].abs()
        gap = gap[~torch.isnan(gap)]  # tokens the sampler could not score
        zero = gap.new_zeros(())
        self.record_metric("sampling/sampling_logp_difference/mean", gap.mean() if gap.numel() else zero, mode)
        self.record_metric("sampling/sampling_logp_difference/max", gap.max() if gap.numel() else zero, mode)
        if batch.sampler_ratio is not None:
            rho = batch.sampler_ratio
            rho = (rho.expand_as(valid)[valid] if rho.shape[-1] != 1 else rho.flatten()).float()
            for stat in ("min", "mean", "max"):
                value = getattr(rho, stat)() if rho.numel() else rho.new_zeros(())
                self.record_metric(f"sampling/importance_sampling_ratio/{stat}", value, mode)

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
            m["completions/min_terminated_length"].append(done.min().item())
            m["completions/max_terminated_length"].append(done.max().item())
        for k, name in enumerate(self.reward_func_names):
            col = rewards[:, k]
            if (~torch.isnan(col)).any():
                m[f"rewards/{name}/mean"].append(torch.nanmean(col).item())
                m[f"rewards/{name}/std"].append(nanstd(col).item())
        total = result.weighted  # the raw rewards weighted, as TRL logs them (not the normalised sum)
        mean_reward = torch.nanmean(total).item()  # NaN when no row was scored: dropped at log time, never a 0
        m["reward"].append(mean_reward)
        m["reward_std"].append(nanstd(total).item())
        m["frac_reward_zero_std"].append(result.zero_std.float().mean().item())

    def _remember_samples(self, s: ScoredSamples, advantages: torch.Tensor, rewards_local: torch.Tensor) -> None:
        """The last batch's prompts, completions, rewards and advantages, for the completions table."""
        self._last_samples = {
            "prompt": s.prompt_texts, "completion": s.completion_texts, "advantage": advantages.tolist(),
            "rewards": {name: rewards_local[:, k].tolist() for k, name in enumerate(self.reward_func_names)},
            "extra": s.extra_columns,
        }

    # -- loss ------------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs: RolloutBatch, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("GRPOTrainer.compute_loss does not return outputs")
        a = self.args
        mode = "train" if self.model.training else "eval"
        mask = inputs.loss_mask.float()
        aux = [] if self.router_aux_loss_coef else None
        logps, entropies = completion_logps(
            model, inputs.prompt_ids, inputs.prompt_mask, inputs.completion_ids, inputs.completion_mask,
            temperature=a.temperature, compute_entropy=True, entropy_grad=self._entropy_bonus_on(), aux_losses=aux,
        )
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1
        scale = LossScale(max_completion_length=a.max_completion_length, num_items_in_batch=inputs.num_items_in_batch,
                          gradient_accumulation_steps=ga,
                          steps_per_generation=a.steps_per_generation if mode == "train" else 1,
                          num_processes=self.accelerator.num_processes)
        gather = self._gather_entropies if self.accelerator.num_processes > 1 else None
        out = policy_loss(
            logps, inputs.old_logps, inputs.advantages, mask, self.loss_settings, scale=scale,
            ref_logps=inputs.ref_logps, sampler_ratio=inputs.sampler_ratio, sampler_logps=inputs.sampler_logps,
            entropies=entropies, entropy_gather=gather,
        )
        loss = out.loss
        if self._entropy_bonus_on():
            loss = loss + self._entropy_term(out.loss, entropies, mask, ga, mode, gather)
        if aux:
            aux_loss = torch.stack([x.float() for x in aux]).mean()
            loss = loss + self.router_aux_loss_coef * aux_loss / ga
            self.record_metric("aux_loss", aux_loss.detach(), mode)
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

    @property
    def entropy_coef(self) -> float:
        """TRL's attribute: the entropy-bonus coefficient (with ``use_adaptive_entropy``, the controller's current
        value, applied while the entropy is at or below ``entropy_target``; else ``args.entropy_coef``)."""
        return self._entropy_ctrl.coef if self._entropy_ctrl is not None else self.args.entropy_coef

    def _entropy_bonus_on(self) -> bool:
        return self.args.entropy_coef != 0.0 or self._entropy_ctrl is not None

    def _entropy_term(self, policy_term, entropies, mask, ga: int, mode: str, gather) -> torch.Tensor:
        """The entropy bonus of this micro-batch on the tokens the policy term acts on, at the coefficient of this
        optimizer step; with ``use_adaptive_entropy`` the step's entropy updates the coefficient for the next one.
        Logs ``policy_loss`` (the policy term alone, as TRL reports it) and ``entropy_coef``."""
        a = self.args
        if a.top_entropy_quantile < 1.0:
            mask = mask * high_entropy_mask(entropies, mask, a.top_entropy_quantile, gather)
        coef = self._entropy_ctrl.applied() if self._entropy_ctrl is not None else a.entropy_coef
        global_mean = self.loss_settings.spec.aggregation == "global_token_mean"
        self.record_metric("policy_loss", policy_term.detach() * (1 if global_mean else ga), mode)
        if self._entropy_ctrl is not None and mode == "train":
            stats = torch.stack([(entropies.detach() * mask).sum(), mask.sum()])
            self._entropy_window = stats if self._entropy_window is None else self._entropy_window + stats
            if self.accelerator.sync_gradients:
                total = self.accelerator.reduce(self._entropy_window, reduction="sum")
                self._entropy_ctrl.update((total[0] / total[1].clamp(min=1.0)).item())
                self._entropy_window = None
        if mode == "train" and self.accelerator.sync_gradients:
            self.record_metric("entropy_coef", self._entropy_ctrl.coef if self._entropy_ctrl is not None else coef,
                               mode)
        return entropy_bonus(entropies, mask, coef, ga)

    def _gather_entropies(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's valid-token entropies (ranks hold different counts: padded with NaN, gathered, dropped)."""
        padded = self.accelerator.pad_across_processes(values, dim=0, pad_index=float("nan"))
        everyone = self.accelerator.gather(padded)
        return everyone[~torch.isnan(everyone)]

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's method, for code written against it: True for the valid tokens whose entropy is at least the
        ``threshold`` quantile of every rank's valid-token entropies (TRL passes ``1 - top_entropy_quantile``).
        :func:`grpokit.algorithms.high_entropy_mask` with ``top_quantile = 1 - threshold``."""
        gather = self._gather_entropies if self.accelerator.num_processes > 1 else None
        return high_entropy_mask(entropies, mask, 1.0 - threshold, gather).bool()

    @staticmethod
    def get_off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor,
                            sampling_per_token_logps: torch.Tensor, mask: torch.Tensor,
                            off_policy_threshold: float) -> torch.Tensor:
        """TRL's method, for code written against it: the off-policy sequence mask, (B, 1) — 0 for rows with a
        negative advantage whose mean sampler-to-policy log-ratio exceeds the threshold.
        :func:`grpokit.algorithms.off_policy_sequence_mask`."""
        return off_policy_sequence_mask(advantages, per_token_logps, sampling_per_token_logps, mask,
                                        off_policy_threshold)

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
        if self.accelerator.num_processes > 1:  # every rank logs at the same steps: reduce over ranks
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
            log_completions_table(s["prompt"], s["completion"], s["rewards"], s["advantage"], self.state.global_step,
                                  max_rows=self.args.num_completions_to_print or 8, extra=s["extra"])
            self._save_completions(s)
            self._last_samples = None  # shown once: the end-of-training summary log does not repeat it

    def _save_completions(self, s: dict[str, Any]) -> None:
        """As TRL: ``output_dir/completions/completions_<step>.parquet``, and a ``completions`` table to wandb when it
        is a reporting target (one row per prompt with ``log_unique_prompts``)."""
        import io

        from .reporting.tables import completions_frame

        frame = completions_frame(self.state.global_step, s["prompt"], s["completion"], s["rewards"], s["advantage"],
                                  s["extra"], unique_prompts=self.args.log_unique_prompts)
        buffer = io.BytesIO()
        frame.to_parquet(buffer)
        atomic_write_bytes(os.path.join(self.args.output_dir, "completions",
                                        f"completions_{self.state.global_step:05d}.parquet"), buffer.getvalue())
        if "wandb" in (self.args.report_to or []):
            import wandb

            if wandb.run is not None:
                wandb.log({"completions": wandb.Table(dataframe=frame)})


def _load_policy(model, model_id, processing_class, args: GRPOConfig, quantization_config=None):
    """The policy model (loaded when given by name, quantised with ``quantization_config``) and its tokenizer,
    padded on the left; the model's configs learn the pad token; dropout off with ``disable_dropout``."""
    if isinstance(model, str):
        from .models import load_model

        init_kwargs = dict(args.model_init_kwargs or {})
        if quantization_config is not None:
            if "quantization_config" in init_kwargs:
                raise ValueError("quantization_config is given both to GRPOTrainer and in GRPOConfig.model_init_kwargs; "
                                 "give it once (to the trainer)")
            init_kwargs["quantization_config"] = quantization_config
        model = load_model(model, trust_remote_code=args.trust_remote_code, **init_kwargs)
    else:
        for what, value in (("model_init_kwargs", args.model_init_kwargs), ("quantization_config", quantization_config)):
            if value:
                logger.warning("%s is ignored: the model was passed already loaded", what)
    if processing_class is None:
        from .models import load_tokenizer

        processing_class = load_tokenizer(model_id if isinstance(model_id, str) else model.name_or_path,
                                          trust_remote_code=args.trust_remote_code)
    processing_class.padding_side = "left"
    if processing_class.pad_token_id is None:
        processing_class.pad_token = processing_class.eos_token
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    config.pad_token_id = processing_class.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = processing_class.pad_token_id
    if args.disable_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    return model, processing_class


def _is_peft(model) -> bool:
    return getattr(model, "peft_config", None) is not None and hasattr(model, "disable_adapter")


def _default_rollout(model, processing_class, args: GRPOConfig):
    """The generation backend the config asks for: vLLM, transformers' continuous batching, or ``generate``."""
    if args.use_vllm:
        from .rollout.vllm_backend import VLLMRollout

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return VLLMRollout(base.name_or_path, processing_class, args, process_index=args.process_index)
    if args.use_transformers_continuous_batching:
        from .rollout.continuous_batching import ContinuousBatchingRollout

        return ContinuousBatchingRollout(processing_class, args.transformers_continuous_batching_config)
    return TransformersRollout(processing_class)


def _check_vocabulary(model, tokenizer) -> None:
    """A tokenizer with more tokens than the model has embeddings would crash the forward on the first such id."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    if rows is not None and size is not None and size > rows:
        raise ValueError(f"the tokenizer has {size} tokens but the model's embedding has {rows} rows: ids from {rows} on "
                         "would fail in the forward; use the model's own tokenizer, or call "
                         "model.resize_token_embeddings(len(tokenizer)) first")


def _add_adapter(model, peft_config, args: GRPOConfig):
    """Wrap the policy with a PEFT adapter. A QLoRA base (4-/8-bit) keeps its adapter in bf16 (the QLoRA paper's
    recommendation, as TRL does)."""
    from peft import PeftConfig, get_peft_model

    if not isinstance(peft_config, PeftConfig):
        raise TypeError(f"peft_config must be a peft.PeftConfig (e.g. peft.LoraConfig), got {type(peft_config).__name__}")
    if _is_peft(model):
        raise ValueError("a PeftModel was passed together with peft_config: merge and unload the existing adapter "
                         "first, or pass the PeftModel without peft_config")
    quantized = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
    try:
        model = get_peft_model(model, peft_config)
    except ValueError as e:
        if "not found in the base model" not in str(e) and "no modules were targeted" not in str(e).lower():
            raise
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"peft_config.target_modules={short_repr(getattr(peft_config, 'target_modules', None))} "
                         f"matches no module of the model; its linear modules are named {', '.join(linear)} "
                         "(or use 'all-linear')") from None
    if args.gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    if quantized:
        for name, param in model.named_parameters():
            if param.requires_grad and "lora_magnitude_vector" not in name:
                param.data = param.data.to(torch.bfloat16)
    return model


def _keep_4bit_layers_trainable(model) -> None:
    """bitsandbytes (0.50) repacks a 4-bit weight for its CPU kernel on the first forward in eval mode without
    gradient (generation) and never unpacks it for training, whose matmuls then have no backward: an adapter on a
    4-bit base would get no gradient after the first rollout. Keep the trainable layout (CPU only)."""
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False


def _check_datasets(args: GRPOConfig, train_dataset, eval_dataset) -> None:
    """Before a model is loaded: the datasets have prompts, and enough of them for one generation batch. A stream
    (``IterableDataset``) needs ``max_steps`` (its length is unknown) and every process reading it
    (``dispatch_batches=False``, no dataloader workers, which would interleave and split groups), as in TRL."""
    check_dataset("train_dataset", train_dataset)
    evals = list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]
    if any(is_iterable_dataset(d) for d in [train_dataset, *evals]):
        args.accelerator_config.dispatch_batches = _no_dispatch(args)
    if args.max_staleness > 0:
        if is_iterable_dataset(train_dataset):
            raise ValueError("max_staleness > 0 is not supported with an IterableDataset train_dataset yet: the rollout "
                             "producer reads generation batches ahead by index; use a map-style Dataset")
        if args.world_size > 1 and args.use_vllm and args.vllm_mode == "server":
            raise ValueError("max_staleness > 0 with vllm_mode='server' on several processes is not supported: the "
                             "server's one client gathers every rank's prompts, a collective a producer thread cannot "
                             "make; use vllm_mode='colocate'")
    if is_iterable_dataset(train_dataset):
        if args.dynamic_sampling:
            raise ValueError("dynamic_sampling=True is not supported with an IterableDataset train_dataset yet: it draws "
                             "replacement prompts from the training set by index; use a map-style Dataset")
        if args.max_steps <= 0:
            raise ValueError(f"max_steps={args.max_steps!r} is not allowed with an IterableDataset train_dataset: its "
                             "length is unknown, so set max_steps to a positive number of optimizer steps")
        if args.dataloader_num_workers:
            logger.warning("dataloader_num_workers=%d set to 0: workers would interleave the stream and split the "
                           "groups of num_generations completions", args.dataloader_num_workers)
            args.dataloader_num_workers = 0
    if eval_dataset is not None and not isinstance(eval_dataset, dict):
        check_dataset("eval_dataset", eval_dataset)
    if train_dataset is not None and hasattr(train_dataset, "__len__"):
        check_prompt_count(len(train_dataset), args.generation_batch_size // args.num_generations,
                           f"generation_batch_size {args.generation_batch_size} / num_generations "
                           f"{args.num_generations}")


def _no_dispatch(args: GRPOConfig) -> bool:
    """``dispatch_batches`` for a stream (``IterableDataset``): False, every process reads it; True is refused."""
    if args.accelerator_config.dispatch_batches is True:
        raise ValueError("accelerator_config.dispatch_batches=True is not allowed: Iterable datasets require "
                         "`dispatch_batches=False` (every process reads the stream); use False or leave it unset")
    return False


def _reduce_metrics(values_by_key: dict[str, list]) -> dict[str, float]:
    """Each metric's values since the last log — over micro-steps, then over ranks (tensors converted here, at log
    time: no host sync per micro-step), NaNs skipped: the mean; counters (``skipped_nonfinite``, ``..._total``)
    summed; keys named ``.../min``, ``..._min`` (``max``) take the extreme."""
    out = {}
    for key, values in values_by_key.items():
        nums = [float(v.item()) if isinstance(v, torch.Tensor) else float(v) for v in values]
        nums = [v for v in nums if v == v]
        if not nums:
            continue
        if key == "skipped_nonfinite" or key.endswith("_total"):
            out[key] = sum(nums)
        elif key.endswith(("/min", "_min")):
            out[key] = min(nums)
        elif key.endswith(("/max", "_max")):
            out[key] = max(nums)
        else:
            out[key] = sum(nums) / len(nums)
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


def _router_aux_loss_coef(model, args: GRPOConfig) -> float:
    """The MoE load-balancing loss coefficient, as TRL: ``router_aux_loss_coef``, or the model config's when None;
    0 (off) for a model that does not return router logits. A coefficient set for a dense model is an error."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(base, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    is_moe = hasattr(text, "output_router_logits")
    coef = args.router_aux_loss_coef
    if coef is None:
        coef = float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)
    elif coef != 0.0 and not is_moe:
        raise ValueError(f"router_aux_loss_coef={coef!r} is not allowed: {type(base).__name__} is not a "
                         "Mixture-of-Experts model that returns router logits; leave it None")
    return float(coef) if is_moe else 0.0


def _multiturn(tools, environment_factory, args: GRPOConfig):
    """The trainer's tools and environments (None without either); checked before any model is loaded."""
    from .tools import MultiTurn, check_tools

    tools = check_tools(tools)
    if not tools and environment_factory is None:
        if args.max_tool_calling_iterations is not None:
            logger.warning("max_tool_calling_iterations=%s has no effect without tools or an environment_factory",
                           args.max_tool_calling_iterations)
        return None
    return MultiTurn(tools, environment_factory, args.max_tool_calling_iterations, args.chat_template_kwargs)


def _default_dataset(train_dataset, environment_factory, args: GRPOConfig):
    """Without a train_dataset, an environment that makes its own prompts trains on empty user turns (one
    generation batch of them, repeated), as in TRL; anything else needs a dataset."""
    if train_dataset is not None:
        return train_dataset
    if environment_factory is None:
        raise ValueError("`train_dataset` is required: pass a train_dataset, or an environment_factory whose "
                         "environments make their own prompts (with max_steps)")
    if isinstance(environment_factory, dict):
        raise ValueError("a dict environment_factory (several environments) needs a train_dataset with an "
                         "'environment' column saying which one each prompt uses")
    if args.max_steps <= 0:
        raise ValueError(f"max_steps={args.max_steps!r} is not allowed without a train_dataset: set max_steps to a "
                         "positive number of optimizer steps (the environment makes the prompts)")
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] *
                                        (args.generation_batch_size // args.num_generations)})
