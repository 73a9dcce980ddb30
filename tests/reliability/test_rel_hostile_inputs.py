"""Careless and hostile inputs, second wave: a table of inputs per family, each handled end to end.

- ``JOB``: job specs through ``grpokit train`` (and ``grpokit.run.job.prepare``): one line naming the field, the value
  and what is allowed, exit 2, before any model is loaded (models, output directories, datasets, user modules,
  values silently accepted before).
- ``FILES``: config files and flags (not UTF-8, YAML syntax with line and column, ``--set`` that is not YAML,
  multi-megabyte values, numeric flags out of range) for ``train``, ``demo`` and ``eval``.
- ``EVAL``: every loading problem of ``grpokit eval``.

Together with ``test_rel_config_table.py`` these are the hostile-input battery (``test_battery_size``); the run
directory family (locks, earlier runs, resume mismatches, a full disk) is in ``test_rel_run_dir.py``.
"""

from __future__ import annotations

import json
import struct

import pytest
import yaml
from reliability_helpers import LoadGuard
from test_rel_config_table import BAD, BASE, DROP, FILE_CASES, build_spec, check_message

from grpokit.cli import main
from grpokit.run.job import JobError, prepare

MAX_LINE = 700  # a message is bounded whatever the input (grpokit.cli.MAX_MESSAGE plus the prefix)

# (id, overrides, snippets the one-line message must contain)
JOB: list[tuple[str, dict, tuple[str, ...]]] = [
    # values that were silently accepted or misread
    ("max_steps_negative", {"max_steps": -5}, ("max_steps=-5", "positive number of steps, or -1")),
    ("max_steps_zero", {"max_steps": 0}, ("max_steps=0", "positive number of steps, or -1")),
    ("time_budget_nan", {"time_budget_s": float("nan")}, ("time_budget_s=nan", "positive number of seconds")),
    ("time_budget_inf", {"time_budget_s": float("inf")}, ("time_budget_s=inf", "positive number of seconds")),
    ("time_budget_bool", {"time_budget_s": True}, ("time_budget_s=True", "positive number of seconds")),
    ("model_init_kwargs_ignored", {"model_init_kwargs": {"load_in_9bit": True}},
     ("model_init_kwargs ['load_in_9bit']", "not used by grpokit train", "attn_implementation")),
    # the output directory
    ("output_dir_is_a_file", {"output_dir": "{tmp}/good.jsonl"}, ("good.jsonl", "is a file, not a directory")),
    ("output_dir_under_a_file", {"output_dir": "{tmp}/good.jsonl/run"}, ("cannot be created", "is a file")),
    ("output_dir_empty", {"output_dir": ""}, ("output_dir=''", "expected a directory path")),
    ("output_dir_blank", {"output_dir": "   "}, ("output_dir='   '", "expected a directory path")),
    # the model, checked before it loads
    ("model_path_missing", {"model": "{tmp}/models/nowhere"}, ("model path", "nowhere", "does not exist")),
    ("model_relative_path_missing", {"model": "./checkpoints/final"}, ("./checkpoints/final", "does not exist")),
    ("model_gguf_missing", {"model": "missing.gguf"}, ("missing.gguf", "does not exist")),
    ("model_near_miss", {"model": "smollm2-135m"}, ("unknown model 'smollm2-135m'", "did you mean",
                                                    "smollm2-135m-instruct")),
    ("model_near_miss_typo", {"model": "smolm2-135m-instruct"}, ("did you mean", "smollm2-135m-instruct")),
    ("model_dir_without_model", {"model": "{tmp}/models/empty"}, ("holds no model", "config.json")),
    ("model_config_without_weights", {"model": "{tmp}/models/config_only"}, ("config.json but no weights",
                                                                              "not written yet")),
    ("model_pickled_only", {"model": "{tmp}/models/pickled"}, ("only pickled weights", "pytorch_model.bin",
                                                               "safetensors")),
    ("model_truncated_safetensors", {"model": "{tmp}/models/truncated"}, ("model.safetensors is damaged", "truncated",
                                                                          "incomplete")),
    ("model_not_safetensors", {"model": "{tmp}/models/not_safetensors"}, ("model.safetensors is damaged",)),
    ("model_header_not_json", {"model": "{tmp}/models/bad_header"}, ("model.safetensors is damaged", "not valid JSON")),
    ("adapter_without_weights", {"model": "{tmp}/models/adapter_only_config"}, ("adapter directory",
                                                                                "no adapter_model.safetensors")),
    ("model_empty_string", {"model": ""}, ("model=''", "as a string")),
    # the dataset
    ("batch_larger_than_data", {"task": DROP, "dataset": "{tmp}/two_rows.jsonl", "per_device_train_batch_size": 16,
                                "task_args": {"n_eval": 0}},
     ("train_dataset has 2 prompts", "fewer than the 4 prompts", "per_device_train_batch_size")),
    ("column_named_completions", {"task": DROP, "dataset": "{tmp}/clash.jsonl", "task_args": {"n_eval": 4}},
     ("column(s) ['completions']", "named like keywords", "rename them")),
    ("column_named_prompts", {"task": DROP, "dataset": "{tmp}/clash2.jsonl", "task_args": {"n_eval": 4}},
     ("column(s) ['prompts']", "rename them")),
    ("jsonl_broken_line", {"task": DROP, "dataset": "{tmp}/broken.jsonl"}, ("broken.jsonl", "line 3",
                                                                            "not valid JSON")),
    ("jsonl_not_objects", {"task": DROP, "dataset": "{tmp}/numbers.jsonl"}, ("numbers.jsonl", "line 1",
                                                                             "not a JSON object")),
    ("jsonl_not_utf8", {"task": DROP, "dataset": "{tmp}/latin1.jsonl"}, ("latin1.jsonl", "not UTF-8")),
    ("dataset_is_a_directory", {"task": DROP, "dataset": "{tmp}/models"}, ("models", "not found")),
    ("dataset_empty_string", {"task": DROP, "dataset": ""}, ("dataset=''", "as a string")),
    # user modules (rewards, tools, environments)
    ("reward_module_raises", {"reward_funcs": "{tmp}/boom_rewards.py:score"},
     ("boom_rewards.py", "failed", "RuntimeError", "configured wrongly")),
    ("reward_module_missing_dependency", {"reward_funcs": "needs_missing_dep:score"},
     ("needs_missing_dep", "importing", "failed", "no_such_dependency_xyz")),
    ("reward_module_syntax_error", {"reward_funcs": "{tmp}/syntax_rewards.py:score"},
     ("syntax_rewards.py", "SyntaxError")),
    ("reward_module_not_found_hint", {"reward_funcs": "my_rewards_nowhere:score"},
     ("cannot import module 'my_rewards_nowhere'", "path/to/file.py:name")),
    ("reward_file_missing", {"reward_funcs": "rewards_nowhere.py:score"}, ("no file 'rewards_nowhere.py'",
                                                                           "looked up in")),
    ("reward_attribute_missing", {"reward_funcs": "{tmp}/good_rewards.py:nope"}, ("has no attribute 'nope'",)),
    ("reward_spec_without_colon", {"reward_funcs": "{tmp}/good_rewards.py"}, ("Unknown reward function",)),
    ("tool_module_missing", {"tools": "no_tools_here:add"}, ("tools=", "cannot import module 'no_tools_here'")),
    ("tool_spec_type", {"tools": 5}, ("tools=5", "module:function")),
    ("environment_type", {"environment": 5}, ("environment=5", "module:Class")),
    ("environment_missing", {"environment": "no_env_here:Env"}, ("environment=", "cannot import module 'no_env_here'")),
    ("chat_template_missing", {"chat_template": "{tmp}/nowhere.jinja"}, ("nowhere.jinja",)),
    # LoRA and evaluation sections
    ("lora_target_modules_type", {"lora": {"target_modules": 5}}, ("lora.target_modules=5", "all-linear")),
    ("lora_alpha_negative", {"lora": {"alpha": -1}}, ("lora.alpha=-1", "positive integer")),
    ("eval_max_new_tokens_zero", {"eval": {"max_new_tokens": 0}}, ("eval.max_new_tokens=0", "positive integer")),
    ("eval_n_negative", {"eval": {"n": -3}}, ("eval.n=-3", "positive integer")),
]


def _safetensors_bytes(declared_end: int, actual_data: int) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [declared_end // 4], "data_offsets": [0, declared_end]}})
    raw = header.encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * actual_data


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(40)]
    (d / "good.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "two_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    (d / "clash.jsonl").write_text("".join(json.dumps({**r, "completions": "x"}) + "\n" for r in rows))
    (d / "clash2.jsonl").write_text("".join(json.dumps({**r, "prompts": "x"}) + "\n" for r in rows))
    (d / "broken.jsonl").write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1]) + "\n"
                                    + '{"prompt": "What is 3 + 1?", "answer": \n' + json.dumps(rows[3]) + "\n")
    (d / "numbers.jsonl").write_text("1\n2\n3\n")
    (d / "latin1.jsonl").write_bytes('{"prompt": "Qu\'est-ce que 1 + 1 ? é", "answer": "2"}\n'.encode("latin-1"))
    (d / "boom_rewards.py").write_text("raise RuntimeError('configured wrongly')\n")
    (d / "syntax_rewards.py").write_text("def score(completions, **kw)\n    return [0.0]\n")
    (d / "good_rewards.py").write_text("def score(completions, **kw):\n    return [0.0 for _ in completions]\n")
    (d / "needs_missing_dep.py").write_text("import no_such_dependency_xyz\n\ndef score(completions, **kw):\n"
                                            "    return [0.0]\n")
    models = d / "models"
    (models / "empty").mkdir(parents=True)
    for name in ("config_only", "pickled", "truncated", "not_safetensors", "bad_header"):
        (models / name).mkdir()
        (models / name / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (models / "pickled" / "pytorch_model.bin").write_bytes(b"PK\x03\x04 pickled")
    (models / "truncated" / "model.safetensors").write_bytes(_safetensors_bytes(4096, 100))
    (models / "not_safetensors" / "model.safetensors").write_bytes(b"<html>404 Not Found</html>")
    (models / "bad_header" / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!")
    (models / "adapter_only_config").mkdir()
    (models / "adapter_only_config" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "x"}))
    return d


def run_cli(argv, capsys) -> str:
    """``argv`` through the CLI: exit 2 and one bounded line, no traceback; returns the line."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("grpokit: error:") and len(err.splitlines()) == 1, err[:1500]
    assert "Traceback" not in err + captured.out
    assert len(err) <= MAX_LINE, len(err)
    return err


@pytest.mark.parametrize("case_id,overrides,snippets", JOB, ids=[c[0] for c in JOB])
def test_job_inputs_through_the_api(monkeypatch, tmp_path, data_dir, case_id, overrides, snippets):
    guard = LoadGuard(monkeypatch)
    monkeypatch.chdir(data_dir)  # module names resolve from the current directory, as `python -m` does
    with pytest.raises(JobError) as e:
        prepare(build_spec(overrides, data_dir, tmp_path / "out"))
    check_message(str(e.value), snippets)
    assert guard.calls == []


@pytest.mark.parametrize("case_id,overrides,snippets", JOB, ids=[c[0] for c in JOB])
def test_job_inputs_through_the_cli(monkeypatch, tmp_path, data_dir, capsys, case_id, overrides, snippets):
    guard = LoadGuard(monkeypatch)
    monkeypatch.chdir(data_dir)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(build_spec(overrides, data_dir, tmp_path / "out")))
    check_message(run_cli(["train", str(cfg)], capsys), snippets)
    assert guard.calls == []
    assert not (tmp_path / "out").exists()  # nothing created for a run that never started


def test_a_reward_module_beside_the_config_is_found_from_anywhere(monkeypatch, tmp_path, data_dir):
    """``grpokit train configs/job.yaml`` with ``reward_funcs: my_rewards:score`` finds configs/my_rewards.py
    although the current directory is elsewhere (the console script does not put the config's folder on the
    path)."""
    LoadGuard(monkeypatch)
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "beside_rewards.py").write_text("def score(completions, **kw):\n    return [1.0 for _ in completions]\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = build_spec({"reward_funcs": "beside_rewards:score"}, data_dir, tmp_path / "out")
    assert prepare(spec, config_dir=configs).reward_funcs[0](["a", "b"]) == [1.0, 1.0]
    spec = build_spec({"reward_funcs": "beside_rewards.py:score"}, data_dir, tmp_path / "out")
    assert prepare(spec, config_dir=configs).reward_funcs[0](["a"]) == [1.0]
    with pytest.raises(JobError, match="cannot import module 'beside_rewards_gone'"):
        prepare(build_spec({"reward_funcs": "beside_rewards_gone:score"}, data_dir, tmp_path / "out"),
                config_dir=configs)


# -- files and flags --------------------------------------------------------------------------------------------
GOOD_YAML = "model: x\ntask: arithmetic\n"
HUGE = "a" * 3_000_000

# (id, config bytes or None, argv after the command, snippets); {cfg} is the config path, {tmp} the test's folder
FILES: list[tuple[str, bytes | None, list[str], tuple[str, ...]]] = [
    ("config_not_utf8", "model: x\ntask: arithmétique\n".encode("latin-1"), ["train", "{cfg}"],
     ("is not UTF-8 text", "byte 21")),
    ("config_utf16", "model: x\n".encode("utf-16"), ["train", "{cfg}"], ("is not UTF-8 text",)),
    ("config_binary", b"\x00\x01\x02\xff" * 50, ["train", "{cfg}"], ("is not UTF-8",)),
    ("yaml_unclosed_bracket_line_column", b"model: x\ntask: arithmetic\nlora: {r: 4\nbeta: 0\n", ["train", "{cfg}"],
     ("not valid YAML", "line 4", "column")),
    ("yaml_bad_indent_line", b"model: x\n  task: arithmetic\n", ["train", "{cfg}"], ("not valid YAML", "line 2")),
    ("yaml_tab_indent", b"model: x\nlora:\n\tr: 4\n", ["train", "{cfg}"], ("not valid YAML", "line 3")),
    ("config_is_a_directory", None, ["train", "{tmp}"], ("is not a file",)),
    ("set_value_not_yaml", GOOD_YAML.encode(), ["train", "{cfg}", "--set", "lora={r: 4"],
     ("--set 'lora={r: 4'", "not valid YAML", "quote it")),
    ("set_unknown_key", GOOD_YAML.encode(), ["train", "{cfg}", "--set", "learning_rte=1e-4"],
     ("unknown config key 'learning_rte'", "did you mean learning_rate")),
    ("set_negative_max_steps", GOOD_YAML.encode(), ["train", "{cfg}", "--set", "max_steps=-1.5"],
     ("max_steps=-1.5",)),
    # `--set output_dir=$RUN_DIR` with RUN_DIR unset: refused as an empty value in the file is, not trainer_output/
    ("set_output_dir_empty", GOOD_YAML.encode(), ["train", "{cfg}", "--set", "output_dir="],
     ("output_dir=''", "expected a directory path")),
    ("set_output_dir_blank", GOOD_YAML.encode(), ["train", "{cfg}", "--set", "output_dir=  "],
     ("output_dir='  '", "expected a directory path")),
    ("set_max_steps_empty", GOOD_YAML.encode(), ["train", "{cfg}", "--set", "max_steps="], ("max_steps=''",)),
    ("output_dir_null_in_file", b"model: x\ntask: arithmetic\noutput_dir:\n", ["train", "{cfg}"],
     ("output_dir=None", "expected a directory path")),
    ("huge_value_bounded", f"model: x\ntask: arithmetic\nloss_type: {HUGE}\n".encode(), ["train", "{cfg}"],
     ("loss_type=", "characters", "use one of")),
    ("huge_key_bounded", f"model: x\ntask: arithmetic\n{HUGE}: 1\n".encode(), ["train", "{cfg}"],
     ("not valid YAML", "line 3")),
    ("huge_set_key_bounded", GOOD_YAML.encode(), ["train", "{cfg}", "--set", f"{HUGE}=1"],
     ("unknown config key", "characters")),
    ("huge_set_bounded", GOOD_YAML.encode(), ["train", "{cfg}", "--set", f"run_name=[{HUGE}"], ("not valid YAML",)),
    ("huge_model_name_bounded", f"model: /{HUGE}\ntask: arithmetic\n".encode(), ["train", "{cfg}"],
     ("model='/aaaa", "characters", "File name too long")),
    ("unknown_flag", GOOD_YAML.encode(), ["train", "{cfg}", "--resum"], ("unrecognized arguments: --resum",)),
    ("demo_unknown_algo", None, ["demo", "--algo", "ppo"], ("--algo='ppo'", "expected one of", "grpo", "vespo")),
    ("demo_max_steps_zero", None, ["demo", "--max-steps", "0"], ("--max-steps", "0 is not allowed", "positive")),
    ("demo_eval_n_text", None, ["demo", "--eval-n", "many"], ("--eval-n", "'many' is not an integer")),
    ("demo_bad_set", None, ["demo", "--set", "beta=-1"], ("beta=-1", "[0, inf)")),
    ("eval_n_zero", None, ["eval", "--model", "x", "--task", "arithmetic", "-n", "0"], ("-n", "positive integer")),
    ("eval_max_new_tokens_negative", None, ["eval", "--model", "x", "--task", "arithmetic", "--max-new-tokens", "-4"],
     ("--max-new-tokens", "-4")),
    ("eval_missing_task_flag", None, ["eval", "--model", "x"], ("--task",)),
    ("no_command", None, [], ("command",)),
]


@pytest.mark.parametrize("case_id,content,argv,snippets", FILES, ids=[c[0] for c in FILES])
def test_files_and_flags(monkeypatch, tmp_path, capsys, case_id, content, argv, snippets):
    guard = LoadGuard(monkeypatch)
    monkeypatch.chdir(tmp_path)  # the demo's default output folder lands here if a case ever got that far
    cfg = tmp_path / "c.yaml"
    if content is not None:
        cfg.write_bytes(content)
    argv = [a.replace("{cfg}", str(cfg)).replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        err = run_cli(argv, capsys)
    except SystemExit as e:  # argparse errors exit by themselves (status 2), still one line
        assert e.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err[:1500]
    check_message(err, snippets)
    assert guard.calls == []
    assert not (tmp_path / "runs").exists() and not (tmp_path / "trainer_output").exists()


# -- grpokit eval: every loading problem is one line -------------------------------------------------------------
EVAL: list[tuple[str, str, tuple[str, ...]]] = [
    ("missing_directory", "{tmp}/models/nowhere", ("model path", "does not exist")),
    ("directory_without_model", "{tmp}/models/empty", ("holds no model",)),
    ("weights_not_written", "{tmp}/models/config_only", ("no weights", "not written yet")),
    ("weights_half_written", "{tmp}/models/truncated", ("model.safetensors is damaged", "truncated")),
    ("weights_not_safetensors", "{tmp}/models/not_safetensors", ("model.safetensors is damaged",)),
    ("pickled_weights", "{tmp}/models/pickled", ("only pickled weights",)),
    ("adapter_not_written", "{tmp}/models/adapter_only_config", ("no adapter_model.safetensors",)),
    ("adapter_without_base", "{tmp}/models/adapter_no_base", ("does not name its base model",)),
    ("adapter_base_missing", "{tmp}/models/adapter_base_gone", ("model path", "base_gone", "does not exist")),
    ("custom_code", "{tmp}/models/custom_code", ("could not be loaded",)),
    ("near_miss_builtin", "smollm-135m-instruct", ("did you mean", "smollm2-135m-instruct")),
]


@pytest.fixture(scope="module")
def eval_models(data_dir):
    models = data_dir / "models"
    for name, base in (("adapter_no_base", None), ("adapter_base_gone", str(data_dir / "base_gone"))):
        (models / name).mkdir(exist_ok=True)
        (models / name / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
        (models / name / "adapter_model.safetensors").write_bytes(_safetensors_bytes(8, 8))
    custom = models / "custom_code"
    custom.mkdir(exist_ok=True)
    (custom / "config.json").write_text(json.dumps({"model_type": "my_secret_arch",
                                                    "auto_map": {"AutoModelForCausalLM": "modeling_x.MyModel"}}))
    (custom / "model.safetensors").write_bytes(_safetensors_bytes(8, 8))
    (custom / "modeling_x.py").write_text("open('PWNED', 'w').write('ran')\n")
    return data_dir


@pytest.mark.parametrize("case_id,model,snippets", EVAL, ids=[c[0] for c in EVAL])
def test_eval_loading_problems(monkeypatch, tmp_path, eval_models, capsys, case_id, model, snippets):
    monkeypatch.chdir(tmp_path)
    model = model.replace("{tmp}", str(eval_models))
    err = run_cli(["eval", "--model", model, "--task", "arithmetic", "-n", "2"], capsys)
    check_message(err, snippets)
    assert not (tmp_path / "PWNED").exists() and not (eval_models / "models" / "custom_code" / "PWNED").exists()


def test_battery_size():
    """The hostile-input battery: at least 100 inputs (this file, the configuration table and the run-directory
    tests)."""
    from test_rel_run_dir import RUN_DIR_CASES

    total = len(JOB) + len(FILES) + len(EVAL) + len(BAD) + len(FILE_CASES) + len(RUN_DIR_CASES)
    print(f"\nhostile inputs: {total} (job {len(JOB)}, files/flags {len(FILES)}, eval {len(EVAL)}, "
          f"config table {len(BAD) + len(FILE_CASES)}, run directories {len(RUN_DIR_CASES)})")
    assert total >= 100
    ids = [c[0] for c in JOB + FILES + EVAL]
    assert len(ids) == len(set(ids))


# -- the Python API's constructor: one ValueError naming the thing -------------------------------------------------
def test_lora_target_modules_that_match_nothing(tmp_path):
    from peft import LoraConfig
    from reliability_helpers import chat_dataset, make_args, tiny_model, tiny_tokenizer, varied_reward

    from grpokit.trainer import GRPOTrainer

    tok = tiny_tokenizer()
    with pytest.raises(ValueError) as e:
        GRPOTrainer(tiny_model(tok), varied_reward, args=make_args(tmp_path / "out"), train_dataset=chat_dataset(),
                    processing_class=tok, peft_config=LoraConfig(r=4, target_modules=["q_projection"]))
    assert "target_modules={'q_projection'}" in str(e.value) and "matches no module" in str(e.value)
    assert "q_proj" in str(e.value)  # the names that exist


def test_a_tokenizer_larger_than_the_embedding(tmp_path):
    from reliability_helpers import chat_dataset, make_args, tiny_model, tiny_tokenizer, varied_reward

    from grpokit.trainer import GRPOTrainer

    tok = tiny_tokenizer()
    model = tiny_model(tok)
    model.resize_token_embeddings(len(tok) - 7)
    with pytest.raises(ValueError) as e:
        GRPOTrainer(model, varied_reward, args=make_args(tmp_path / "out"), train_dataset=chat_dataset(),
                    processing_class=tok)
    assert f"the tokenizer has {len(tok)} tokens but the model's embedding has {len(tok) - 7} rows" in str(e.value)


def test_lora_target_modules_through_the_cli_before_any_evaluation(tmp_path, tiny_dir, capsys):
    """A typo in lora.target_modules is reported as soon as the model is loaded, before the evaluation before
    training (minutes on a real model) runs."""
    cfg = tmp_path / "c.yaml"
    out = tmp_path / "out"
    cfg.write_text(yaml.safe_dump(dict(BASE, model=str(tiny_dir), output_dir=str(out),
                                       eval={"n": 2, "max_new_tokens": 4, "before": True},
                                       lora={"r": 4, "target_modules": ["q_projection", "v_projection"]})))
    assert main(["train", str(cfg)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("grpokit: error:") and len(err.splitlines()) == 1 and "Traceback" not in err, err
    check_message(err, ("lora.target_modules=", "q_projection", "matches no module", "q_proj, up_proj, v_proj"))
    assert "evaluating" not in captured.out and not (out / "eval_before.json").exists()
