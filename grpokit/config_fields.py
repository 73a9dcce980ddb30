"""Every ``GRPOConfig`` field name, written out so that a job spec's keys are checked without importing
transformers (which takes seconds). ``tests/test_config_fields.py`` fails when this list and ``GRPOConfig``
disagree; regenerate it with ``python -m grpokit.config_fields``. Under another transformers version
:func:`grpokit.job_spec.config_field_names` reads ``GRPOConfig`` itself.

The fields of each loss's own hyper-parameters (``vespo_k_pos``, ``clip_cov_ratio``, ...) are not written here:
:func:`loss_param_fields` reads them from the loss modules' source (``param(..., config="name")``), so a new loss
stays one module of :mod:`grpokit.algorithms.losses` with nothing to regenerate."""

import ast
from pathlib import Path

LOSSES_DIR = Path(__file__).resolve().parent / "algorithms" / "losses"


def loss_param_fields() -> frozenset[str]:
    """The flat config names of every built-in loss's hyper-parameters, read from the source without importing it
    (torch would take a second)."""
    names = set()
    for path in sorted(LOSSES_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "param":
                names.update(k.value.value for k in node.keywords
                             if k.arg == "config" and isinstance(k.value, ast.Constant))
    return frozenset(names)


TRANSFORMERS_VERSION = "5.24.0"

FIELDS = frozenset({
    "accelerator_config",
    "activation_checkpointing",
    "activation_checkpointing_kwargs",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "advantage_estimator",
    "auto_find_batch_size",
    "average_tokens_across_devices",
    "batch_eval_metrics",
    "beta",
    "bf16",
    "bf16_full_eval",
    "cache_implementation",
    "cast_lm_head_to_fp32",
    "chat_template_kwargs",
    "data_seed",
    "dataloader_drop_last",
    "dataloader_in_order",
    "dataloader_multiprocessing_context",
    "dataloader_num_workers",
    "dataloader_persistent_workers",
    "dataloader_pin_memory",
    "dataloader_prefetch_factor",
    "ddp_backend",
    "ddp_broadcast_buffers",
    "ddp_bucket_cap_mb",
    "ddp_find_unused_parameters",
    "ddp_static_graph",
    "ddp_timeout",
    "debug",
    "deepspeed",
    "delta",
    "disable_dropout",
    "disable_tqdm",
    "do_eval",
    "do_predict",
    "do_train",
    "ds3_gather_for_generation",
    "dynamic_sampling",
    "dynamic_sampling_explore_prob",
    "dynamic_sampling_max_rounds",
    "dynamic_sampling_oversample",
    "ema_decay",
    "enable_jit_checkpoint",
    "entropy_coef",
    "entropy_coef_delta",
    "entropy_coef_max",
    "entropy_coef_min",
    "entropy_target",
    "epsilon",
    "epsilon_high",
    "eval_accumulation_steps",
    "eval_delay",
    "eval_do_concat_batches",
    "eval_on_start",
    "eval_steps",
    "eval_strategy",
    "eval_use_gather_object",
    "fp16",
    "fp16_full_eval",
    "fsdp",
    "fsdp_config",
    "full_determinism",
    "generation_batch_size",
    "generation_kwargs",
    "gradient_accumulation_steps",
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
    "greater_is_better",
    "hub_always_push",
    "hub_model_id",
    "hub_private_repo",
    "hub_revision",
    "hub_strategy",
    "hub_token",
    "ignore_data_skip",
    "importance_sampling_level",
    "include_for_metrics",
    "include_num_input_tokens_seen",
    "label_names",
    "label_smoothing_factor",
    "learning_rate",
    "length_column_name",
    "liger_kernel_config",
    "load_best_model_at_end",
    "local_rank",
    "log_completions",
    "log_completions_hub_repo",
    "log_level",
    "log_level_replica",
    "log_multimodal",
    "log_on_each_node",
    "log_unique_prompts",
    "logging_first_step",
    "logging_nan_inf_filter",
    "logging_steps",
    "logging_strategy",
    "loraplus_lr_ratio",
    "loss_params",
    "loss_type",
    "lr_scheduler_kwargs",
    "lr_scheduler_type",
    "mask_truncated_completions",
    "max_completion_length",
    "max_grad_norm",
    "max_prompt_length",
    "max_staleness",
    "max_steps",
    "max_tool_calling_iterations",
    "max_tool_result_chars",
    "metric_for_best_model",
    "min_p",
    "model_init_kwargs",
    "multi_objective_aggregation",
    "neftune_noise_alpha",
    "num_completions_to_print",
    "num_generations",
    "num_generations_eval",
    "num_iterations",
    "num_train_epochs",
    "off_policy_mask_threshold",
    "optim",
    "optim_args",
    "optim_target_modules",
    "output_dir",
    "overlong_buffer_length",
    "overlong_penalty_factor",
    "overwrite_output_dir",
    "pad_to_multiple_of",
    "parallelism_config",
    "per_device_eval_batch_size",
    "per_device_train_batch_size",
    "prediction_loss_only",
    "project",
    "push_to_hub",
    "ref_model_mixup_alpha",
    "ref_model_sync_steps",
    "remove_unused_columns",
    "repetition_penalty",
    "report_to",
    "restore_callback_states_from_checkpoint",
    "resume_from_checkpoint",
    "reward_timeout_action",
    "reward_timeout_s",
    "reward_weights",
    "router_aux_loss_coef",
    "run_name",
    "save_on_each_node",
    "save_only_model",
    "save_steps",
    "save_strategy",
    "save_total_limit",
    "scale_rewards",
    "seed",
    "shuffle_dataset",
    "skip_memory_metrics",
    "skip_nonfinite_steps",
    "staleness_mode",
    "stall_action",
    "stall_timeout_s",
    "steps_per_generation",
    "sync_ref_model",
    "temperature",
    "tf32",
    "tool_timeout_s",
    "top_entropy_quantile",
    "top_k",
    "top_p",
    "torch_compile",
    "torch_compile_backend",
    "torch_compile_mode",
    "torch_empty_cache_steps",
    "trackio_bucket_id",
    "trackio_space_id",
    "trackio_static_space_id",
    "train_sampling_strategy",
    "transformers_continuous_batching_config",
    "trust_remote_code",
    "use_adaptive_entropy",
    "use_bias_correction_kl",
    "use_cache",
    "use_cpu",
    "use_liger_kernel",
    "use_transformers_continuous_batching",
    "use_transformers_paged",
    "use_vllm",
    "vllm_enable_sleep_mode",
    "vllm_gpu_memory_utilization",
    "vllm_group_port",
    "vllm_importance_sampling_cap",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_max_model_length",
    "vllm_mode",
    "vllm_model_impl",
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_server_timeout",
    "vllm_structured_outputs_regex",
    "vllm_tensor_parallel_size",
    "warmup_ratio",
    "warmup_steps",
    "weight_decay",
    "weight_sync_steps",
})


def _source() -> str:
    """This module's text for the installed transformers and ``GRPOConfig``."""
    import dataclasses

    import transformers

    from .config import GRPOConfig

    of_losses = loss_param_fields()
    names = sorted(f.name for f in dataclasses.fields(GRPOConfig) if f.init and f.name not in of_losses)
    here = Path(__file__).read_text()
    head, tail = here.split("TRANSFORMERS_VERSION = ", 1)[0], here.split("\n})\n", 1)[1]
    body = "".join(f'    "{n}",\n' for n in names)
    return f'{head}TRANSFORMERS_VERSION = "{transformers.__version__}"\n\nFIELDS = frozenset({{\n{body}}})\n{tail}'


if __name__ == "__main__":
    from .files import atomic_write_text

    atomic_write_text(Path(__file__), _source())
    print(f"wrote {len(FIELDS)} -> {Path(__file__)}")
