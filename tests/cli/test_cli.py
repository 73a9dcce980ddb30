"""The command line: a whole job on a tiny saved model, and one-line errors with exit status 2."""

import json

import pytest
import yaml

from grpokit.cli import main


def write_yaml(path, spec):
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def base_spec(tiny_dir, out):
    return {
        "model": str(tiny_dir), "task": "arithmetic", "output_dir": str(out), "per_device_train_batch_size": 4,
        "num_generations": 4, "max_completion_length": 8, "max_steps": 2, "logging_steps": 1,
        "save_strategy": "no", "report_to": "none", "gradient_checkpointing": False, "use_cpu": True,
        "learning_rate": "1e-3",  # YAML reads 1e-3 as a string: it must still be accepted as a number
        "eval": {"n": 4, "max_new_tokens": 8},
    }


def test_train_writes_metrics_plots_and_report(tmp_path, tiny_dir, capsys):
    out = tmp_path / "run"
    cfg = write_yaml(tmp_path / "c.yaml", base_spec(tiny_dir, out))
    assert main(["train", cfg, "--quiet", "--set", "loss_type=vespo"]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "reward" in x] == [1, 2]
    report = json.loads((out / "report.json").read_text())
    for key in ("eval_before", "eval_after"):
        assert {"reward_mean", "accuracy", "last_number_accuracy", "n"} <= set(report[key]) and report[key]["n"] == 4
    assert report["config"]["loss_type"] == "vespo" and report["config"]["learning_rate"] == 1e-3
    assert report["wall_time_s"] > 0
    assert (out / "report.md").exists() and (out / "reward.png").exists()
    assert (out / "final").is_dir()
    text = capsys.readouterr().out
    assert "step 1/2" in text and "before:" in text and "after:" in text
    assert text.count("last number right") == 2  # the format-free accuracy, before and after
    assert "last_number_accuracy" in (out / "report.md").read_text()


def test_held_out_accuracy_during_training_and_examples(tmp_path, tiny_dir, capsys):
    out = tmp_path / "curve"
    spec = base_spec(tiny_dir, out) | {"max_steps": 5, "eval": {"n": 4, "max_new_tokens": 8, "every_steps": 2}}
    assert main(["train", write_yaml(tmp_path / "c.yaml", spec), "--quiet"]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    curve = [x for x in lines if "heldout/accuracy" in x]
    assert [x["step"] for x in curve] == [2, 4]  # not at step 5: the evaluation after training measures that one
    for x in curve:
        assert x["heldout/accuracy_ci_low"] <= x["heldout/accuracy"] <= x["heldout/accuracy_ci_high"]
    report = json.loads((out / "report.json").read_text())
    assert [p["step"] for p in report["held_out_accuracy"]] == [0, 2, 4, 5]
    assert "heldout_accuracy.png" in report["plots"] and (out / "heldout_accuracy.png").stat().st_size > 0
    text = capsys.readouterr().out
    assert "held-out at step 2: reward" in text and "held-out at step 4: reward" in text
    assert "examples (held-out questions; right or wrong as the 'correctness' reward scores them):" in text
    assert text.count("    before  ") == 3 and text.count("    after   ") == 3


def test_eval_every_steps_is_checked(tmp_path, tiny_dir, capsys):
    spec = base_spec(tiny_dir, tmp_path / "bad") | {"eval": {"every_steps": 0}}
    assert main(["train", write_yaml(tmp_path / "c.yaml", spec), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "eval.every_steps=0 is not allowed: expected a positive integer" in err and len(err.splitlines()) == 1


def test_lora_job(tmp_path, tiny_dir):
    out = tmp_path / "lora"
    spec = base_spec(tiny_dir, out) | {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                                       "eval": {"n": 4, "max_new_tokens": 8, "before": False}}
    assert main(["train", write_yaml(tmp_path / "c.yaml", spec), "--quiet"]) == 0
    assert (out / "final" / "adapter_config.json").exists()
    report = json.loads((out / "report.json").read_text())
    assert report["eval_before"] is None and report["eval_after"]["n"] == 4


BAD_SPECS = [
    ({"loss_typ": "dapo"}, "unknown config key 'loss_typ'; did you mean loss_type"),
    ({"loss_type": "ppo"}, "loss_type='ppo' is not allowed"),
    ({"learning_rate": "fast"}, "learning_rate='fast' is not allowed: expected"),
    ({"num_generations": 2.5}, "num_generations=2.5 is not allowed"),
    ({"gradient_checkpointing": "yes"}, "gradient_checkpointing='yes' is not allowed: expected true or false"),
    ({"task": "nonexistent_task"}, "nonexistent_task"),
    ({"reward_funcs": ["no_such_reward"]}, "no_such_reward"),
    ({"eval": {"m": 3}}, "unknown eval key"),
    ({"lora": 16}, "lora=16 is not allowed"),
    ({"time_budget_s": -5}, "time_budget_s=-5 is not allowed"),
    ({"finish_within_s": 0}, "finish_within_s=0 is not allowed: expected a positive number of seconds"),
    ({"started_at": "now"}, "started_at='now' is not allowed: expected a positive number of seconds"),
]


@pytest.mark.parametrize("override,message", BAD_SPECS, ids=[str(b[0]) for b in BAD_SPECS])
def test_bad_config_is_one_line_and_exit_2(tmp_path, tiny_dir, capsys, override, message):
    spec = base_spec(tiny_dir, tmp_path / "x") | override
    assert main(["train", write_yaml(tmp_path / "c.yaml", spec)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpokit: error:") and message in err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x" / "metrics.jsonl").exists()  # nothing ran


def test_bad_files(tmp_path, capsys):
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    assert main(["train", str(tmp_path / "bad.yaml")]) == 2
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    assert main(["train", str(tmp_path / "list.yaml")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "not valid YAML" in err and "must hold a mapping" in err


def test_examples_parse_and_validate(monkeypatch):
    """Every shipped example config passes validation (nothing is loaded), run from the repository root as the
    examples say."""
    from pathlib import Path

    from grpokit.run.job import prepare

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    files = sorted((root / "examples").glob("*.yaml"))
    assert len(files) >= 9
    for f in files:
        spec = yaml.safe_load(f.read_text())
        prepared = prepare(spec)
        assert prepared.job["model"] and prepared.reward_funcs
        if "tools" in f.name or f.stem in ("calculator", "guess"):
            assert prepared.multiturn is not None and prepared.multiturn.has_tools


def test_eval_command(tiny_dir, capsys):
    assert main(["eval", "--model", str(tiny_dir), "--task", "arithmetic", "-n", "4", "--max-new-tokens", "4",
                 "--json"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "accuracy" in out and "95% CI" in out
    assert "Loading weights" not in captured.err  # no loading progress bars; the command prints its own line
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # switched back on for the rest of the process
    summary = json.loads(out[out.index("{"):])
    assert summary["n"] == 4 and 0.0 <= summary["accuracy"] <= 1.0 and len(summary["accuracy_ci95"]) == 2


def test_eval_unknown_task_is_one_line(tiny_dir, capsys):
    assert main(["eval", "--model", str(tiny_dir), "--task", "no_such_task"]) == 2
    assert "no_such_task" in capsys.readouterr().err


@pytest.fixture
def demo_specs(monkeypatch, tmp_path):
    """The job specs `grpokit demo` hands to the job runner (which runs nothing here), in call order; a fresh cache
    folder and working directory."""
    import grpokit.run.job

    specs = []
    monkeypatch.setenv("GRPOKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(grpokit.run.job, "run_job", lambda spec, **kw: specs.append(spec))
    monkeypatch.chdir(tmp_path)
    return specs


@pytest.mark.parametrize("native,speedup,expected", [(True, 5.0, "bfloat16"), (True, 0.7, "float32"),
                                                      (False, 5.0, "float32")])
def test_demo_loads_bf16_weights_where_the_cpu_multiplies_bf16(monkeypatch, tmp_path, capsys, demo_specs, native,
                                                               speedup, expected):
    """The demo's dtype follows the CPU (bf16 matrix units, and bf16 measured faster: AMX ~5x; AVX512-BF16 on Xeon
    cores 0.7x), or not; a dtype the user sets is kept."""
    import grpokit.machine.cpu_features

    monkeypatch.setattr(grpokit.machine.cpu_features, "native_bf16", lambda: native)
    monkeypatch.setattr(grpokit.machine.cpu_features, "bf16_speedup", lambda: speedup)
    assert main(["demo", "--quiet"]) == 0
    assert demo_specs[-1]["model_init_kwargs"] == {"dtype": expected}
    assert f"(LoRA, {expected} weights)" in capsys.readouterr().out
    # timed once and kept for the machine where the CPU has the units; not timed at all where it has not
    assert (tmp_path / "cache" / grpokit.machine.cpu_features.SPEEDUP_FILE).is_file() == native
    assert main(["demo", "--quiet", "--set", "model_init_kwargs={dtype: float16}"]) == 0
    assert demo_specs[-1]["model_init_kwargs"] == {"dtype": "float16"}
    assert main(["demo", "--quiet", "--finish-within", "590", "--started-at", "1700000000"]) == 0
    assert demo_specs[-1]["finish_within_s"] == 590 and demo_specs[-1]["started_at"] == 1700000000
    assert demo_specs[-1]["time_budget_s"] == 550  # the cap stays; the job cuts it where less time is left


def test_demo_trains_with_dapos_loss_unless_algo_says_otherwise(demo_specs):
    """`grpokit demo` without --algo: the job it runs prepares a GRPOConfig with DAPO's loss (token-level, the upper
    clip 0.28); --algo grpo gives GRPO's per-sequence mean with the symmetric clip."""
    from grpokit.run.job import prepare

    assert main(["demo", "--quiet"]) == 0
    assert main(["demo", "--quiet", "--algo", "grpo"]) == 0
    dapo, grpo = (prepare(dict(spec)).config for spec in demo_specs)
    assert (dapo.loss_type, dapo.epsilon, dapo.epsilon_high) == ("dapo", 0.2, 0.28)
    assert (grpo.loss_type, grpo.epsilon_high) == ("grpo", None)  # the upper clip is epsilon
    assert dapo.learning_rate == grpo.learning_rate == 5e-4  # the rest of the recipe is the same


def test_demo_learning_rate_warms_up_holds_then_decays(demo_specs, tmp_path):
    """The demo's schedule as its GRPOTrainer builds it (transformers' create_optimizer_and_scheduler, what train()
    calls) from the prepared config: 0 -> 5e-4 over 10 steps, held to step 50, then linearly to 0 at step 130 (a run
    stopped by time earlier ends part way down), where ``max_steps`` stops the demo: no step runs at a rate of 0."""
    from tiny import tiny_model, tiny_tokenizer

    from grpokit.run.job import prepare
    from grpokit.trainer import GRPOTrainer

    assert main(["demo", "--quiet"]) == 0
    prepared = prepare({**demo_specs[-1], "output_dir": str(tmp_path / "run")})
    config = prepared.config
    tok = tiny_tokenizer()
    trainer = GRPOTrainer(tiny_model(tok), prepared.reward_funcs, args=config,
                          train_dataset=prepared.task.train_dataset, processing_class=tok)
    trainer.create_optimizer_and_scheduler(num_training_steps=config.max_steps)
    optimizer, schedule = trainer.optimizer, trainer.lr_scheduler
    lrs = []
    for _ in range(config.max_steps + 20):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs[0] == 0 and lrs[5] == pytest.approx(2.5e-4) and lrs[10] == lrs[49] == 5e-4
    assert lrs[90] == pytest.approx(2.5e-4) and lrs[129] == pytest.approx(5e-4 / 80) and lrs[130] == lrs[-1] == 0
    assert config.max_steps == lrs.index(0, 1) == 130  # steps 0..129 run, each at a rate above 0


def test_demo_without_dynamic_sampling_drops_its_own_dynamic_sampling_settings(demo_specs, caplog):
    """`--set dynamic_sampling=false` on the demo: the recipe's oversample and explore probability go with it (no
    warning about settings the user did not write); one the user sets too is kept, and the config warns about it."""
    import logging

    from grpokit.run.job import prepare

    assert main(["demo", "--quiet", "--set", "dynamic_sampling=false"]) == 0
    assert main(["demo", "--quiet", "--set", "dynamic_sampling=false", "--set", "dynamic_sampling_explore_prob=0.3"]) == 0
    assert main(["demo", "--quiet"]) == 0
    off, off_but_set, on = demo_specs
    assert not [k for k in off if k.startswith("dynamic_sampling_")]
    assert [k for k in off_but_set if k.startswith("dynamic_sampling_")] == ["dynamic_sampling_explore_prob"]
    assert (on["dynamic_sampling_oversample"], on["dynamic_sampling_explore_prob"]) == (4, 0.5)
    assert on["dynamic_sampling_explore_prob_hard"] == 1.0  # a question every answer failed is always asked again
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        prepare(dict(off))
        assert not [r for r in caplog.records if "no effect without dynamic_sampling" in r.getMessage()]
        prepare(dict(off_but_set))
    assert [r.getMessage().split(" has")[0] for r in caplog.records
            if "no effect without dynamic_sampling" in r.getMessage()] == ["dynamic_sampling_explore_prob=0.3"]


def test_native_bf16_reads_torch_cpu_probes(monkeypatch, tmp_path):
    import torch

    import grpokit.machine.cpu_features
    from grpokit.machine.cpu_features import cpu_dtype, native_bf16

    monkeypatch.setenv("GRPOKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(grpokit.machine.cpu_features, "bf16_speedup", lambda: 5.0)  # as AMX measures
    for amx, avx in [(False, False), (True, False), (False, True)]:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda avx=avx: avx, raising=False)
        assert native_bf16() == (amx or avx)
        assert cpu_dtype() == ("bfloat16" if amx or avx else "float32")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    assert not native_bf16()  # a torch without the probes: float32


@pytest.mark.parametrize("speedup,expected", [(0.7, "float32"), (1.49, "float32"), (1.5, "bfloat16"), (2.8, "bfloat16")])
def test_bf16_only_where_it_multiplies_clearly_faster(monkeypatch, tmp_path, speedup, expected):
    """bf16 units are not enough: AVX512-BF16 kernels on Xeon cores (AMX capped) measured 0.7x float32's speed, an
    AMD EPYC's 2.8x, AMX ~5x; the demo takes bf16 from 1.5x. A CPU without the units is not timed at all."""
    import grpokit.machine.cpu_features as features

    monkeypatch.setenv("GRPOKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(features, "native_bf16", lambda: True)
    monkeypatch.setattr(features, "bf16_speedup", lambda: speedup)
    assert features.cpu_dtype() == expected
    monkeypatch.setattr(features, "native_bf16", lambda: False)
    monkeypatch.setattr(features, "bf16_speedup", lambda: pytest.fail("timed"))
    assert features.cpu_dtype() == "float32"


def test_bf16_speedup_is_measured_once_per_machine(monkeypatch, tmp_path):
    """The timing is kept in the cache by machine (CPU, oneDNN's cap, torch): a later demo on the machine (another
    seed, a resume) takes the same dtype without timing again; another cap is another machine; a cache that cannot
    be read is measured again and rewritten, one that cannot be written is measured every time."""
    import json

    import grpokit.machine.cpu_features as features

    monkeypatch.setenv("GRPOKIT_CACHE", str(tmp_path))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    timed = []
    monkeypatch.setattr(features, "bf16_speedup", lambda: timed.append(1) or 2.5 * len(timed))
    assert features.measured_bf16_speedup() == 2.5 and timed == [1]
    assert features.measured_bf16_speedup() == 2.5 and timed == [1]  # kept: not timed again
    kept = json.loads((tmp_path / features.SPEEDUP_FILE).read_text())
    assert kept == {features.machine_key(): 2.5} and "torch" in features.machine_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert features.measured_bf16_speedup() == 5.0 and len(timed) == 2  # another cap: measured, kept beside
    assert len(json.loads((tmp_path / features.SPEEDUP_FILE).read_text())) == 2
    (tmp_path / features.SPEEDUP_FILE).write_text("{not json")
    assert features.measured_bf16_speedup() == 7.5 and len(timed) == 3
    assert features.measured_bf16_speedup() == 7.5 and len(timed) == 3
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("GRPOKIT_CACHE", str(blocked))  # the cache folder cannot be made
    assert features.measured_bf16_speedup() == 10.0 and features.measured_bf16_speedup() == 12.5


def test_bf16_speedup_times_both_dtypes_on_one_thread_and_gives_the_threads_back(monkeypatch):
    import torch

    from grpokit.machine.cpu_features import bf16_speedup

    seen = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, w: seen.append((x.dtype, w.dtype, torch.get_num_threads())) or linear(x, w))
    before = torch.get_num_threads()
    ratio = bf16_speedup(rounds=2)
    assert ratio > 0 and torch.get_num_threads() == before
    assert {d for d, _, _ in seen} == {torch.float32, torch.bfloat16} and all(a == b for a, b, _ in seen)
    assert len(seen) == 2 * 3 * 4 and {t for _, _, t in seen} == {1}


def test_a_job_loads_with_model_init_kwargs_and_the_trainer_does_not_call_them_ignored(tmp_path, tiny_dir, caplog):
    """The job loads the model with ``model_init_kwargs`` itself; the trainer, handed the loaded model, used to warn
    that they were ignored (a line in the demo's terminal). The report keeps them."""
    import logging

    out = tmp_path / "run"
    spec = {**base_spec(tiny_dir, out), "max_steps": 1, "model_init_kwargs": {"dtype": "bfloat16"}}
    spec["eval"] = {**spec["eval"], "before": False}
    cfg = write_yaml(tmp_path / "c.yaml", spec)
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        assert main(["train", cfg, "--quiet"]) == 0
    assert not [r for r in caplog.records if "ignored" in r.getMessage()], [r.getMessage() for r in caplog.records]
    assert json.loads((out / "report.json").read_text())["config"]["model_init_kwargs"] == {"dtype": "bfloat16"}


def test_first_use_of_a_builtin_model_says_it_converts_once(tmp_path, tiny_dir, capsys, monkeypatch):
    """A newcomer's first run converts the embedded model (once): the job says so and how long it took, in its own
    lines (the conversion's progress bar stays off)."""
    import grpokit.models

    monkeypatch.setattr(grpokit.models, "builtin_cache_missing", lambda name: True)
    monkeypatch.setattr(grpokit.models, "builtin_cache_dir", lambda name: tmp_path / "cache" / "tiny")
    out = tmp_path / "run"
    spec = {**base_spec(tiny_dir, out), "max_steps": 1}
    spec["eval"] = {**spec["eval"], "before": False, "after": False}
    assert main(["train", write_yaml(tmp_path / "c.yaml", spec)]) == 0
    text = capsys.readouterr().out
    assert f"converting its GGUF file into {tmp_path / 'cache' / 'tiny'} (once; later runs load that copy)" in text
    assert "converted in " in text


def test_a_job_with_ema_decay_evaluates_and_delivers_the_average(tmp_path, tiny_dir):
    """final/ holds the averaged weights (the checkpoint of the last step holds both: the trained ones and the
    average, for a resume)."""
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "run"
    (tmp_path / "spread_rewards.py").write_text(  # beside the config: rewards with spread, so the weights move
        "def spread(completions, **kw):\n    return [len(set(c[0]['content'])) / 8.0 for c in completions]\n")
    spec = base_spec(tiny_dir, out) | {"max_steps": 3, "ema_decay": 0.5, "learning_rate": 0.05,
                                       "reward_funcs": "spread_rewards:spread",
                                       "save_strategy": "steps", "save_steps": 3,
                                       "eval": {"n": 4, "max_new_tokens": 8, "every_steps": 2}}
    assert main(["train", write_yaml(tmp_path / "c.yaml", spec), "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["ema_decay"] == 0.5
    assert [p["step"] for p in report["held_out_accuracy"]] == [0, 2, 3]
    final = load_file(str(out / "final" / "model.safetensors"))
    trained = load_file(str(out / "checkpoint-3" / "model.safetensors"))
    average = load_file(str(out / "checkpoint-3" / "grpokit_weight_average.safetensors"))
    for name, value in final.items():
        assert torch.equal(value, average[name].to(value.dtype)), name
    assert any(not torch.equal(final[k], trained[k]) for k in final)


def test_run_job_adds_the_callbacks_it_is_given(tmp_path, tiny_dir):
    """What benchmarks/ema_probe.py hooks into: the job's trainer, every step, the model and tokenizer at hand."""
    from transformers import TrainerCallback

    from grpokit.run.job import run_job

    seen = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
            seen.append((state.global_step, model is not None, processing_class is not None))

    spec = base_spec(tiny_dir, tmp_path / "run") | {"eval": {"n": 4, "max_new_tokens": 8, "before": False}}
    run_job(spec, quiet=True, callbacks=[Record()])
    assert seen == [(1, True, True), (2, True, True)]


def test_finish_within_cuts_training_by_what_was_spent_before_it(tmp_path, tiny_dir, capsys, monkeypatch):
    """``make demo``'s promise: the clock starts at ``started_at`` (before installing), the evaluation after training
    is kept time for, and training gets what is left, never more than ``time_budget_s``."""
    import time

    import grpokit.run.job

    monkeypatch.setattr(grpokit.run.job, "MIN_TRAINING_S", 0.001)
    spent = base_spec(tiny_dir, tmp_path / "late") | {"max_steps": 50, "time_budget_s": 500,
                                                        "finish_within_s": 600, "started_at": time.time() - 700}
    assert main(["train", write_yaml(tmp_path / "late.yaml", spent), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "training for at most 0 s, to end within 600 s of the start (7" in text  # 700-odd s spent
    report = json.loads((tmp_path / "late" / "report.json").read_text())
    assert report["config"]["steps"] == 1  # the budget ends training after its first step

    roomy = base_spec(tiny_dir, tmp_path / "roomy") | {"finish_within_s": 10_000, "time_budget_s": 500}
    assert main(["train", write_yaml(tmp_path / "roomy.yaml", roomy), "--quiet"]) == 0
    assert "to end within" not in capsys.readouterr().out
    assert json.loads((tmp_path / "roomy" / "report.json").read_text())["config"]["steps"] == 2


def test_a_sampled_held_out_evaluation_samples_with_the_configs_top_k(tmp_path, tiny_dir):
    """``eval: {greedy: false}`` samples with the config's temperature and top_k, as training samples: with
    ``top_k: 1`` the evaluation before training is the greedy one, at any temperature."""
    from grpokit.run.job import run_job

    reports = {}
    for name, extra in {"greedy": {}, "top1": {"eval_greedy": False, "top_k": 1},
                        "all": {"eval_greedy": False}}.items():
        greedy = extra.pop("eval_greedy", True)
        spec = base_spec(tiny_dir, tmp_path / name) | {"max_steps": 1, "temperature": 5.0, **extra,
                                                       "eval": {"n": 8, "max_new_tokens": 8, "after": False,
                                                                "greedy": greedy}}
        run_job(spec, quiet=True)
        _, samples = json.loads((tmp_path / name / "eval_before.json").read_text())  # (summary, samples)
        reports[name] = [s["completion"] for s in samples]
    assert reports["greedy"] and reports["top1"] == reports["greedy"]
    assert reports["all"] != reports["greedy"]  # sampling at 5 without top-k scatters
