"""``GRPOTrainer``: ``transformers.Trainer`` glue around the rollout pipeline and the policy loss.

    dataloader ──> RolloutPipeline ──> RolloutBuffer ──> compute_loss (policy_loss) ──> optimizer (Trainer)
    (pipeline.prompts)  (grpokit/pipeline/)  (batch.py)      (algorithms/)

One dataloader batch is one *generation batch* (:class:`grpokit.pipeline.GroupRepeatSampler`): on the first of its
``steps_per_generation × num_iterations`` micro-steps the pipeline turns it into a scored
:class:`grpokit.batch.RolloutBatch` (or, with ``max_staleness`` > 0, hands over the batch its producer generated
ahead from the same prompt order); the :class:`grpokit.batch.RolloutBuffer` splits it into ``steps_per_generation``
micro-batches and serves them on the following micro-steps. Setup lives with what it sets up (the policy:
:mod:`grpokit.training.policy`; rewards: :mod:`grpokit.rewards.setup`; the pipeline: :mod:`grpokit.pipeline.build`;
datasets: :mod:`grpokit.data`; ...); what the pipeline needs from the trainer in :mod:`grpokit.trainer_driver`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any

import torch
import transformers
from accelerate.utils import gather_object
from transformers import PreTrainedModel, Trainer, TrainerCallback

from .algorithms import LossScale, LossSettings, policy_loss
from .algorithms.importance import SamplerCorrection
from .algorithms.masks import high_entropy_mask, off_policy_sequence_mask
from .algorithms.sampling_support import SamplingSupport
from .batch import RolloutBatch, RolloutBuffer
from .callbacks import install_hooks
from .config import GRPOConfig
from .data import check_datasets, default_dataset, is_iterable_dataset, no_dispatch
from .forward.fused_lora import fused_lora
from .forward.logprobs import completion_logps
from .forward.sharding import sharding_kind
from .models import cast_lm_head_to_fp32
from .moe import MoeRouting
from .moe.training import route_recording_absent
from .pipeline import GroupRepeatIterable, GroupRepeatSampler
from .pipeline.build import build_pipeline
from .pipeline.producer import AsyncRollouts
from .pipeline.workers import RolloutWorkers, check_crossing
from .rewards.setup import setup_rewards
from .rollout.backends import default_rollout
from .rollout.base import stop_token_ids
from .run.checkpoint_parts import load_parts, save_parts
from .run.checkpoints import CheckpointingMixin, rng_state
from .run.run_dir import run_signature, save_signature
from .tools.session import multiturn_parts
from .trainer_driver import TrainerDriver
from .training.entropy_control import EntropyBonus
from .training.gradient_guard import guard_gradients
from .training.metrics import MetricsStore
from .training.policy import add_adapter, check_vocabulary, is_peft, keep_4bit_layers_trainable, load_policy
from .training.reference import ReferenceWeights, check_sync_ref_model, mix_into_reference
from .training.weight_average import start_weight_average
from .vision.setup import setup_vision

logger = logging.getLogger("grpokit")


def _identity(batch: list) -> list:
    return batch


class GRPOTrainer(CheckpointingMixin, Trainer):
    """Group Relative Policy Optimization and its family; a drop-in for ``trl.GRPOTrainer``.

    Checkpoints are written atomically, checked before a resume (``resume_from_checkpoint`` also takes
    ``"auto"``), and a first SIGINT/SIGTERM during ``train()`` saves one at the next step boundary and stops
    (:mod:`grpokit.run.checkpoints`).

    Args:
        model: a ``PreTrainedModel``, a local directory, a hub id, a ``.gguf`` file, or ``"smollm2-135m-instruct"``.
        reward_funcs: a function, a reward model, a built-in reward name or ``module:function``, or a list.
        args: :class:`GRPOConfig`.
        train_dataset / eval_dataset: datasets with a ``prompt`` column (text or chat messages); every other
            column is passed to the reward functions by name.
        processing_class: the tokenizer, or a vision-language model's processor (loaded from the model when None;
            docs/vision.md); padding is set to the left.
        reward_processing_classes: tokenizers of reward models, in the order of ``reward_funcs``.
        peft_config: a ``peft`` config; the model is wrapped with it (LoRA) and the reference policy, when
            ``beta != 0``, is the same model with the adapter disabled.
        rollout_backend: an object with the :class:`grpokit.rollout.base.RolloutBackend` interface
            (default: transformers ``generate``).

    Public parts, for code that extends a run: ``pipeline`` (:class:`grpokit.pipeline.RolloutPipeline`),
    ``rollout_buffer``, ``metrics_store``, ``weight_average`` (``ema_decay``), ``entropy_bonus`` and
    :meth:`checkpoint_parts`.
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
        self.multiturn = multiturn_parts(tools, environment_factory, args)  # tools checked before a model is loaded
        if rollout_func is not None and not callable(rollout_func):
            raise ValueError(f"rollout_func={rollout_func!r:.80} is not callable; expected rollout_func(prompts, trainer)")
        self.rollout_func = rollout_func
        train_dataset = default_dataset(train_dataset, environment_factory, args)
        check_datasets(args, train_dataset, eval_dataset)
        check_crossing(args, reward_funcs, tools, environment_factory, rollout_func, train_dataset)  # rollout_workers
        transformers.set_seed(args.seed)  # before the model and its adapter are made: LoRA's init is random
        model, processing_class = load_policy(model, model_id, processing_class, args, quantization_config)
        check_vocabulary(model, processing_class)
        setup_vision(model, processing_class, args, train_dataset, eval_dataset, rollout_func=rollout_func,
                     peft_config=peft_config)  # images need a VLM and its processor; freeze_vision
        if self.multiturn is not None:
            self.multiturn.check_template(processing_class)
        self.ref_model = None
        if peft_config is not None:
            model = add_adapter(model, peft_config, args)
        elif args.beta != 0.0:  # a PeftModel passed in: its adapter as it is now is the reference (TRL's "ref" copy)
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        check_sync_ref_model(args, peft=is_peft(model), sharding=None)
        if args.cast_lm_head_to_fp32:
            for m in (model, self.ref_model):
                if m is not None:
                    cast_lm_head_to_fp32(m)
        keep_4bit_layers_trainable(model)
        rewards = setup_rewards(reward_funcs, reward_processing_classes, args, self.multiturn)
        self.reward_funcs, self.reward_processing_classes = rewards.funcs, rewards.processing_classes
        self.reward_func_names, self.reward_weights = rewards.names, rewards.weights
        self.loss_settings = LossSettings.from_config(args)
        self.entropy_bonus = EntropyBonus(args)
        self.rollout = rollout_backend or default_rollout(model, processing_class, args)
        self.moe = MoeRouting(model, args, no_recording=route_recording_absent(self.rollout, rollout_func, self.multiturn,
                                                                               model))
        self.router_aux_loss_coef = self.moe.aux_loss_coef
        self.aux_loss_enabled = self.router_aux_loss_coef != 0.0  # TRL's attribute: the MoE router loss is added
        self.metrics_store = MetricsStore()
        self.rollout_buffer = RolloutBuffer(args.steps_per_generation, args.steps_per_generation * args.num_iterations)
        # what the sampler does to its distribution, replayed on the trainer's side of the mismatch
        self.sampling_support = SamplingSupport.from_config(args, stop_token_ids(model, processing_class))
        self.pipeline = build_pipeline(model, processing_class, rewards, args, train_dataset, self.multiturn,
                                       rollout_func, self, self.rollout_buffer.generate_every, self.sampling_support)
        self.driver = TrainerDriver(self)
        self.weight_average = None  # ema_decay's average of the trained weights, made when training starts
        self._last_samples: dict[str, Any] | None = None  # the last batch's completions, for the completions table
        super().__init__(model=model, args=args, data_collator=_identity, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)
        self.stall_watchdog = install_hooks(self)  # TrainerHooks; with stall_timeout_s the watchdog (bounds/watchdog.py)
        if self.ref_model is not None:
            self.ref_model = self.accelerator.prepare_model(self.ref_model, evaluation_mode=True)
        for i, func in enumerate(self.reward_funcs):
            if isinstance(func, torch.nn.Module):
                self.reward_funcs[i] = self.accelerator.prepare_model(func.eval(), evaluation_mode=True)

    # -- the trainer's state, changed by these methods only ------------------------------------------------------
    def begin_training(self, state) -> None:
        """On (re)start: the micro-step counter follows ``global_step``, nothing is buffered, a checkpoint gives back
        every part it holds (:meth:`checkpoint_parts`), and with ``max_staleness`` > 0 the rollout producer starts
        from the next generation batch the learner needs."""
        a = self.args
        self.rollout_buffer.reset(state.global_step * a.gradient_accumulation_steps, device=self.accelerator.device)
        self.pipeline.bounds.clear_stop()  # a stop belongs to the train() that asked for it
        sharding = sharding_kind(self.model_wrapped or self.model)
        if a.sync_ref_model:
            check_sync_ref_model(a, peft=False, sharding=sharding)
        self.weight_average = start_weight_average(a.ema_decay, self.accelerator.unwrap_model(self.model), sharding)
        if self._resume_checkpoint:
            load_parts(self.checkpoint_parts(), self._resume_checkpoint, a.process_index, a.world_size)
        if a.max_staleness > 0 or a.rollout_workers > 0:
            kind = RolloutWorkers if a.rollout_workers > 0 else AsyncRollouts  # processes, or a thread
            producer = kind(self.pipeline, self.driver, self.train_dataset, a)
            self.pipeline.run_ahead(producer, lambda: producer.start(state.global_step, self.rollout_buffer.generate_every))

    def checkpoint_parts(self) -> list:
        """Everything a checkpoint holds beyond transformers' files, as stateful parts (grpokit/run/checkpoint_parts.py):
        the unconsumed micro-batches, the pipeline's state, the adaptive entropy controller, ``ema_decay``'s average
        and ``sync_ref_model``'s reference."""
        reference = (ReferenceWeights(self.accelerator.unwrap_model(self.ref_model)) if self.args.sync_ref_model
                     else None)
        parts = [self.rollout_buffer, self.pipeline, self.entropy_bonus, self.weight_average, reference]
        return [p for p in parts if p is not None]

    def averaged_weights(self):
        """A context in which the model holds ``ema_decay``'s averaged weights (what training would deliver if it
        ended now), the trained ones restored after; without ``ema_decay``, or before training, the model as it is."""
        return self.weight_average.applied() if self.weight_average is not None else contextlib.nullcontext()

    def end_training(self, completed: bool = False) -> None:
        """After training, normally or not: the rollout producer stops; a run that completed (not interrupted, no
        error) gets ``ema_decay``'s averaged weights."""
        self.pipeline.stop()
        if self.stall_watchdog is not None:  # after the producer's last batch: the watchdog also watches that
            self.stall_watchdog.stop()
        if completed and self.weight_average is not None:
            self.weight_average.copy_to_model()

    def after_optimizer_step(self, state) -> None:
        """The reference takes its share of the policy (``sync_ref_model``, every ``ref_model_sync_steps`` steps);
        ``ema_decay``'s average moves toward the new weights; asynchronous rollouts get them (every
        ``weight_sync_steps`` steps)."""
        a = self.args
        if a.sync_ref_model and state.global_step % a.ref_model_sync_steps == 0:
            unwrap = self.accelerator.unwrap_model
            mix_into_reference(unwrap(self.model), unwrap(self.ref_model), a.ref_model_mixup_alpha)
        if self.weight_average is not None:
            self.weight_average.update()
        if self.pipeline.producer is not None:
            self.pipeline.producer.after_step(state.global_step)

    def _save_trainer_state(self, checkpoint_dir: str) -> None:
        """What a checkpoint needs beyond transformers' files (called by the checkpoint writer)."""
        a = self.args
        save_parts(self.checkpoint_parts(), checkpoint_dir, a.process_index, a.world_size, a.should_save)
        if a.should_save:
            save_signature(self.run_signature(), checkpoint_dir)

    def run_signature(self) -> dict[str, Any]:
        """What this run's checkpoints mean (grpokit/run/run_dir.py): a resume with any of it changed is refused."""
        model = self.accelerator.unwrap_model(self.model)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        name = getattr(getattr(base, "config", None), "_name_or_path", None) or None
        return run_signature(self.args, name, adapter=is_peft(model))

    def record_metric(self, name: str, value: float | torch.Tensor, mode: str = "train") -> None:
        """Add a value to the metrics averaged (counters: summed) into the next log line."""
        self.metrics_store.record(name, value, mode)

    def save_checkpoint(self) -> str:
        """Save a checkpoint of the current state now (atomically, as the periodic ones); returns its path."""
        self._save_checkpoint(self.model, None)
        return f"{self.args.output_dir}/checkpoint-{self.state.global_step}"

    def guard_gradients(self, state) -> None:
        """Before an optimizer step: a non-finite gradient never reaches the weights (:mod:`grpokit.training.gradient_guard`)."""
        norm, self._last_grad_norm = getattr(self, "_last_grad_norm", None), None  # the Trainer's, just taken
        guard_gradients(self, state, norm)

    def _get_grad_norm(self, model, grad_norm=None):
        # kept for guard_gradients, which runs right after (on_pre_optimizer_step)
        self._last_grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        return self._last_grad_norm

    def create_optimizer(self, model=None):
        """transformers' optimizer; with ``loraplus_lr_ratio`` the adapters' B matrices in groups of their own at that
        multiple of the learning rate (:mod:`grpokit.training.lora_plus`). An optimizer passed in ``optimizers`` is left as
        it is."""
        given = self.optimizer is not None
        optimizer = super().create_optimizer(model)
        if self.args.loraplus_lr_ratio is not None and not given:
            from .training.lora_plus import split_lora_b_groups

            split_lora_b_groups(optimizer, self.model if model is None else model, self.args.loraplus_lr_ratio)
        return optimizer

    # -- data ------------------------------------------------------------------------------------------------------
    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return GroupRepeatSampler(
            num_prompts=len(dataset),
            num_generations=self.args.num_generations,
            prompts_per_batch=self.args.generation_batch_size // self.args.num_generations,
            repeats=self.rollout_buffer.generate_every,
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
                                          repeats=self.rollout_buffer.generate_every, shuffle=bool(self.args.shuffle_dataset),
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
            self.accelerator.dataloader_config.dispatch_batches = no_dispatch(self.args)
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

    # -- rollouts --------------------------------------------------------------------------------------------------
    def _prepare_inputs(self, generation_batch: list[dict] | RolloutBatch) -> RolloutBatch:
        if isinstance(generation_batch, RolloutBatch):  # prepared already (training_step)
            return generation_batch
        if not self.model.training:
            batch, stats = self.pipeline.evaluation_batch(generation_batch, self.driver)
            self._take_rollout_stats(stats, "eval")
            return batch
        if self.rollout_buffer.needs_generation():
            self.rollout_rng_state = rng_state()  # what a checkpoint of a rollout stuck below records (checkpoints.py)
            batch, stats = self.pipeline.next_batch(generation_batch, self.driver)
            self._take_rollout_stats(stats, "train")
            self.rollout_buffer.fill(batch)
        return self.rollout_buffer.next()

    def _take_rollout_stats(self, stats, mode: str) -> None:
        """A batch's :class:`grpokit.pipeline.RolloutStats` into the log: its metrics, the tokens seen so far, its
        completions for the completions table."""
        if mode == "train":
            self.state.num_input_tokens_seen = int(self.state.num_input_tokens_seen or 0) + stats.tokens
        self.record_metric("num_tokens", float(self.state.num_input_tokens_seen or 0), mode)
        self.metrics_store.record_stats(stats, mode)
        if stats.samples is not None:
            self._last_samples = stats.samples

    # -- loss ------------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs: RolloutBatch, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("GRPOTrainer.compute_loss does not return outputs")
        a = self.args
        mode = "train" if self.model.training else "eval"
        mask = inputs.loss_mask.float()
        aux = [] if self.router_aux_loss_coef else None
        bonus = self.entropy_bonus
        # a sampler's log-probs and no behaviour policy's: this forward is the policy that sampled (on-policy), and
        # the mismatch between the two is measured here (pipeline/finishing.py leaves it to this forward)
        measures_mismatch = inputs.sampler_logps is not None and inputs.old_logps is None
        support = self.sampling_support if measures_mismatch else None
        on_support: list | None = [] if support is not None and support.reshapes else None
        logps, entropies = completion_logps(
            model, inputs.prompt_ids, inputs.prompt_mask, inputs.completion_ids, inputs.completion_mask,
            temperature=a.temperature, compute_entropy=True, entropy_grad=bonus.enabled, aux_losses=aux,
            vision=inputs.vision, support=support, on_support=on_support,
        )
        sampler_ratio = inputs.sampler_ratio
        if measures_mismatch:  # rows are whole here: the sequence modes see whole sequences
            sampler_ratio, mismatch = SamplerCorrection.from_config(a)(
                on_support[0] if on_support else logps.detach(), inputs.sampler_logps, inputs.loss_mask)
            for name, value in mismatch.items():
                self.record_metric(f"sampling/{name}", value, mode)
        self.moe.record_metrics(logps, inputs, lambda name, value: self.record_metric(name, value, mode))
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1
        scale = LossScale(max_completion_length=a.max_completion_length, num_items_in_batch=inputs.num_items_in_batch,
                          gradient_accumulation_steps=ga,
                          steps_per_generation=a.steps_per_generation if mode == "train" else 1,
                          num_processes=self.accelerator.num_processes)
        gather = self._gather_entropies if self.accelerator.num_processes > 1 else None
        out = policy_loss(
            logps, inputs.old_logps, inputs.advantages, mask, self.loss_settings, scale=scale,
            ref_logps=inputs.ref_logps, sampler_ratio=sampler_ratio, sampler_logps=inputs.sampler_logps,
            entropies=entropies, entropy_gather=gather,
        )
        loss = out.loss
        if bonus.enabled:
            global_mean = self.loss_settings.spec.aggregation == "global_token_mean"
            loss = loss + bonus.term(
                out.loss, entropies, mask, ga, mode, gather, end_of_step=self.accelerator.sync_gradients,
                sum_over_processes=lambda t: self.accelerator.reduce(t, reduction="sum"),
                record=lambda name, value: self.record_metric(name, value, mode),
                policy_term_scale=1 if global_mean else ga)
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
        return self.entropy_bonus.coef

    def _gather_entropies(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's valid-token entropies (ranks hold different counts: padded with NaN, gathered, dropped)."""
        padded = self.accelerator.pad_across_processes(values, dim=0, pad_index=float("nan"))
        everyone = self.accelerator.gather(padded)
        return everyone[~torch.isnan(everyone)]

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's method: True for the valid tokens whose entropy is at least the ``threshold`` quantile of every rank's
        valid-token entropies (TRL passes ``1 - top_entropy_quantile``); ``algorithms.high_entropy_mask``."""
        gather = self._gather_entropies if self.accelerator.num_processes > 1 else None
        return high_entropy_mask(entropies, mask, 1.0 - threshold, gather).bool()

    @staticmethod
    def get_off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor,
                            sampling_per_token_logps: torch.Tensor, mask: torch.Tensor,
                            off_policy_threshold: float) -> torch.Tensor:
        """TRL's method: the off-policy sequence mask, (B, 1) — 0 for rows with a negative advantage whose mean
        sampler-to-policy log-ratio exceeds the threshold (:func:`grpokit.algorithms.off_policy_sequence_mask`)."""
        return off_policy_sequence_mask(advantages, per_token_logps, sampling_per_token_logps, mask,
                                        off_policy_threshold)

    def _skipped_loss(self, model) -> torch.Tensor:
        """The loss of a skipped micro-step: zero, and not computed from the non-finite values (0·NaN is NaN). On one
        process it reaches no parameter, so a step whose micro-steps are all skipped leaves the weights and the
        optimizer state untouched; under DDP every parameter must take part in backward, so it is 0·θ."""
        if self.accelerator.num_processes > 1:
            return sum(p.view(-1)[:1].sum() for p in model.parameters() if p.requires_grad) * 0.0
        return torch.zeros((), device=self.accelerator.device, requires_grad=True)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """transformers' training step, the rollouts taken first: the loss's forward and its backward (with gradient
        checkpointing, the recomputed forward too) then run with each plain LoRA layer as one autograd operation
        (:func:`grpokit.forward.fused_lora.fused_lora`), and generation, outside it, folds the adapters into its own
        weights as before."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        with fused_lora(model), self.moe.training_forward(model, inputs):  # MoE: routing replayed, forward and backward
            return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # -- logging ---------------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = self.metrics_store.take(mode, gather_object if self.accelerator.num_processes > 1 else None)
        if mode == "eval":
            metrics = {f"eval_{k}": v for k, v in metrics.items()}
        super().log({**logs, **metrics}, start_time)
        if self.args.log_completions and self._last_samples and self.accelerator.is_main_process:
            from .reporting.tables import log_completions, tensorboard_writer

            log_completions(self._last_samples, self.state.global_step, self.args.output_dir,
                            max_rows=self.args.num_completions_to_print or 8,
                            unique_prompts=self.args.log_unique_prompts, report_to=self.args.report_to,
                            tensorboard=tensorboard_writer(self.callback_handler.callbacks))
            self._last_samples = None  # shown once: the end-of-training summary log does not repeat it


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


