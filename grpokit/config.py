"""``GRPOConfig``: TRL 1.16's GRPO fields, names and defaults on top of ``transformers.TrainingArguments``, plus
what Unsloth users pass (``max_prompt_length``, ``warmup_ratio``) and grpokit's own additions.

Every wrong value raises one ``ValueError`` at construction naming the field, the value and what is allowed.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

from .algorithms.advantages import ADVANTAGE_ESTIMATORS, MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS
from .algorithms.importance import IMPORTANCE_SAMPLING_LEVELS, SAMPLER_CORRECTION_MODES
from .algorithms.losses import LOSS_TYPES

logger = logging.getLogger("grpokit")

TOKEN_SUMMED_LOSSES = ("bnpo", "dr_grpo", "dapo", "cispo")
CLIP_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
VLLM_MODES = ("colocate", "server")
CHOICE_FIELDS: dict[str, tuple[str, ...]] = {
    "loss_type": LOSS_TYPES, "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS, "scale_rewards": SCALE_REWARDS,
    "multi_objective_aggregation": MULTI_OBJECTIVE_AGGREGATIONS, "advantage_estimator": ADVANTAGE_ESTIMATORS,
    "vllm_mode": VLLM_MODES, "vllm_importance_sampling_mode": SAMPLER_CORRECTION_MODES,
}
"""Fields whose value is one of a few names; validation lists them (``scale_rewards`` also takes True/False)."""

# TRL fields whose feature grpokit does not implement yet: setting them away from the default is an error
# rather than a silent no-op. (field -> default)
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "use_adaptive_entropy": False,
    "max_tool_calling_iterations": None,
    "use_transformers_continuous_batching": False,
    "use_transformers_paged": False,
    "log_completions_hub_repo": None,
    "vllm_structured_outputs_regex": None,
    "router_aux_loss_coef": None,
    "sync_ref_model": False,
    "cast_lm_head_to_fp32": False,
    "log_unique_prompts": False,
}


def _meta(help_text: str) -> dict[str, Any]:
    return {"help": help_text}


@dataclass
class GRPOConfig(transformers.TrainingArguments):
    r"""Configuration of :class:`grpokit.GRPOTrainer`; a drop-in for ``trl.GRPOConfig`` (TRL 1.16).

    Batch arithmetic (as TRL): ``per_device_train_batch_size`` counts *completions*; one generation batch holds
    ``generation_batch_size = per_device_train_batch_size × processes × steps_per_generation`` completions,
    i.e. ``generation_batch_size / num_generations`` prompts; it is generated once and consumed over
    ``steps_per_generation`` micro-steps, ``num_iterations`` times.
    """

    # Changed TrainingArguments defaults (as TRL)
    learning_rate: float = field(default=1e-6, metadata=_meta("AdamW initial learning rate."))
    logging_steps: float = field(default=10, metadata=_meta("Log every X optimizer steps."))
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata=_meta("Recompute activations in backward to save memory (TRL's name of activation_checkpointing; "
                       "default True as in TRL)."),
    )
    bf16: bool | None = field(
        default=None,
        metadata=_meta("bf16 mixed precision. None: on when a CUDA device supports bf16 and fp16 is off, else off."),
    )
    remove_unused_columns: bool | None = field(
        default=False, metadata=_meta("Kept False: dataset columns are passed to the reward functions.")
    )

    # Model
    model_init_kwargs: dict | str | None = field(
        default=None, metadata=_meta("Keyword arguments for from_pretrained when `model` is a string.")
    )
    trust_remote_code: bool = field(default=False, metadata=_meta("Allow custom model code from the hub."))
    router_aux_loss_coef: float | None = field(default=None, metadata=_meta("MoE router loss (not supported yet)."))
    disable_dropout: bool = field(default=False, metadata=_meta("Set every dropout probability to 0."))
    cast_lm_head_to_fp32: bool = field(default=False, metadata=_meta("Compute the LM head in float32."))

    # Data and generation
    num_generations: int | None = field(default=8, metadata=_meta("Completions sampled per prompt (G)."))
    num_generations_eval: int | None = field(default=None, metadata=_meta("G for evaluation (default: G)."))
    max_prompt_length: int | None = field(
        default=None,
        metadata=_meta("Left-truncate prompts to this many tokens (Unsloth/older TRL field). None: no truncation."),
    )
    max_completion_length: int | None = field(default=512, metadata=_meta("Maximum new tokens per completion."))
    ds3_gather_for_generation: bool = field(
        default=True, metadata=_meta(
            "Gather sharded weights once per rollout for generation (faster, one full copy per rank); FSDP2 here. "
            "False: generate on shards in lockstep. See grpokit/sharding.py.")
    )
    shuffle_dataset: bool | None = field(default=True, metadata=_meta("Shuffle the training prompts."))
    pad_to_multiple_of: int | str | None = field(default="auto", metadata=_meta("Pad sequences to a multiple."))
    generation_batch_size: int | None = field(
        default=None, metadata=_meta("Completions per generation batch (exclusive with steps_per_generation).")
    )
    steps_per_generation: int | None = field(
        default=None, metadata=_meta("Micro-steps per generation batch (default: gradient_accumulation_steps).")
    )
    temperature: float = field(default=1.0, metadata=_meta("Sampling temperature (> 0)."))
    top_p: float = field(default=1.0, metadata=_meta("Nucleus sampling mass in (0, 1]."))
    top_k: int = field(default=0, metadata=_meta("Top-k sampling; 0 disables."))
    min_p: float | None = field(default=None, metadata=_meta("Min-p sampling in [0, 1]."))
    generation_kwargs: dict | str | None = field(
        default=None, metadata=_meta("Extra keyword arguments for generation (override the above).")
    )
    chat_template_kwargs: dict | str | None = field(
        default=None, metadata=_meta("Extra keyword arguments for apply_chat_template.")
    )
    repetition_penalty: float = field(default=1.0, metadata=_meta("Repetition penalty (> 0; 1 = none)."))
    cache_implementation: str | None = field(default=None, metadata=_meta("KV cache implementation for generate."))

    # vLLM
    use_vllm: bool = field(default=False, metadata=_meta("Generate with vLLM (GPU)."))
    vllm_mode: str = field(default="colocate", metadata=_meta("'colocate' or 'server'."))
    vllm_model_impl: str = field(default="vllm", metadata=_meta("vLLM model implementation."))
    vllm_enable_sleep_mode: bool = field(default=False, metadata=_meta("Offload vLLM weights between steps."))
    vllm_structured_outputs_regex: str | None = field(default=None, metadata=_meta("Not supported yet."))
    vllm_server_base_url: str | None = field(default=None, metadata=_meta("vLLM server URL (server mode)."))
    vllm_server_host: str = field(default="0.0.0.0", metadata=_meta("vLLM server host (server mode)."))
    vllm_server_port: int = field(default=8000, metadata=_meta("vLLM server port (server mode)."))
    vllm_server_timeout: float = field(default=240.0, metadata=_meta("Seconds to wait for the vLLM server."))
    vllm_group_port: int = field(default=51216, metadata=_meta("Port of the weight-sync process group."))
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata=_meta("GPU memory fraction for vLLM."))
    vllm_max_model_length: int | None = field(default=None, metadata=_meta("vLLM max_model_len."))
    vllm_tensor_parallel_size: int = field(default=1, metadata=_meta("vLLM tensor parallel size."))
    vllm_importance_sampling_correction: bool = field(
        default=True, metadata=_meta("Correct the sampler/trainer mismatch (ALGORITHMS.md §5).")
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata=_meta("token_truncate | token_mask | sequence_truncate | sequence_mask."),
    )
    vllm_importance_sampling_clip_max: float | None = field(default=3.0, metadata=_meta("Upper bound on ρ."))
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata=_meta("Lower bound on ρ."))
    vllm_importance_sampling_cap: float | None = field(
        default=None, metadata=_meta("Deprecated alias of vllm_importance_sampling_clip_max.")
    )

    # Algorithm
    beta: float = field(default=0.0, metadata=_meta("KL coefficient; 0 loads no reference model."))
    num_iterations: int = field(default=1, metadata=_meta("Optimisation passes over each generation batch (μ)."))
    epsilon: float = field(default=0.2, metadata=_meta("Lower clip ε (and upper when epsilon_high is None)."))
    delta: float | None = field(default=None, metadata=_meta("Two-sided clipping bound (> 1 + epsilon_high)."))
    epsilon_high: float | None = field(
        default=None,
        metadata=_meta("Upper clip ε (DAPO clip-higher); for cispo the absolute weight cap (default 5.0)."),
    )
    sapo_temperature_neg: float = field(default=1.05, metadata=_meta("SAPO gate temperature for A ≤ 0."))
    sapo_temperature_pos: float = field(default=1.0, metadata=_meta("SAPO gate temperature for A > 0."))
    vespo_k_pos: float = field(default=2.0, metadata=_meta("VESPO shape k for A ≥ 0."))
    vespo_lambda_pos: float = field(default=3.0, metadata=_meta("VESPO rate λ for A ≥ 0."))
    vespo_k_neg: float = field(default=3.0, metadata=_meta("VESPO shape k for A < 0."))
    vespo_lambda_neg: float = field(default=2.0, metadata=_meta("VESPO rate λ for A < 0."))
    importance_sampling_level: str = field(
        default="token", metadata=_meta("token (GRPO) | sequence (GSPO) | sequence_token (GSPO-token).")
    )
    reward_weights: list[float] | None = field(default=None, metadata=_meta("One weight per reward function."))
    multi_objective_aggregation: str = field(
        default="sum_then_normalize", metadata=_meta("sum_then_normalize | normalize_then_sum (GDPO).")
    )
    scale_rewards: str = field(default="group", metadata=_meta("group | batch | none (True/False accepted)."))
    loss_type: str = field(
        default="dapo", metadata=_meta("grpo | bnpo | dr_grpo | dapo | luspo | cispo | sapo | vespo | gmpo.")
    )
    mask_truncated_completions: bool = field(
        default=False, metadata=_meta("Exclude completions cut at max_completion_length from the loss.")
    )
    sync_ref_model: bool = field(default=False, metadata=_meta("Mix the policy into the reference (TR-DPO)."))
    ref_model_mixup_alpha: float = field(default=0.6, metadata=_meta("α of the reference sync."))
    ref_model_sync_steps: int = field(default=512, metadata=_meta("Steps between reference syncs."))
    top_entropy_quantile: float = field(
        default=1.0, metadata=_meta("Train only on the top-ρ fraction of tokens by entropy, in (0, 1].")
    )
    entropy_coef: float = field(default=0.0, metadata=_meta("Entropy bonus coefficient (loss -= coef·H)."))
    use_adaptive_entropy: bool = field(default=False, metadata=_meta("Not supported yet."))
    entropy_coef_min: float = field(default=0.0, metadata=_meta("Adaptive entropy: minimum coefficient."))
    entropy_coef_max: float = field(default=1.0, metadata=_meta("Adaptive entropy: maximum coefficient."))
    entropy_coef_delta: float = field(default=0.005, metadata=_meta("Adaptive entropy: step."))
    entropy_target: float = field(default=0.2, metadata=_meta("Adaptive entropy: target."))
    max_tool_calling_iterations: int | None = field(default=None, metadata=_meta("Not supported yet."))
    off_policy_mask_threshold: float | None = field(
        default=None, metadata=_meta("DeepSeek-V3.2 off-policy sequence mask threshold δ (≥ 0).")
    )
    use_bias_correction_kl: bool = field(
        default=True, metadata=_meta("Importance-weight the KL term by the token ratio (DeepSeek-V3.2).")
    )

    # Logging
    log_completions: bool = field(default=False, metadata=_meta("Print a table of sample completions."))
    log_multimodal: bool = field(default=True, metadata=_meta("Log images of multimodal prompts."))
    num_completions_to_print: int | None = field(default=None, metadata=_meta("Rows of that table."))
    log_unique_prompts: bool = field(default=False, metadata=_meta("One row per prompt in that table."))
    log_completions_hub_repo: str | None = field(default=None, metadata=_meta("Not supported yet."))
    use_transformers_continuous_batching: bool = field(default=False, metadata=_meta("Not supported yet."))
    transformers_continuous_batching_config: dict | str | None = field(default=None, metadata=_meta("Unused."))
    use_transformers_paged: bool = field(default=False, metadata=_meta("Not supported yet."))

    # grpokit additions
    advantage_estimator: str = field(default="grpo", metadata=_meta("grpo (group-normalised) | rloo."))
    overlong_buffer_length: int | None = field(
        default=None, metadata=_meta("DAPO overlong shaping: penalise completions in the last N tokens.")
    )
    overlong_penalty_factor: float = field(default=1.0, metadata=_meta("DAPO overlong shaping: maximum penalty."))
    skip_nonfinite_steps: bool = field(
        default=False,
        metadata=_meta("Skip (and count) a micro-step whose loss is not finite instead of raising."),
    )
    # Compatibility with scripts written for transformers 4 (Unsloth's guides use it)
    warmup_ratio: float | None = field(
        default=None, metadata=_meta("Linear warmup as a fraction of total steps, in [0, 1) (→ warmup_steps).")
    )

    def __post_init__(self) -> None:
        self._validate_own_fields()
        # TRL users write gradient_checkpointing; transformers 5 calls it activation_checkpointing. Map it here so
        # neither a deprecation warning nor TRL's default (True) hides the user's choice.
        if self.activation_checkpointing is None:
            self.activation_checkpointing = True if self.gradient_checkpointing is None else bool(self.gradient_checkpointing)
        if self.activation_checkpointing_kwargs is None and self.gradient_checkpointing_kwargs is not None:
            self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs
        self.gradient_checkpointing = self.activation_checkpointing
        self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs
        if self.warmup_ratio is not None and not self.warmup_steps:
            self.warmup_steps = float(self.warmup_ratio)
        if self.bf16 is None:
            self.bf16 = bool(not self.fp16 and torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        if self.vllm_importance_sampling_cap is not None:
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        for name in ("generation_kwargs", "chat_template_kwargs", "model_init_kwargs"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    setattr(self, name, json.loads(value))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{name}={value!r} is not valid JSON: {e}") from None
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name}={value!r} is not allowed: expected a mapping of keyword: value (or its "
                                 "JSON text)")
        if isinstance(self.pad_to_multiple_of, str):
            v = self.pad_to_multiple_of.lower()
            self.pad_to_multiple_of = None if v in ("auto", "none", "null") else int(v)
        super().__post_init__()
        self._derive_batches()
        self._warn_combinations()

    # -- validation -------------------------------------------------------------------------------------------
    def _validate_own_fields(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r} is not allowed: {allowed}")

        def choice(name: str, options: tuple[str, ...]) -> None:
            if getattr(self, name) not in options:
                raise bad(name, "use one of " + ", ".join(repr(o) for o in options))

        def number(name: str, lo: float | None = None, hi: float | None = None, *, lo_open=False, hi_open=False,
                   optional=False, integer=False) -> None:
            v = getattr(self, name)
            if v is None and optional:
                return
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()):
                raise bad(name, f"expected {'an integer' if integer else 'a number'}"
                                + (" or None" if optional else ""))
            if isinstance(v, float) and not math.isfinite(v):
                raise bad(name, "expected a finite number")
            lo_ok = lo is None or (v > lo if lo_open else v >= lo)
            hi_ok = hi is None or (v < hi if hi_open else v <= hi)
            if not (lo_ok and hi_ok):
                lb = "" if lo is None else ("(" if lo_open else "[") + f"{lo}"
                ub = "" if hi is None else f"{hi}" + (")" if hi_open else "]")
                rng = f"{lb or '(-inf'}, {ub or 'inf)'}"
                raise bad(name, f"must be in {rng}")

        for name, default in UNSUPPORTED_FIELDS.items():
            if getattr(self, name) != default:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not supported by grpokit yet; leave it at {default!r}"
                )
        choice("loss_type", LOSS_TYPES)
        choice("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS)
        if self.scale_rewards is True:
            self.scale_rewards = "group"
        elif self.scale_rewards is False:
            self.scale_rewards = "none"
        choice("scale_rewards", SCALE_REWARDS)
        choice("multi_objective_aggregation", MULTI_OBJECTIVE_AGGREGATIONS)
        choice("advantage_estimator", ADVANTAGE_ESTIMATORS)
        choice("vllm_mode", VLLM_MODES)
        choice("vllm_importance_sampling_mode", SAMPLER_CORRECTION_MODES)
        number("num_generations", 2, integer=True)
        if self.num_generations_eval is not None:
            number("num_generations_eval", 1, integer=True)
        number("max_completion_length", 1, integer=True)
        number("max_prompt_length", 1, integer=True, optional=True)
        number("num_iterations", 1, integer=True)
        number("epsilon", 0, lo_open=True)
        number("epsilon_high", 0, lo_open=True, optional=True)
        if self.epsilon_high is not None and self.loss_type in CLIP_LOSSES + ("gmpo",) and self.epsilon_high < self.epsilon:
            raise ValueError(
                f"epsilon_high={self.epsilon_high!r} is smaller than epsilon={self.epsilon!r}: the clip range is "
                "inverted; use epsilon_high >= epsilon (DAPO's clip-higher) or leave it None"
            )
        if self.loss_type in CLIP_LOSSES and self.epsilon >= 1:
            raise ValueError(f"epsilon={self.epsilon!r} is not allowed: the lower clip 1-epsilon must stay positive; "
                             "use a value in (0, 1)")
        if self.delta is not None:
            eps_hi = self.epsilon_high if self.epsilon_high is not None else self.epsilon
            number("delta", 1 + eps_hi, lo_open=True)
        number("beta", 0)
        number("temperature", 0, lo_open=True)
        number("top_p", 0, 1, lo_open=True)
        number("top_k", 0, integer=True)
        number("min_p", 0, 1, optional=True)
        number("repetition_penalty", 0, lo_open=True)
        number("top_entropy_quantile", 0, 1, lo_open=True)
        number("off_policy_mask_threshold", 0, optional=True)
        number("sapo_temperature_pos", 0, lo_open=True)
        number("sapo_temperature_neg", 0, lo_open=True)
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            number(name, 0)
        number("entropy_coef", 0)
        number("ref_model_mixup_alpha", 0, 1)
        number("ref_model_sync_steps", 1, integer=True)
        number("vllm_importance_sampling_clip_max", 0, lo_open=True, optional=True)
        number("vllm_importance_sampling_clip_min", 0, optional=True)
        number("vllm_gpu_memory_utilization", 0, 1, lo_open=True)
        number("overlong_penalty_factor", 0)
        number("warmup_ratio", 0, 1, hi_open=True, optional=True)
        if self.overlong_buffer_length is not None:
            number("overlong_buffer_length", 1, self.max_completion_length, integer=True)
        number("generation_batch_size", 1, integer=True, optional=True)
        number("steps_per_generation", 1, integer=True, optional=True)
        # TrainingArguments fields that transformers accepts as they are but that fail only once the model is
        # loaded (the optimizer, the seed) or silently do nothing (a save or log interval of 0)
        number("per_device_train_batch_size", 1, integer=True)
        number("gradient_accumulation_steps", 1, integer=True)
        number("learning_rate", 0)
        number("weight_decay", 0)
        number("adam_beta1", 0, 1, hi_open=True)
        number("adam_beta2", 0, 1, hi_open=True)
        number("adam_epsilon", 0)
        number("max_grad_norm", 0)
        number("num_train_epochs", 0)
        number("seed", 0, 2**32 - 1, integer=True)
        if str(getattr(self.save_strategy, "value", self.save_strategy)) == "steps":
            number("save_steps", 0, lo_open=True)
        if str(getattr(self.logging_strategy, "value", self.logging_strategy)) == "steps":
            number("logging_steps", 0, lo_open=True)
        self._validate_report_to()
        if self.reward_weights is not None:
            if not isinstance(self.reward_weights, (list, tuple)) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in self.reward_weights
            ):
                raise bad("reward_weights", "expected a list of finite numbers, one per reward function")
            self.reward_weights = [float(w) for w in self.reward_weights]
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(
                f"vllm_importance_sampling_clip_min={lo!r} must be smaller than vllm_importance_sampling_clip_max={hi!r}"
            )
        if self.vllm_importance_sampling_mode.endswith("truncate") and lo is None and hi is None:
            raise ValueError(
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} needs a bound: set "
                "vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max"
            )
        if (self.loss_type == "vespo" and self.use_vllm and self.vllm_importance_sampling_correction
                and self.vllm_importance_sampling_mode.startswith("sequence")):
            raise ValueError(
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} is not allowed with "
                "loss_type='vespo': a sequence-level ratio would be raised to the power of the length inside VESPO's "
                "weight; use 'token_truncate' or 'token_mask'"
            )
        if self.use_vllm and self.vllm_mode == "colocate" and self.vllm_tensor_parallel_size != 1:
            raise ValueError(
                f"vllm_tensor_parallel_size={self.vllm_tensor_parallel_size!r} with vllm_mode='colocate' is not "
                "supported by grpokit yet: use 1 (every training process runs its own engine) or vllm_mode='server' "
                "(trl vllm-serve --tensor-parallel-size N)"
            )
        if getattr(self, "auto_find_batch_size", False):
            raise ValueError(
                "auto_find_batch_size=True is not allowed: shrinking the batch breaks the groups of num_generations "
                "completions; lower per_device_train_batch_size instead"
            )

    def _validate_report_to(self) -> None:
        value = self.report_to
        names = [value] if isinstance(value, str) else value
        if names is None:
            return
        try:
            from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
        except ImportError:
            return
        allowed = ("all", "none", *INTEGRATION_TO_CALLBACK)
        if not isinstance(names, (list, tuple)) or any(not isinstance(n, str) or n not in allowed for n in names):
            raise ValueError(f"report_to={value!r} is not allowed: use one of {', '.join(map(repr, allowed))} "
                             "(or a list of them)")

    def _derive_batches(self) -> None:
        procs = self.world_size
        per_step = self.per_device_train_batch_size * procs
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError(
                f"generation_batch_size={self.generation_batch_size} and steps_per_generation="
                f"{self.steps_per_generation} are both set; set only one (the other is derived)"
            )
        if self.generation_batch_size is None and self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        if self.steps_per_generation is not None:
            self.generation_batch_size = per_step * self.steps_per_generation
        else:
            if self.generation_batch_size % per_step:
                raise ValueError(
                    f"generation_batch_size {self.generation_batch_size} is not a multiple of the global batch "
                    f"{per_step} (per_device_train_batch_size {self.per_device_train_batch_size} × "
                    f"{procs} processes)"
                )
            self.steps_per_generation = self.generation_batch_size // per_step
        if self.generation_batch_size % self.num_generations:
            raise ValueError(
                f"generation_batch_size {self.generation_batch_size} is not a multiple of num_generations "
                f"{self.num_generations} (generation_batch_size = per_device_train_batch_size "
                f"{self.per_device_train_batch_size} × {procs} processes × steps_per_generation "
                f"{self.steps_per_generation}); every prompt's group must be complete"
            )

    def _warn_combinations(self) -> None:
        if self.importance_sampling_level == "sequence" and self.loss_type in TOKEN_SUMMED_LOSSES:
            logger.warning(
                f"importance_sampling_level='sequence' with loss_type={self.loss_type!r} sums per-token terms, so "
                "each sequence is weighted by its length; GSPO's own aggregation is loss_type='grpo'."
            )
        if self.loss_type in ("vespo", "gmpo") and self.importance_sampling_level != "token":
            logger.warning(
                f"loss_type={self.loss_type!r} builds its sequence weight from token ratios itself; "
                f"importance_sampling_level={self.importance_sampling_level!r} has no effect."
            )
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            logger.warning("loss_type='luspo' is meant for importance_sampling_level='sequence' (the paper's setup).")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon
