"""GRPOConfig: TRL parity, the Unsloth GSPO config verbatim, and one clear error per wrong value."""

import dataclasses
import importlib.util
import warnings

import pytest

from grpokit.config import UNSUPPORTED_FIELDS, GRPOConfig

UNSLOTH_GSPO = dict(
    importance_sampling_level="sequence", loss_type="dr_grpo", epsilon=3e-4, epsilon_high=4e-4, optim="adamw_8bit",
    max_prompt_length=1024, per_device_train_batch_size=8, gradient_accumulation_steps=4, learning_rate=5e-6,
    adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.1, warmup_ratio=0.1, lr_scheduler_type="cosine",
    num_generations=8, max_completion_length=1024, log_completions=False, max_grad_norm=0.1, temperature=0.9,
    num_train_epochs=2, report_to="none",
)


def cfg(tmp_path, **kw):
    return GRPOConfig(output_dir=str(tmp_path), **kw)


def test_unsloth_gspo_config_verbatim(tmp_path):
    c = cfg(tmp_path, **UNSLOTH_GSPO)
    assert c.importance_sampling_level == "sequence" and c.loss_type == "dr_grpo"
    assert (c.epsilon, c.epsilon_high) == (3e-4, 4e-4)
    assert c.max_prompt_length == 1024
    assert c.warmup_steps == 0.1  # warmup_ratio (removed from transformers 5) becomes a fractional warmup
    assert c.generation_batch_size == 32 and c.steps_per_generation == 4
    assert "adamw_8bit" in str(c.optim).lower() or c.optim.value == "adamw_8bit"


def test_every_trl_field_is_accepted_with_trl_default(tmp_path):
    trl = pytest.importorskip("trl")
    ours = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    theirs = [f for f in dataclasses.fields(trl.GRPOConfig)]
    missing = [f.name for f in theirs if f.name not in ours]
    assert missing == []
    skip = {"gradient_checkpointing", "bf16", "remove_unused_columns", "pad_to_multiple_of", "include_for_metrics"}
    for f in theirs:
        if f.name in skip or f.default is dataclasses.MISSING:
            continue
        assert ours[f.name].default == f.default, f.name
    c = cfg(tmp_path)
    assert c.gradient_checkpointing is True and c.loss_type == "dapo" and c.beta == 0.0 and c.learning_rate == 1e-6
    assert c.use_bias_correction_kl is True and c.scale_rewards == "group" and c.num_generations == 8


def test_gradient_checkpointing_choice_is_kept_without_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert cfg(tmp_path, gradient_checkpointing=False).gradient_checkpointing is False
        assert cfg(tmp_path).gradient_checkpointing is True


@pytest.mark.parametrize("value,expected", [(True, "group"), (False, "none"), ("batch", "batch")])
def test_scale_rewards_booleans(tmp_path, value, expected):
    assert cfg(tmp_path, scale_rewards=value).scale_rewards == expected


BAD = [
    (dict(loss_type="ppo"), "loss_type='ppo'", "'dapo'"),
    (dict(importance_sampling_level="seq"), "importance_sampling_level='seq'", "'sequence_token'"),
    (dict(epsilon=-0.1), "epsilon=-0.1", "(0, inf)"),
    (dict(epsilon=0.3, epsilon_high=0.2), "epsilon_high=0.2", "inverted"),
    (dict(epsilon_high=0.0), "epsilon_high=0.0", "(0, inf)"),
    (dict(num_generations=1), "num_generations=1", "[2, inf)"),
    (dict(num_generations=3), "num_generations 3", "not a multiple"),
    (dict(generation_batch_size=12), "generation_batch_size 12", "not a multiple of the global batch 8"),
    (dict(generation_batch_size=16, steps_per_generation=2), "generation_batch_size=16", "set only one"),
    (dict(top_entropy_quantile=0.0), "top_entropy_quantile=0.0", "(0, 1]"),
    (dict(top_entropy_quantile=1.5), "top_entropy_quantile=1.5", "(0, 1]"),
    (dict(temperature=0.0), "temperature=0.0", "(0, inf)"),
    (dict(top_p=1.2), "top_p=1.2", "(0, 1]"),
    (dict(beta=-1.0), "beta=-1.0", "[0, inf)"),
    (dict(delta=1.1), "delta=1.1", "(1.2, inf)"),
    (dict(scale_rewards="std"), "scale_rewards='std'", "'group'"),
    (dict(multi_objective_aggregation="mean"), "multi_objective_aggregation='mean'", "'normalize_then_sum'"),
    (dict(advantage_estimator="ppo"), "advantage_estimator='ppo'", "'rloo'"),
    (dict(vllm_mode="remote"), "vllm_mode='remote'", "'server'"),
    (dict(vllm_importance_sampling_mode="tok"), "vllm_importance_sampling_mode='tok'", "'token_mask'"),
    (dict(loss_type="vespo", use_vllm=True), "vllm_importance_sampling_mode='sequence_mask'", "'token_mask'"),
    (dict(vllm_importance_sampling_clip_min=3.0), "vllm_importance_sampling_clip_min=3.0", "smaller"),
    (dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None),
     "vllm_importance_sampling_mode='token_truncate'", "needs a bound"),
    (dict(max_completion_length=0), "max_completion_length=0", "[1, inf)"),
    (dict(max_prompt_length=0), "max_prompt_length=0", "[1, inf)"),
    (dict(num_iterations=0), "num_iterations=0", "[1, inf)"),
    (dict(reward_weights=["a"]), "reward_weights=['a']", "list of finite numbers"),
    (dict(off_policy_mask_threshold=-1.0), "off_policy_mask_threshold=-1.0", "[0, inf)"),
    (dict(warmup_ratio=1.5), "warmup_ratio=1.5", "[0, 1)"),
    (dict(overlong_buffer_length=600), "overlong_buffer_length=600", "[1, 512]"),
    (dict(log_completions_hub_repo="me/completions"), "log_completions_hub_repo='me/completions'", "not supported"),
    (dict(entropy_coef_min=0.5, entropy_coef_max=0.2), "entropy_coef_max=0.2", "[0.5, inf)"),
    (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef=-1.0", "[0, inf)"),
    (dict(top_k=-1), "top_k=-1", "[0, inf)"),
    (dict(epsilon=1.5), "epsilon=1.5", "(0, 1)"),
    (dict(generation_kwargs="{bad json"), "generation_kwargs=", "not valid JSON"),
    (dict(pad_to_multiple_of=64), "pad_to_multiple_of=64", "use 'auto' or None"),
    (dict(reward_process="yes"), "reward_process='yes'", "expected true or false"),
    (dict(reward_process=True, worker_memory_mb=10), "worker_memory_mb=10", "[64, inf)"),
    (dict(pad_to_multiple_of="128"), "pad_to_multiple_of='128'", "use 'auto' or None"),
]


