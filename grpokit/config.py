"""``GRPOConfig``: TRL 1.16's GRPO fields, names and defaults on top of ``transformers.TrainingArguments``, plus
what Unsloth users pass (``max_prompt_length``, ``warmup_ratio``) and grpokit's own additions.

Every wrong value raises one ``ValueError`` at construction naming the field, the value and what is allowed.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from dataclasses import dataclass, field, make_dataclass
from typing import Any

import torch
import transformers

from .algorithms.advantage_estimators import ADVANTAGE_ESTIMATORS
from .algorithms.advantages import MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS
from .algorithms.aggregation import TOKEN_SUMMED
from .algorithms.importance import IMPORTANCE_SAMPLING_LEVELS, SAMPLER_CORRECTION_MODES
from .algorithms.losses import LOSS_TYPES, config_params, loss_spec
from .algorithms.losses._registry import check_bounds, param_type
from .algorithms.settings import LossSettings
from .bounds.user_calls import REWARD_TIMEOUT_ACTIONS
from .rollout.precision import ROLLOUT_PRECISIONS
from .validation import Checker, refusal, short_repr

logger = logging.getLogger("grpokit")

VLLM_MODES = ("colocate", "server")
VLLM_LORA_SYNC_MODES = ("auto", "full", "adapter")
STALENESS_MODES = ("bounded", "exact")
STALL_ACTIONS = ("report", "save_and_exit")
ROUTING_REPLAY_MODES = ("none", "old", "rollout")
CHOICE_FIELDS: dict[str, Any] = {
    "staleness_mode": STALENESS_MODES, "reward_timeout_action": REWARD_TIMEOUT_ACTIONS, "stall_action": STALL_ACTIONS,
    "loss_type": LOSS_TYPES, "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS, "scale_rewards": SCALE_REWARDS,
    "multi_objective_aggregation": MULTI_OBJECTIVE_AGGREGATIONS, "advantage_estimator": ADVANTAGE_ESTIMATORS,
    "vllm_mode": VLLM_MODES, "vllm_importance_sampling_mode": SAMPLER_CORRECTION_MODES,
    "vllm_lora_sync": VLLM_LORA_SYNC_MODES,
    "routing_replay": ROUTING_REPLAY_MODES, "rollout_precision": ROLLOUT_PRECISIONS,
}
"""Fields whose value is one of a few names; validation lists them (``scale_rewards`` also takes True/False;
``loss_type`` reads the loss registry at each check)."""

# TRL fields whose feature grpokit does not implement yet: setting them away from the default is an error
# rather than a silent no-op. (field -> default)
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "log_completions_hub_repo": None,
    "vllm_structured_outputs_regex": None,
}


def _meta(help_text: str) -> dict[str, Any]:
    return {"help": help_text}


def _loss_param_fields() -> type:
    """A dataclass holding one flat field per hyper-parameter of every registered loss (``vespo_k_pos``,
    ``clip_cov_ratio``, ...), with the default and help of the loss's own description: ``GRPOConfig`` inherits
    them, so a new loss brings its fields with it."""
    fields = [(name, param_type(spec, f), field(default=f.default, metadata=_meta(f.metadata["help"])))
              for name, (spec, f) in config_params().items()]
    return make_dataclass("LossParameterFields", fields)


DYNAMIC_SAMPLING_OPTIONS = ("dynamic_sampling_max_rounds", "dynamic_sampling_oversample",
                            "dynamic_sampling_explore_prob", "dynamic_sampling_explore_prob_hard")
"""Fields that shape DAPO's dynamic sampling and do nothing without ``dynamic_sampling``: one set differently from its
default while it is off gets a warning."""


@dataclass
class GRPOConfig(transformers.TrainingArguments, _loss_param_fields()):
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
    router_aux_loss_coef: float | None = field(
        default=None, metadata=_meta("MoE load-balancing loss coefficient (None: the model config's; 0: off).")
    )
    routing_replay: str = field(
        default="none", metadata=_meta("Mixture-of-Experts routing replay: 'none', 'old' (force the experts of the "
                                       "old log-probs' forward, R2) or 'rollout' (those chosen while generating, R3).")
    )
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
            "False: generate on shards in lockstep. See grpokit/forward/sharding.py.")
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
    vllm_lora_sync: str = field(
        default="auto", metadata=_meta("A LoRA policy's weight sync to vLLM's own server (grpokit vllm-serve): "
                                       "'adapter' (the adapter alone, loaded by the server as a runtime adapter), "
                                       "'full' (every weight, the adapter folded in) or 'auto' (the adapter alone "
                                       "where the server has LoRA on, vLLM can run the adapter and the engine is not "
                                       "a CPU's). grpokit's own.")
    )
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata=_meta("GPU memory fraction for vLLM."))
    vllm_max_model_length: int | None = field(default=None, metadata=_meta("vLLM max_model_len."))
    vllm_tensor_parallel_size: int = field(default=1, metadata=_meta("vLLM tensor parallel size."))
    vllm_importance_sampling_correction: bool = field(
        default=True, metadata=_meta("Correct the sampler/trainer mismatch (docs/algorithms.md §5).")
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata=_meta("token_truncate | token_mask | sequence_truncate | sequence_mask | icepop | "
                       "sequence_geometric_mask."),
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
    importance_sampling_level: str = field(
        default="token", metadata=_meta("token (GRPO) | sequence (GSPO) | sequence_token (GSPO-token).")
    )
    reward_weights: list[float] | None = field(default=None, metadata=_meta("One weight per reward function."))
    multi_objective_aggregation: str = field(
        default="sum_then_normalize", metadata=_meta("sum_then_normalize | normalize_then_sum (GDPO).")
    )
    scale_rewards: str = field(default="group", metadata=_meta("group | batch | none (True/False accepted)."))
    loss_type: str = field(
        default="dapo", metadata=_meta(f"{' | '.join(LOSS_TYPES)} (docs/algorithms.md; more with register_loss).")
    )
    loss_params: dict | str | None = field(
        default=None, metadata=_meta("The loss's own hyper-parameters by name (e.g. {\"k_pos\": 1.5} for vespo); the "
                                     "only way to set those of a loss registered at run time.")
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
    use_adaptive_entropy: bool = field(
        default=False, metadata=_meta("Adapt entropy_coef to keep the entropy above entropy_target (Skywork-OR1).")
    )
    entropy_coef_min: float = field(default=0.0, metadata=_meta("Adaptive entropy: minimum coefficient."))
    entropy_coef_max: float = field(default=1.0, metadata=_meta("Adaptive entropy: maximum coefficient."))
    entropy_coef_delta: float = field(default=0.005, metadata=_meta("Adaptive entropy: step."))
    entropy_target: float = field(default=0.2, metadata=_meta("Adaptive entropy: target."))
    max_tool_calling_iterations: int | None = field(
        default=None, metadata=_meta("Tool rounds per rollout at most (None: until a reply calls no tool).")
    )
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
    overwrite_output_dir: bool = field(default=False, metadata=_meta(
        "Let a fresh run replace an earlier run's checkpoints in output_dir (otherwise refused)."))
    log_unique_prompts: bool = field(default=False, metadata=_meta("One row per prompt in that table."))
    log_completions_hub_repo: str | None = field(default=None, metadata=_meta("Not supported yet."))
    use_transformers_continuous_batching: bool = field(
        default=False, metadata=_meta("Generate with transformers' continuous-batching engine (paged attention).")
    )
    transformers_continuous_batching_config: dict | str | None = field(
        default=None, metadata=_meta("Keyword arguments of transformers' ContinuousBatchingConfig "
                                     "(max_memory_percent defaults to 0.5).")
    )
    use_transformers_paged: bool = field(
        default=False, metadata=_meta("Deprecated alias of use_transformers_continuous_batching (as in TRL).")
    )

    # grpokit additions
    advantage_estimator: str = field(default="grpo", metadata=_meta(
        "grpo (group-normalised) | rloo | reinforce_plus_plus (the batch's mean and spread, groups ignored); more "
        "with grpokit.algorithms.register_advantage_estimator."))
    overlong_buffer_length: int | None = field(
        default=None, metadata=_meta("DAPO overlong shaping: penalise completions in the last N tokens.")
    )
    overlong_penalty_factor: float = field(default=1.0, metadata=_meta("DAPO overlong shaping: maximum penalty."))
    max_staleness: int = field(
        default=0, metadata=_meta("Asynchronous rollouts: generate up to this many optimizer steps ahead of the learner "
                                  "with a copy of the weights (0: synchronous). TRL's async name.")
    )
    rollout_precision: str = field(
        default="auto", metadata=_meta(
            "The precision completions are sampled in: 'auto' (the policy's own weights; bf16 copies of a float32 "
            "policy of 64 MB or more on a CPU whose bf16 products are 1.5x float32's or more: AMX, AVX512-BF16), 'float32', "
            "'bf16' or 'int8' "
            "(copies of the linear layers in it, int8 per output channel, made after every optimizer step; the "
            "sampler's log-probs then go to the mismatch correction, vllm_importance_sampling_*). With use_vllm: the "
            "engine's dtype, and 'int8' its 8-bit weights (vLLM's fp8_per_channel). grpokit's own.")
    )
    rollout_workers: int = field(
        default=0, metadata=_meta("Rollout workers: generate and score in this many worker processes of their own, "
                                  "each with a copy of the policy, fed weights through shared memory after every "
                                  "optimizer step (0: in the trainer's process). max_staleness bounds how far ahead "
                                  "they run.")
    )
    partial_rollouts: bool = field(
        default=False, metadata=_meta("Asynchronous rollouts (max_staleness >= 1): completions still running when a "
                                      "batch has enough finished groups stay in flight for a later batch and "
                                      "continue under newer weights; every token records the version that sampled "
                                      "it and its log-prob under that version, and max_staleness bounds each token's "
                                      "age.")
    )
    weight_sync_steps: int = field(
        default=1, metadata=_meta("Asynchronous rollouts: optimizer steps between weight pushes to the producer.")
    )
    staleness_mode: str = field(
        default="bounded", metadata=_meta("Asynchronous rollouts: 'bounded' (a background thread, the newest weights "
                                          "within the bound) or 'exact' (every batch exactly max_staleness steps old; "
                                          "in-line and deterministic, for studies).")
    )
    dynamic_sampling: bool = field(
        default=False, metadata=_meta("DAPO dynamic sampling: replace groups whose rewards are all equal (no gradient) "
                                      "with fresh prompts until the generation batch is full.")
    )
    dynamic_sampling_max_rounds: int = field(
        default=4, metadata=_meta("Dynamic sampling: extra generation rounds at most per generation batch; what is still "
                                  "missing then is filled with groups without reward spread.")
    )
    dynamic_sampling_oversample: float = field(
        default=1.0, metadata=_meta("Dynamic sampling: an extra round draws as many prompts as the missing groups need "
                                    "at the keep rate seen so far, at most this many times the generation batch's "
                                    "prompts; above 1, a batch's first round also adds the prompts the last batch's "
                                    "keep rate says will be needed, up to the same cap (>= 1; larger rounds are "
                                    "fewer and generate faster per completion, and take more memory).")
    )
    dynamic_sampling_explore_prob: float = field(
        default=1.0, metadata=_meta("Dynamic sampling: a prompt whose last z groups all scored alike is generated again "
                                    "with probability p**z and skipped otherwise (GRESO's pre-rollout filter, "
                                    "arXiv 2506.02177); the first group with reward spread resets z. In (0, 1]; 1 "
                                    "generates every prompt.")
    )
    dynamic_sampling_explore_prob_hard: float | None = field(
        default=None, metadata=_meta("Dynamic sampling: the probability p for prompts whose last groups all scored "
                                     "alike below the best reward seen so far (hard: none of their completions "
                                     "solved them; GRESO keeps separate probabilities for easy and hard prompts). "
                                     "None: dynamic_sampling_explore_prob; 1: hard prompts are never skipped.")
    )
    ema_decay: float | None = field(
        default=None, metadata=_meta("Keep an exponential moving average of the trained weights (the adapter's with "
                                     "LoRA) with this decay, in (0, 1), ramped up as min(decay, (1+t)/(10+t)); the "
                                     "model gets the average when training ends. None: off.")
    )
    loraplus_lr_ratio: float | None = field(
        default=None, metadata=_meta("LoRA+ (arXiv 2402.12354): the adapters' B matrices learn this many times faster "
                                     "than their A matrices (the paper suggests ~16, with a learning rate about half "
                                     "of plain LoRA's). None: one learning rate for both.")
    )
    freeze_vision: bool = field(
        default=False, metadata=_meta("A vision-language model trained in full: its vision tower and projector get no "
                                      "gradient (only the language model trains). False: every parameter trains, as in "
                                      "TRL. With a LoRA peft_config its target modules decide (docs/vision.md).")
    )
    skip_nonfinite_steps: bool = field(
        default=False,
        metadata=_meta("Skip (and count) a micro-step whose loss is not finite instead of raising."),
    )
    reward_timeout_s: float | None = field(
        default=300.0, metadata=_meta("Seconds a reward function (a judge, an async one), an environment's reward or "
                                      "rollout_func may take on a batch before it is abandoned and counted "
                                      "(rewards/<name>/timeout_total); None: no bound (docs/reliability.md).")
    )
    reward_timeout_action: str = field(
        default="none", metadata=_meta("A reward function past reward_timeout_s: 'none' (its rows get None from it: "
                                       "not applicable) or 'stop' (the run stops with the cause, on every rank). A "
                                       "rollout_func past it always stops the run.")
    )
    tool_timeout_s: float | None = field(
        default=60.0, metadata=_meta("Seconds a tool call or an environment method (reset, a tool method, "
                                     "get_reward) may take before it is abandoned: the model gets an error message "
                                     "instead (tools/timeout_total); None: no bound.")
    )
    reward_process: bool = field(
        default=False, metadata=_meta("Score the reward functions in a process of their own: memory bounded by "
                                      "worker_memory_mb (one that runs out counts as failed: rewards/<name>/"
                                      "failed_total; the process restarts, the trainer goes on), a call past "
                                      "reward_timeout_s is ended, not abandoned, and reward code no longer shares "
                                      "the trainer's GIL. Functions cross by pickling (docs/reliability.md).")
    )
    worker_memory_mb: int | None = field(
        default=None, metadata=_meta("Memory limit of the reward process (reward_process=True), in MB; None: a "
                                     "quarter of the machine's memory.")
    )
    max_tool_result_chars: int | None = field(
        default=16384, metadata=_meta("Tool results and environment observations longer than this many characters "
                                      "are cut with a marker (tools/truncated_total); None: no bound.")
    )
    stall_timeout_s: float | None = field(
        default=None, metadata=_meta("Watchdog: when training makes no progress (no rollout stage starts or ends, no "
                                     "optimizer step) for this many seconds, say which stage each thread is stuck "
                                     "in, on which rank; None: off.")
    )
    stall_action: str = field(
        default="report", metadata=_meta("Watchdog: 'report' (say it, keep waiting) or 'save_and_exit' (say it, save "
                                         "one consistent checkpoint, exit with status 124).")
    )
    # Compatibility with scripts written for transformers 4 (Unsloth's guides use it)
    warmup_ratio: float | None = field(
        default=None, metadata=_meta("Linear warmup as a fraction of total steps, in [0, 1) (→ warmup_steps).")
    )

    def __post_init__(self) -> None:
        self._parse_json_fields()
        self._validate_own_fields()
        self._map_checkpointing_names()
        if self.warmup_ratio is not None and not self.warmup_steps:
            self.warmup_steps = float(self.warmup_ratio)
        if self.bf16 is None:
            self.bf16 = bool(not self.fp16 and torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        if self.vllm_importance_sampling_cap is not None:
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        if self.use_transformers_paged:
            logger.warning("use_transformers_paged is deprecated (as in TRL): use use_transformers_continuous_batching")
            self.use_transformers_continuous_batching = True
        if self.use_transformers_continuous_batching and self.use_vllm:
            raise ValueError("use_transformers_continuous_batching=True and use_vllm=True are both set; choose one "
                             "generation engine")
        self.pad_to_multiple_of = None  # "auto" (TRL: 128 on AWS Neuron, else None), "none", "null": checked above
        super().__post_init__()
        self._derive_batches()
        self._check_launch()
        self._warn_combinations()

    def _check_launch(self) -> None:
        """A launcher that started several processes (torchrun, accelerate: ``WORLD_SIZE``) must get a run of that
        many. On a machine without an accelerator transformers sets up a single-process run unless ``use_cpu=True``
        (TRL's config does the same), and each process would then train alone, meeting the others only at the run's
        directory."""
        launched = os.environ.get("WORLD_SIZE", "")
        if launched.isdigit() and int(launched) > 1 and self.world_size == 1:
            raise refusal("use_cpu", self.use_cpu, f"True on a machine without an accelerator (--use_cpu on the "
                          f"command line): transformers set up a single-process run here, so each of the {launched} "
                          "processes would train alone", when=f"under a launcher of {launched} processes (WORLD_SIZE)")

    def _map_checkpointing_names(self) -> None:
        """TRL users write gradient_checkpointing; newer transformers (5.25) calls it activation_checkpointing, older
        ones (5.19 and before) know only gradient_checkpointing. Map it here so neither a deprecation warning nor
        TRL's default (True) hides the user's choice."""
        if not hasattr(self, "activation_checkpointing"):  # an older transformers: its one name is the one to set
            if self.gradient_checkpointing is None:
                self.gradient_checkpointing = True
            return
        if self.activation_checkpointing is None:
            self.activation_checkpointing = True if self.gradient_checkpointing is None else bool(self.gradient_checkpointing)
        if self.activation_checkpointing_kwargs is None and self.gradient_checkpointing_kwargs is not None:
            self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs
        self.gradient_checkpointing = self.activation_checkpointing
        self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs

    def _parse_json_fields(self) -> None:
        """Mapping fields may be given as JSON text (the command line's only way)."""
        for name in ("generation_kwargs", "chat_template_kwargs", "model_init_kwargs", "loss_params",
                     "transformers_continuous_batching_config"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    setattr(self, name, json.loads(value))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{name}={short_repr(value)} is not valid JSON: {e}") from None
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise refusal(name, value, "expected a mapping of keyword: value (or its JSON text)")

    # -- validation -------------------------------------------------------------------------------------------
    def _validate_own_fields(self) -> None:
        check = Checker(self)
        for name, default in UNSUPPORTED_FIELDS.items():
            if getattr(self, name) != default:
                raise ValueError(
                    f"{name}={short_repr(getattr(self, name))} is not supported by grpokit yet; leave it at {default!r}"
                )
        if self.scale_rewards is True:
            self.scale_rewards = "group"
        elif self.scale_rewards is False:
            self.scale_rewards = "none"
        for name, options in CHOICE_FIELDS.items():
            check.choice(name, options)
        self._validate_generation(check)
        self._validate_loss(check)
        self._validate_training_arguments(check)
        self._validate_vllm(check)
        check.boolean("freeze_vision")
        if self.reward_weights is not None:
            if not isinstance(self.reward_weights, (list, tuple)) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in self.reward_weights
            ):
                raise check.bad("reward_weights", "expected a list of finite numbers, one per reward function")
            self.reward_weights = [float(w) for w in self.reward_weights]

    def _validate_generation(self, check: Checker) -> None:
        check.number("num_generations", 2, integer=True)
        check.number("num_generations_eval", 1, integer=True, optional=True)
        check.number("max_completion_length", 1, integer=True)
        check.number("max_prompt_length", 1, integer=True, optional=True)
        check.number("temperature", 0, lo_open=True)
        check.number("top_p", 0, 1, lo_open=True)
        check.number("top_k", 0, integer=True)
        check.number("min_p", 0, 1, optional=True)
        check.number("repetition_penalty", 0, lo_open=True)
        check.number("generation_batch_size", 1, integer=True, optional=True)
        check.number("steps_per_generation", 1, integer=True, optional=True)
        check.number("overlong_penalty_factor", 0)
        check.number("dynamic_sampling_max_rounds", 1, integer=True)
        check.number("dynamic_sampling_oversample", 1)
        check.number("dynamic_sampling_explore_prob", 0, 1, lo_open=True)
        check.number("dynamic_sampling_explore_prob_hard", 0, 1, lo_open=True, optional=True)
        check.number("ema_decay", 0, 1, lo_open=True, hi_open=True, optional=True)
        check.number("loraplus_lr_ratio", 0, lo_open=True, optional=True)
        check.number("max_staleness", 0, integer=True)
        check.number("max_tool_calling_iterations", 0, integer=True, optional=True)
        check.number("weight_sync_steps", 1, integer=True)
        check.number("rollout_workers", 0, integer=True)
        for name in ("reward_timeout_s", "tool_timeout_s", "stall_timeout_s"):
            check.number(name, 0, lo_open=True, optional=True)
        check.number("max_tool_result_chars", 1, integer=True, optional=True)
        check.boolean("reward_process")
        check.number("worker_memory_mb", 64, integer=True, optional=True)
        if self.max_staleness > 0 and self.staleness_mode == "exact" and self.weight_sync_steps != 1:
            raise check.bad("weight_sync_steps", "every version's weights must be published; use 1",
                            when="with staleness_mode='exact'")
        if self.max_staleness > 0 and self.use_vllm and self.staleness_mode == "exact":
            raise check.bad("staleness_mode", "the engine holds only its latest weights; use 'bounded'",
                            when="with use_vllm=True")
        if self.overlong_buffer_length is not None:
            check.number("overlong_buffer_length", 1, self.max_completion_length, integer=True)
        if self.rollout_precision != "auto" and (self.use_transformers_continuous_batching
                                                 or self.use_transformers_paged):
            raise check.bad("rollout_precision", "transformers' continuous batching samples with the policy's own "
                            "weights; use 'auto', or grpokit's own rollouts (use_transformers_continuous_batching=False)",
                            when="with use_transformers_continuous_batching=True")
        check.boolean("partial_rollouts")
        if self.rollout_workers:
            self._validate_workers()
        if self.partial_rollouts:
            self._validate_partial()

    def _validate_workers(self) -> None:
        """What rollout workers do not do yet, refused in one line each."""
        refused = [("staleness_mode", self.staleness_mode != "bounded", "'bounded' (workers run ahead of the learner; "
                    "'exact' generates in the learner's thread)"),
                   ("use_vllm", self.use_vllm, "False (a vLLM client in the workers is not built yet)"),
                   ("routing_replay", self.routing_replay != "none", "'none' (routing replay is not carried through "
                    "workers yet)")]
        for name, bad, allowed in refused:
            if bad:
                raise refusal(name, getattr(self, name), f"use {allowed}, or rollout_workers=0",
                              when=f"with rollout_workers={self.rollout_workers}")

    def _validate_partial(self) -> None:
        """What partial rollouts need, refused in one line each: continuing a completion under new weights is
        grpokit's own decode loop (the transformers backend), on plain single-turn completions."""
        extra = set(self.generation_kwargs or {})
        refused = [("max_staleness", self.max_staleness < 1, "1 or more (a completion continues under weights "
                    "published while it runs; at 0 none are)"),
                   ("staleness_mode", self.staleness_mode != "bounded", "'bounded'"),
                   ("use_vllm", self.use_vllm, "False (vLLM's engine does not continue a request under new weights "
                    "here yet)"),
                   ("use_transformers_continuous_batching", self.use_transformers_continuous_batching
                    or self.use_transformers_paged, "False (grpokit's decode loop continues completions)"),
                   ("dynamic_sampling", self.dynamic_sampling, "False (not combined with partial rollouts yet)"),
                   ("routing_replay", self.routing_replay != "none", "'none'"),
                   ("rollout_precision", self.rollout_precision != "auto", "'auto' (a continued completion's "
                    "log-probs are the policy's own)"),
                   ("generation_kwargs", bool(extra), "none (the decode loop continues a completion with the run's "
                    "sampling settings only)")]
        for name, bad, allowed in refused:
            if bad:
                raise refusal(name, getattr(self, name), f"use {allowed}, or partial_rollouts=False",
                              when="with partial_rollouts=True")

    def _validate_loss(self, check: Checker) -> None:
        """The objective's fields, read through the loss's description (what epsilon means for it, its own
        hyper-parameters and their ranges)."""
        spec = loss_spec(self.loss_type)
        check.number("num_iterations", 1, integer=True)
        check.number("epsilon", 0, lo_open=True)
        check.number("epsilon_high", 0, lo_open=True, optional=True)
        if self.epsilon_high is not None and spec.epsilon in ("ratio", "log_ratio") and self.epsilon_high < self.epsilon:
            raise ValueError(
                f"epsilon_high={self.epsilon_high!r} is smaller than epsilon={self.epsilon!r}: the clip range is "
                "inverted; use epsilon_high >= epsilon (DAPO's clip-higher) or leave it None"
            )
        if spec.epsilon == "ratio" and self.epsilon >= 1:
            raise check.bad("epsilon", "the lower clip 1-epsilon must stay positive; use a value in (0, 1)")
        if self.delta is not None:
            check.number("delta", 1 + (self.epsilon_high if self.epsilon_high is not None else self.epsilon),
                         lo_open=True)
        check.number("beta", 0)
        check.number("top_entropy_quantile", 0, 1, lo_open=True)
        check.number("off_policy_mask_threshold", 0, optional=True)
        check.number("entropy_coef", 0)
        check.number("entropy_coef_delta", 0)
        check.number("entropy_target", 0)
        check.number("entropy_coef_min", 0)
        check.number("entropy_coef_max", self.entropy_coef_min)
        check.number("router_aux_loss_coef", 0, optional=True)
        check.number("ref_model_mixup_alpha", 0, 1)
        check.number("ref_model_sync_steps", 1, integer=True)
        for name, (_, f) in config_params().items():
            if hasattr(self, name) and (why := check_bounds(name, getattr(self, name), f)):
                raise check.bad(name, why)
        try:  # the loss's own parameters, as the trainer will build them (loss_params overrides included)
            LossSettings.from_config(self)
        except (TypeError, ValueError) as e:
            raise ValueError(str(e)) from None

    def _validate_training_arguments(self, check: Checker) -> None:
        """TrainingArguments fields that transformers accepts as they are but that fail only once the model is
        loaded (the optimizer, the seed) or silently do nothing (a save or log interval of 0)."""
        check.number("warmup_ratio", 0, 1, hi_open=True, optional=True)
        check.number("per_device_train_batch_size", 1, integer=True)
        check.number("gradient_accumulation_steps", 1, integer=True)
        check.number("learning_rate", 0)
        check.number("weight_decay", 0)
        check.number("adam_beta1", 0, 1, hi_open=True)
        check.number("adam_beta2", 0, 1, hi_open=True)
        check.number("adam_epsilon", 0)
        check.number("max_grad_norm", 0)
        check.number("num_train_epochs", 0)
        check.number("seed", 0, 2**32 - 1, integer=True)
        steps = self.max_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or (steps < 1 and steps != -1):
            raise check.bad("max_steps", "expected a positive number of steps, or -1 (train for num_train_epochs)")
        if str(getattr(self.save_strategy, "value", self.save_strategy)) == "steps":
            check.number("save_steps", 0, lo_open=True)
        if str(getattr(self.logging_strategy, "value", self.logging_strategy)) == "steps":
            check.number("logging_steps", 0, lo_open=True)
        self._validate_report_to()
        if self.use_liger_kernel and importlib.util.find_spec("liger_kernel") is None:
            raise check.bad("use_liger_kernel", "liger-kernel is not installed (pip install liger-kernel, CUDA only); "
                            "grpokit does not need it to save memory: its log-prob head never builds the (B, T, V) "
                            "logits", when="here")
        if not (self.pad_to_multiple_of is None or str(self.pad_to_multiple_of).lower() in ("auto", "none", "null")):
            raise check.bad("pad_to_multiple_of", "grpokit never pads a batch to a multiple of a length (TRL does so only "
                                                  "on AWS Neuron, which compiles once per shape); use 'auto' or None")
        self._validate_parallelism()
        if getattr(self, "auto_find_batch_size", False):
            raise refusal("auto_find_batch_size", True, "shrinking the batch breaks the groups of num_generations "
                          "completions; lower per_device_train_batch_size instead")

    def _validate_parallelism(self) -> None:
        """TRL 1.16's refusal: context and sequence parallelism shard the model's inputs, which GRPO builds after
        generation, inside the trainer (accelerate would otherwise take them and the run would ignore them)."""
        pc = self.parallelism_config
        if pc is not None and (getattr(pc, "cp_enabled", False) or getattr(pc, "sp_enabled", False)):
            name = "cp_size" if getattr(pc, "cp_enabled", False) else "sp_size"
            raise refusal(f"parallelism_config.{name}", getattr(pc, name, None),
                          "GRPO builds the model's inputs after generation, so context or sequence parallelism "
                          "cannot shard them (as in TRL 1.16); use cp_size=1 and sp_size=1")

    def _validate_vllm(self, check: Checker) -> None:
        check.number("vllm_importance_sampling_clip_max", 0, lo_open=True, optional=True)
        check.number("vllm_importance_sampling_clip_min", 0, optional=True)
        check.number("vllm_gpu_memory_utilization", 0, 1, lo_open=True)
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
        if self.vllm_importance_sampling_mode == "icepop" and (lo is None or hi is None):
            raise ValueError(
                f"vllm_importance_sampling_mode='icepop' needs both bounds (clip_min={lo!r}, clip_max={hi!r}): set "
                "vllm_importance_sampling_clip_min and vllm_importance_sampling_clip_max (IcePop's band: 0.5 and 5.0)"
            )
        if (loss_spec(self.loss_type).sampler_ratio == "fold" and (self.use_vllm or self.rollout_precision != "auto")
                and self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode.startswith("sequence")):
            raise check.bad("vllm_importance_sampling_mode", "a sequence-level ratio would be raised to the power of "
                            "the length inside its sequence weight; use 'token_truncate' or 'token_mask'",
                            when=f"with loss_type={self.loss_type!r}")
        if self.use_vllm and self.vllm_mode == "colocate" and self.vllm_tensor_parallel_size != 1:
            raise ValueError(
                f"vllm_tensor_parallel_size={self.vllm_tensor_parallel_size!r} with vllm_mode='colocate' is not "
                "supported by grpokit yet: use 1 (every training process runs its own engine) or vllm_mode='server' "
                "(trl vllm-serve --tensor-parallel-size N)"
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
            raise refusal("report_to", value, f"use one of {', '.join(map(repr, allowed))} (or a list of them)")

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
        if not self.dynamic_sampling:
            for name in DYNAMIC_SAMPLING_OPTIONS:
                value, default = getattr(self, name), self.__dataclass_fields__[name].default
                if value != default:
                    logger.warning(f"{name}={value!r} has no effect without dynamic_sampling=True (it shapes DAPO's "
                                   "dynamic sampling, which is off)")
        if self.worker_memory_mb is not None and not self.reward_process:
            logger.warning(f"worker_memory_mb={self.worker_memory_mb!r} has no effect without reward_process=True (the "
                           "reward functions run in the trainer's process and share its memory)")
        spec = loss_spec(self.loss_type)
        level = self.importance_sampling_level
        if level == "sequence" and spec.aggregation in TOKEN_SUMMED and "sequence" in spec.levels:
            logger.warning(
                f"importance_sampling_level='sequence' with loss_type={self.loss_type!r} sums per-token terms, which "
                "weights each sequence by its completion length; GSPO's own aggregation is loss_type='grpo'."
            )
        if level not in spec.levels:
            logger.warning(
                f"loss_type={self.loss_type!r} builds its weights from token ratios itself; "
                f"importance_sampling_level={level!r} has no effect."
            )
        elif spec.preferred_level is not None and level != spec.preferred_level:
            logger.warning(f"loss_type={self.loss_type!r} is meant for importance_sampling_level="
                           f"{spec.preferred_level!r} (the paper's setup).")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon
