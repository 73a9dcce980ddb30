"""Wrong configurations through the job path (``grpokit.run.job.prepare``) and the command line (``grpokit train``).

Every case must raise one error before any model is loaded, naming the field, the value and what is allowed; the
CLI prints it on one line, without a traceback, and exits 2."""

from __future__ import annotations

import json

import pytest
import yaml
from reliability_helpers import LoadGuard

from grpokit.cli import main
from grpokit.run.job import JobError, prepare

BASE = {
    "model": "never-loaded-model", "task": "arithmetic", "per_device_train_batch_size": 4, "num_generations": 4,
    "max_completion_length": 8, "max_steps": 2, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
    "gradient_checkpointing": False, "use_cpu": True, "eval": {"n": 4, "max_new_tokens": 8},
}
DROP = object()  # remove the key from the base spec

# (id, overrides, snippets the one-line message must contain: the field, the value, what is allowed)
BAD: list[tuple[str, dict, tuple[str, ...]]] = [
    # the algorithm
    ("loss_type", {"loss_type": "ppo"}, ("loss_type='ppo'", "use one of", "'dapo'")),
    ("loss_type_int", {"loss_type": 5}, ("loss_type=5", "'grpo'")),
    ("level", {"importance_sampling_level": "seq"}, ("importance_sampling_level='seq'", "'sequence_token'")),
    ("epsilon_negative", {"epsilon": -0.1}, ("epsilon=-0.1", "(0, inf)")),
    ("epsilon_zero", {"epsilon": 0}, ("epsilon=0", "(0, inf)")),
    ("epsilon_inverted", {"loss_type": "grpo", "epsilon": 0.3, "epsilon_high": 0.2},
     ("epsilon_high=0.2", "epsilon=0.3", "inverted", "epsilon_high >= epsilon")),
    ("epsilon_high_negative", {"epsilon_high": -0.5}, ("epsilon_high=-0.5", "(0, inf)")),
    ("epsilon_ge_1_clip", {"loss_type": "grpo", "epsilon": 1.5}, ("epsilon=1.5", "(0, 1)")),
    ("num_generations_1", {"num_generations": 1}, ("num_generations=1", "[2, inf)")),
    ("num_generations_0", {"num_generations": 0}, ("num_generations=0", "[2, inf)")),
    ("num_generations_float", {"num_generations": 2.5}, ("num_generations=2.5", "integer")),
    ("num_generations_list", {"num_generations": [4]}, ("num_generations=[4]", "integer")),
    ("groups_do_not_divide", {"num_generations": 3}, ("num_generations 3", "generation_batch_size 4", "not a multiple")),
    ("generation_batch_not_multiple", {"generation_batch_size": 6},
     ("generation_batch_size 6", "not a multiple of the global batch 4")),
    ("generation_batch_and_steps", {"generation_batch_size": 8, "steps_per_generation": 2},
     ("generation_batch_size=8", "steps_per_generation=2", "set only one")),
    ("steps_per_generation_0", {"steps_per_generation": 0}, ("steps_per_generation=0", "[1, inf)")),
    ("per_device_batch_0", {"per_device_train_batch_size": 0}, ("per_device_train_batch_size=0", "[1, inf)")),
    ("grad_accum_0", {"gradient_accumulation_steps": 0}, ("gradient_accumulation_steps=0", "[1, inf)")),
    ("vespo_sequence_sampler_mode", {"loss_type": "vespo", "use_vllm": True,
                                     "vllm_importance_sampling_mode": "sequence_truncate"},
     ("vllm_importance_sampling_mode='sequence_truncate'", "vespo", "'token_truncate'")),
    ("entropy_quantile_0", {"top_entropy_quantile": 0}, ("top_entropy_quantile=0", "(0, 1]")),
    ("entropy_quantile_above_1", {"top_entropy_quantile": 1.5}, ("top_entropy_quantile=1.5", "(0, 1]")),
    ("entropy_quantile_negative", {"top_entropy_quantile": -0.2}, ("top_entropy_quantile=-0.2", "(0, 1]")),
    ("temperature_0", {"temperature": 0}, ("temperature=0", "(0, inf)")),
    ("temperature_text", {"temperature": "hot"}, ("temperature='hot'", "expected float")),
    ("top_p", {"top_p": 1.2}, ("top_p=1.2", "(0, 1]")),
    ("top_k", {"top_k": -1}, ("top_k=-1", "[0, inf)")),
    ("min_p", {"min_p": 2}, ("min_p=2", "[0, 1]")),
    ("beta", {"beta": -0.1}, ("beta=-0.1", "[0, inf)")),
    ("delta", {"delta": 1.1}, ("delta=1.1", "(1.2, inf)")),
    ("scale_rewards", {"scale_rewards": "std"}, ("scale_rewards='std'", "'group'")),
    ("advantage_estimator", {"advantage_estimator": "ppo"}, ("advantage_estimator='ppo'", "'rloo'")),
    ("aggregation", {"multi_objective_aggregation": "mean"}, ("multi_objective_aggregation='mean'",
                                                               "'normalize_then_sum'")),
    ("max_completion_length_0", {"max_completion_length": 0}, ("max_completion_length=0", "[1, inf)")),
    ("max_prompt_length_negative", {"max_prompt_length": -3}, ("max_prompt_length=-3", "[1, inf)")),
    ("num_iterations_0", {"num_iterations": 0}, ("num_iterations=0", "[1, inf)")),
    ("reward_weights_text", {"reward_weights": ["a"]}, ("reward_weights=['a']", "list of finite numbers")),
    ("reward_weights_count", {"reward_weights": [1, 2, 3]},
     ("reward_weights=[1.0, 2.0, 3.0]", "3 weights for 2 reward functions", "one per function")),
    ("off_policy_threshold", {"off_policy_mask_threshold": -1}, ("off_policy_mask_threshold=-1", "[0, inf)")),
    ("overlong_buffer", {"overlong_buffer_length": 600}, ("overlong_buffer_length=600", "[1, 8]")),
    ("unsupported_field", {"log_completions_hub_repo": "me/c"}, ("log_completions_hub_repo='me/c'", "not supported",
                                                                  "leave it at None")),
    ("sampler_clip_inverted", {"vllm_importance_sampling_clip_min": 5.0},
     ("vllm_importance_sampling_clip_min=5.0", "vllm_importance_sampling_clip_max=3.0", "smaller")),
    ("generation_kwargs_type", {"generation_kwargs": 5}, ("generation_kwargs=5", "expected a mapping")),
    ("generation_kwargs_json", {"generation_kwargs": "{bad json"}, ("generation_kwargs='{bad json'", "not valid JSON")),
    ("warmup_ratio", {"warmup_ratio": 1.5}, ("warmup_ratio=1.5", "[0, 1)")),
    # optimisation and bookkeeping (TrainingArguments fields that would fail only after the model is loaded)
    ("learning_rate_negative", {"learning_rate": -0.001}, ("learning_rate=-0.001", "[0, inf)")),
    ("learning_rate_text", {"learning_rate": "fast"}, ("learning_rate='fast'", "expected float")),
    ("adam_beta1", {"adam_beta1": 1.5}, ("adam_beta1=1.5", "[0, 1)")),
    ("max_grad_norm", {"max_grad_norm": -1.0}, ("max_grad_norm=-1.0", "[0, inf)")),
    ("weight_decay", {"weight_decay": -0.1}, ("weight_decay=-0.1", "[0, inf)")),
    ("seed_negative", {"seed": -1}, ("seed=-1", "[0, 4294967295]")),
    ("seed_float", {"seed": 1.5}, ("seed=1.5", "expected an integer")),
    ("max_steps_text", {"max_steps": "ten"}, ("max_steps='ten'", "expected int")),
    ("save_strategy", {"save_strategy": "sometimes"}, ("save_strategy='sometimes'", "'steps'", "'epoch'")),
    ("save_steps_0", {"save_strategy": "steps", "save_steps": 0}, ("save_steps=0", "(0, inf)")),
    ("logging_steps_0", {"logging_steps": 0}, ("logging_steps=0", "(0, inf)")),
    ("lr_scheduler", {"lr_scheduler_type": "fancy"}, ("lr_scheduler_type='fancy'", "'cosine'")),
    ("optim", {"optim": "sgdd"}, ("optim='sgdd'", "'adamw_torch'")),
    ("report_to", {"report_to": "wandb_x"}, ("report_to='wandb_x'", "'none'")),
    ("gradient_checkpointing_text", {"gradient_checkpointing": "yes"},
     ("gradient_checkpointing='yes'", "expected true or false")),
    ("run_name_int", {"run_name": 5}, ("run_name=5", "expected a string")),
    ("output_dir_list", {"output_dir": [1]}, ("output_dir=[1]", "expected a string")),
    ("eval_strategy", {"eval_strategy": "steps"}, ("eval_strategy='steps'", "use 'no'")),
    # the bounds on user code (docs/reliability.md)
    ("reward_timeout_zero", {"reward_timeout_s": 0}, ("reward_timeout_s=0", "(0, inf)")),
    ("reward_timeout_text", {"reward_timeout_s": "soon"}, ("reward_timeout_s='soon'", "expected float")),
    ("reward_timeout_action", {"reward_timeout_action": "skip"}, ("reward_timeout_action='skip'", "'none', 'stop'")),
    ("tool_timeout_negative", {"tool_timeout_s": -1}, ("tool_timeout_s=-1", "(0, inf)")),
    ("tool_result_chars_zero", {"max_tool_result_chars": 0}, ("max_tool_result_chars=0", "[1, inf)")),
    ("stall_timeout_inf", {"stall_timeout_s": float("inf")}, ("stall_timeout_s=inf", "finite")),
    ("stall_action", {"stall_action": "exit"}, ("stall_action='exit'", "'report', 'save_and_exit'")),
    # job keys
    ("unknown_key_typo", {"loss_typ": "dapo"}, ("unknown config key 'loss_typ'", "did you mean loss_type")),
    ("unknown_key", {"frobnicate": 1}, ("unknown config key 'frobnicate'", "GRPOConfig fields")),
    ("no_model", {"model": DROP}, ("no 'model'", "smollm2-135m-instruct")),
    ("model_int", {"model": 5}, ("model=5", "as a string")),
    ("task_and_dataset", {"dataset": "{tmp}/good.jsonl"}, ("exactly one of 'task'", "'dataset'")),
    ("neither_task_nor_dataset", {"task": DROP}, ("exactly one of 'task'", "'dataset'")),
    ("unknown_task", {"task": "nonexistent_task"}, ("Unknown task 'nonexistent_task'", "Built-in tasks", "arithmetic")),
    ("task_int", {"task": 5}, ("task=5", "as a string")),
    ("dataset_missing", {"task": DROP, "dataset": "{tmp}/missing.jsonl"}, ("missing.jsonl", "not found")),
    ("dataset_no_prompt", {"task": DROP, "dataset": "{tmp}/no_prompt.jsonl"},
     ("no_prompt.jsonl", "no prompt column 'prompt'", "'question'", "prompt_column=")),
    ("dataset_empty_file", {"task": DROP, "dataset": "{tmp}/empty.jsonl"}, ("empty.jsonl", "the file is empty")),
    ("dataset_header_only", {"task": DROP, "dataset": "{tmp}/header.csv"}, ("header.csv", "could not be read as csv",
                                                                             "no data")),
    ("dataset_wrong_suffix", {"task": DROP, "dataset": "{tmp}/data.txt"}, ("data.txt", "unsupported file type",
                                                                            ".jsonl")),
    ("dataset_empty_prompt", {"task": DROP, "dataset": "{tmp}/blank_prompt.jsonl"},
     ("blank_prompt.jsonl", "row 1", "empty 'prompt'")),
    ("reward_unknown", {"reward_funcs": ["no_such_reward"]},
     ("Unknown reward function 'no_such_reward'", "Built-ins", "correctness")),
    ("reward_bad_module", {"reward_funcs": "nomod:fn"}, ("'nomod:fn'", "cannot import module 'nomod'")),
    ("reward_not_callable", {"reward_funcs": "math:pi"}, ("'math:pi'", "not a function")),
    ("reward_type", {"reward_funcs": 5}, ("reward_funcs=5", "module:function")),
    ("task_args_unknown", {"task_args": {"bogus": 1}}, ("arithmetic", "unexpected keyword argument 'bogus'")),
    ("task_args_type", {"task_args": 5}, ("task_args=5", "expected a mapping")),
    ("task_args_n_eval", {"task_args": {"n_eval": -1}}, ("n_eval", "-1", "non-negative integer")),
    ("eval_unknown", {"eval": {"m": 3}}, ("unknown eval key(s) ['m']", "allowed")),
    ("eval_n_text", {"eval": {"n": "many"}}, ("eval.n='many'", "positive integer")),
    ("eval_before_text", {"eval": {"before": "yes"}}, ("eval.before='yes'", "true or false")),
    ("eval_type", {"eval": 5}, ("eval=5", "expected a mapping")),
    ("lora_type", {"lora": 16}, ("lora=16", "expected a mapping")),
    ("lora_unknown", {"lora": {"rank": 4}}, ("unknown lora key(s) ['rank']", "'r'")),
    ("lora_r", {"lora": {"r": 0}}, ("lora.r=0", "positive integer")),
    ("lora_dropout", {"lora": {"dropout": 1.5}}, ("lora.dropout=1.5", "[0, 1)")),
    ("time_budget_negative", {"time_budget_s": -5}, ("time_budget_s=-5", "positive number")),
    ("time_budget_text", {"time_budget_s": "soon"}, ("time_budget_s='soon'", "positive number")),
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(40)]
    (d / "good.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "no_prompt.jsonl").write_text("".join(json.dumps({"question": r["prompt"], "answer": r["answer"]}) + "\n"
                                               for r in rows))
    (d / "empty.jsonl").write_text("")
    (d / "header.csv").write_text("prompt,answer\n")
    (d / "data.txt").write_text("What is 1 + 1?\n")
    (d / "blank_prompt.jsonl").write_text(json.dumps({"prompt": "ok?", "answer": "1"}) + "\n"
                                          + json.dumps({"prompt": "  ", "answer": "2"}) + "\n")
    return d


def build_spec(overrides: dict, data_dir, out) -> dict:
    spec = dict(BASE, output_dir=str(out))
    for key, value in overrides.items():
        if value is DROP:
            spec.pop(key, None)
        else:
            spec[key] = value.replace("{tmp}", str(data_dir)) if isinstance(value, str) else value
    return spec


def check_message(message: str, snippets: tuple[str, ...]) -> None:
    missing = [s for s in snippets if s not in message]
    assert not missing, f"{missing} not in: {message[:1500]}"  # a hostile input can be megabytes long


def test_the_table_is_big_enough():
    assert len(BAD) >= 40
    assert len({case_id for case_id, _, _ in BAD}) == len(BAD)


@pytest.mark.parametrize("case_id,overrides,snippets", BAD, ids=[b[0] for b in BAD])
def test_prepare_rejects_before_loading(monkeypatch, tmp_path, data_dir, case_id, overrides, snippets):
    guard = LoadGuard(monkeypatch)
    with pytest.raises(JobError) as e:
        prepare(build_spec(overrides, data_dir, tmp_path / "out"))
    check_message(str(e.value), snippets)
    assert guard.calls == []


@pytest.mark.parametrize("case_id,overrides,snippets", BAD, ids=[b[0] for b in BAD])
def test_cli_prints_one_line_and_exits_2(monkeypatch, tmp_path, data_dir, capsys, case_id, overrides, snippets):
    guard = LoadGuard(monkeypatch)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(build_spec(overrides, data_dir, tmp_path / "out")))
    assert main(["train", str(cfg)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("grpokit: error:") and len(err.splitlines()) == 1, err
    assert "Traceback" not in err + captured.out
    check_message(err, snippets)
    assert guard.calls == []
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# Wrong files and command lines (the YAML layer itself)
FILE_CASES = [
    ("missing_file", None, [], ("does not exist",)),
    ("invalid_yaml", "model: [unclosed\n", [], ("not valid YAML",)),
    ("top_level_list", "- a\n- b\n", [], ("must hold a mapping", "list")),
    ("empty_file", "", [], ("is empty",)),
    ("duplicate_key", "model: x\ntask: arithmetic\nloss_type: grpo\nloss_type: dapo\n", [],
     ("duplicate key 'loss_type'", "line 4")),
    ("python_tag", "model: !!python/object/apply:os.system ['touch {tmp}/PWNED']\ntask: arithmetic\n", [],
     ("not valid YAML", "python/object/apply:os.system")),
    ("set_without_equals", "model: x\ntask: arithmetic\n", ["--set", "loss_type"], ("--set 'loss_type' is not key=value",)),
    ("set_bad_value", "model: x\ntask: arithmetic\n", ["--set", "beta=-1"], ("beta=-1", "[0, inf)")),
    ("resume_missing", "model: x\ntask: arithmetic\noutput_dir: {tmp}/o\n", ["--resume", "{tmp}/nowhere"],
     ("nowhere", "does not exist")),
]


@pytest.mark.parametrize("case_id,text,extra,snippets", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_bad_files_and_flags(monkeypatch, tmp_path, capsys, case_id, text, extra, snippets):
    guard = LoadGuard(monkeypatch)
    cfg = tmp_path / "c.yaml"
    if text is not None:
        cfg.write_text(text.replace("{tmp}", str(tmp_path)))
    argv = ["train", str(cfg), *[a.replace("{tmp}", str(tmp_path)) for a in extra]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpokit: error:") and len(err.splitlines()) == 1 and "Traceback" not in err, err
    check_message(err, snippets)
    assert guard.calls == []
    assert not (tmp_path / "PWNED").exists()  # a YAML python tag is never executed


def test_counts(capsys):
    """The figures quoted in the report."""
    print(f"\nwrong configurations: {len(BAD)}, wrong files/flags: {len(FILE_CASES)}")