@pytest.mark.parametrize("kwargs,names,allowed", BAD, ids=[str(b[0]) for b in BAD])
def test_wrong_values_raise_one_clear_error(tmp_path, kwargs, names, allowed):
    with pytest.raises(ValueError) as e:
        cfg(tmp_path, **kwargs)
    assert names in str(e.value) and allowed in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel is installed")
def test_liger_kernel_without_the_package_is_one_clear_error(tmp_path):
    # TRL fails at construction too; transformers alone would fail only once training starts
    with pytest.raises(ValueError, match=r"use_liger_kernel=True is not allowed here: liger-kernel is not installed"):
        cfg(tmp_path, use_liger_kernel=True)


@pytest.mark.parametrize("sizes", [dict(cp_size=2), dict(sp_size=2)])
def test_context_or_sequence_parallelism_is_refused_as_trl_refuses_it(tmp_path, sizes):
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ValueError) as e:
        cfg(tmp_path, parallelism_config=ParallelismConfig(**sizes))
    name = next(iter(sizes))
    assert str(e.value).startswith(f"parallelism_config.{name}=2 is not allowed")
    assert "use cp_size=1 and sp_size=1" in str(e.value)
    assert "\n" not in str(e.value)
    cfg(tmp_path, parallelism_config=ParallelismConfig(cp_size=1, sp_size=1))  # nothing sharded: accepted


@pytest.mark.parametrize("value", ["auto", None, "none", "null"])
def test_pad_to_multiple_of_that_pads_nothing_is_accepted(tmp_path, value):
    assert cfg(tmp_path, pad_to_multiple_of=value).pad_to_multiple_of is None


def test_unsupported_fields_listed_are_real_trl_fields():
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert set(UNSUPPORTED_FIELDS) <= names


@pytest.mark.parametrize("name,value", [("dynamic_sampling_explore_prob", 0.5), ("dynamic_sampling_explore_prob_hard", 1.0),
                                        ("dynamic_sampling_oversample", 4.0), ("dynamic_sampling_max_rounds", 2)])
def test_a_dynamic_sampling_option_without_dynamic_sampling_is_named_in_a_warning(tmp_path, caplog, name, value):
    """These options shape DAPO's dynamic sampling only; set while it is off, one warning names the field and value.
    With dynamic sampling on, or left at their defaults, nothing is said."""
    import logging

    with caplog.at_level(logging.WARNING, logger="grpokit"):
        cfg(tmp_path, **{name: value})
    said = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert said == [f"{name}={value!r} has no effect without dynamic_sampling=True (it shapes DAPO's dynamic sampling, "
                    "which is off)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        cfg(tmp_path, dynamic_sampling=True, **{name: value})
        cfg(tmp_path)
    assert not [r for r in caplog.records if "dynamic_sampling" in r.getMessage()]


def test_worker_memory_mb_without_a_reward_process_is_named_in_a_warning(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="grpokit"):
        cfg(tmp_path, worker_memory_mb=2048)
    assert "worker_memory_mb=2048 has no effect without reward_process=True" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpokit"):
        cfg(tmp_path, worker_memory_mb=2048, reward_process=True)
    assert "worker_memory_mb" not in caplog.text

