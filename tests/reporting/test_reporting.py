"""Tests for grpokit.reporting: metrics.jsonl callback, progress lines, plots, report, intervals."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("rich")

from transformers import TrainerControl, TrainerState, TrainingArguments  # noqa: E402

from grpokit.callbacks import MetricsJsonlCallback, ProgressCallback  # noqa: E402
from grpokit.reporting import (  # noqa: E402
    compute_improvement,
    log_completions_table,
    make_plots,
    md_escape,
    mean_ci95,
    read_metrics,
    wilson_interval,
    write_report,
)

LOGS = [
    {"loss": -0.0012, "reward": 0.5, "reward_std": 0.3, "completions/mean_length": 23.1, "kl": 0.0,
     "clip_ratio/region_mean": 0.0, "step_time": 6.1, "learning_rate": 1e-6, "epoch": 0.1},
    {"loss": 0.002, "reward": float("nan"), "reward_std": float("inf"), "completions/mean_length": 22.0,
     "note": "not a number", "grad_norm": 1.5},
    {"loss": 0.001, "reward": 0.75, "entropy": 0.4, "vespo/phi_seq_mean": 0.97},
]


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    return TrainingArguments(output_dir=str(tmp_path_factory.mktemp("out")), report_to="none")


def _drive(cb, args, logs_list, *, start_step=0, max_steps=10, world_zero=True):
    state = TrainerState(global_step=start_step, max_steps=max_steps, is_world_process_zero=world_zero)
    control = TrainerControl()
    cb.on_train_begin(args, state, control)
    for logs in logs_list:
        state.global_step += 1
        state.epoch = state.global_step / max_steps
        cb.on_step_end(args, state, control)
        cb.on_log(args, state, control, logs=dict(logs))
    cb.on_train_end(args, state, control)
    return state


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------------- metrics.jsonl
def test_metrics_jsonl_lines_nan_and_resume(tmp_path, args):
    cb = MetricsJsonlCallback(tmp_path)
    _drive(cb, args, LOGS)
    path = tmp_path / "metrics.jsonl"
    recs = _lines(path)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all({"step", "epoch", "time"} <= set(r) for r in recs)
    assert recs[0]["reward"] == 0.5 and recs[0]["completions/mean_length"] == 23.1
    assert recs[0]["epoch"] == pytest.approx(0.1)
    assert recs[1]["reward"] is None and recs[1]["reward_std"] is None  # NaN / inf -> null
    assert "note" not in recs[1] and recs[1]["grad_norm"] == 1.5
    assert all(r["time"] >= 0 for r in recs)
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()

    # resume from a checkpoint at step 2: a new callback appends instead of truncating
    cb2 = MetricsJsonlCallback(tmp_path)
    _drive(cb2, args, [{"reward": 0.9}, {"reward": 1.0}], start_step=2)
    recs = _lines(path)
    assert [r["step"] for r in recs] == [1, 2, 3, 3, 4]
    assert recs[3]["time"] >= recs[1]["time"]  # clock continues from the resumed step
    merged = read_metrics(path)  # the abandoned step 3 is replaced by the resumed one
    assert [r["step"] for r in merged] == [1, 2, 3, 4]
    assert merged[2]["reward"] == 0.9 and "entropy" not in merged[2]


def test_metrics_jsonl_only_main_process_and_numpy_like(tmp_path, args):
    torch = pytest.importorskip("torch")
    _drive(MetricsJsonlCallback(tmp_path), args, LOGS, world_zero=False)
    assert not (tmp_path / "metrics.jsonl").exists()
    cb = MetricsJsonlCallback(tmp_path / "sub")  # directory is created on demand
    _drive(cb, args, [{"reward": torch.tensor(0.25), "n": 3, "flag": True}])
    rec = _lines(tmp_path / "sub" / "metrics.jsonl")[0]
    assert rec["reward"] == 0.25 and rec["n"] == 3 and rec["flag"] == 1.0


# ----------------------------------------------------------------------------------------- progress
def test_progress_quiet_prints_one_line_per_log(capsys, args):
    _drive(ProgressCallback(quiet=True), args, LOGS, max_steps=95)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == len(LOGS)
    first = out[0]
    assert first.startswith("step 1/95 | reward 0.500 ± 0.30 | len 23.1 | loss -0.0012 | kl 0.000 | clip 0.00")
    assert "6.1 s/step" in first and "ETA" in first
    assert "reward" not in out[1]  # NaN reward is not shown
    assert "phi 0.970" in out[2] and "entropy 0.400" in out[2]
    assert "kl" not in out[2] and "clip" not in out[2]


def test_progress_non_tty_has_no_bar_and_summary_line(capsys, args):
    cb = ProgressCallback()  # capsys stdout is not a TTY -> lines only
    state = TrainerState(max_steps=2)
    control = TrainerControl()
    cb.on_train_begin(args, state, control)
    assert cb._progress is None
    state.global_step = 2
    cb.on_log(args, state, control, logs={"train_runtime": 125.0, "train_loss": 0.01})
    cb.on_log(args, state, control, logs={"eval_reward": 0.5, "eval_accuracy": 0.25})
    cb.on_train_end(args, state, control)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("done: 2 steps in 2m05s") and "eval @ step 2" in out[1]


def test_progress_bar_on_tty(monkeypatch, args):
    import grpokit.callbacks.progress as cbmod

    monkeypatch.setattr(cbmod, "_stdout_is_tty", lambda: True)
    cb = ProgressCallback()
    state = TrainerState(max_steps=3)
    control = TrainerControl()
    cb.on_train_begin(args, state, control)
    assert cb._progress is not None
    state.global_step = 1
    cb.on_step_end(args, state, control)
    cb.on_log(args, state, control, logs={"reward": 0.5, "completions/mean_length": 12.0})
    task = cb._progress.tasks[0]
    assert task.completed == 1 and task.fields["reward"] == "0.500" and task.fields["length"] == "12.0"
    cb.on_train_end(args, state, control)
    assert cb._progress is None


# -------------------------------------------------------------------------------------------- plots
def _write_metrics(path, n, keys=("reward", "reward_std")):
    with open(path, "w") as f:
        for s in range(1, n + 1):
            f.write(json.dumps({"step": s, "time": s * 1.0, **{k: 0.1 * s for k in keys}}) + "\n")


def test_make_plots_expected_files_and_skips(tmp_path):
    m = tmp_path / "metrics.jsonl"
    keys = ("reward", "reward_std", "rewards/acc/mean", "completions/mean_length", "completions/min_length",
            "completions/max_length", "clip_ratio/region_mean", "vespo/phi_seq_mean", "entropy", "step_time")
    _write_metrics(m, 40, keys)
    with open(m, "a") as f:
        f.write('{"step": 41, "reward": null}\n{"step": 42, "rew')  # null and a torn last line
    paths = make_plots(m, tmp_path / "plots")
    names = sorted(p.name for p in paths)
    assert names == sorted(["reward.png", "completion_length.png", "clipping.png", "entropy.png", "step_time.png"])
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    assert not (tmp_path / "plots" / "kl.png").exists()


def test_make_plots_empty_one_line_missing(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert make_plots(empty, tmp_path / "a") == []
    assert make_plots(tmp_path / "missing.jsonl", tmp_path / "b") == []
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"step": 1, "kl": 0.01}) + "\n")
    assert [p.name for p in make_plots(one, tmp_path / "c")] == ["kl.png"]
    nothing = tmp_path / "nothing.jsonl"
    nothing.write_text(json.dumps({"step": 1, "loss": 0.1}) + "\n")
    assert make_plots(nothing, tmp_path / "d") == []


# ------------------------------------------------------------------------------------ intervals
def test_wilson_interval_hand_values():
    # closed form at the boundaries: upper = z^2 / (n + z^2)
    assert wilson_interval(0, 128) == (0.0, pytest.approx(3.8416 / 131.8416))
    lo, hi = wilson_interval(0, 128)
    assert hi == pytest.approx(0.029138, abs=1e-6)
    lo, hi = wilson_interval(64, 128)
    assert lo == pytest.approx(0.414651, abs=1e-6) and hi == pytest.approx(0.585349, abs=1e-6)
    lo, hi = wilson_interval(128, 128)
    assert lo == pytest.approx(0.970862, abs=1e-6) and hi == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_mean_ci95():
    lo, hi = mean_ci95([1.0, 2.0, 3.0, 4.0])  # mean 2.5, s = 1.290994
    assert lo == pytest.approx(2.5 - 1.96 * 1.290994 / 2, abs=1e-6)
    assert hi == pytest.approx(2.5 + 1.96 * 1.290994 / 2, abs=1e-6)
    assert mean_ci95([0.7]) == (0.7, 0.7)
    assert all(math.isnan(v) for v in mean_ci95([]))
    assert mean_ci95([1.0, float("nan"), 1.0]) == (1.0, 1.0)


# --------------------------------------------------------------------------------------- report
def test_write_report(tmp_path):
    _write_metrics(tmp_path / "metrics.jsonl", 5, ("reward", "reward_std", "kl", "loss"))
    before = {"reward_mean": 0.31, "accuracy": 0.25, "accuracy_ci95": [0.18, 0.33], "n": 128, "format_rate": 0.5}
    after = {"reward_mean": 0.62, "accuracy": 0.5, "n": 128, "format_rate": 0.9}  # CI computed (Wilson)
    samples = [{"prompt": "What is 2+3?\nAnswer:", "completion": "<think>a | b</think>\n" + "x" * 500,
                "reward": 1.0, "answer": "5"}]
    md_path = write_report(tmp_path, config={"model": "HuggingFaceTB/SmolLM2-135M", "loss_type": "dapo",
                                             "learning_rate": 1e-6, "max_steps": 95, "path": tmp_path},
                           eval_before=before, eval_after=after, samples_before=samples,
                           samples_after=samples, wall_time_s=600.5, train_time_s=500.0, extra={"x": float("nan")})
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report) == {"config", "eval_before", "eval_after", "improvement", "wall_time_s", "train_time_s",
                           "plots", "final_metrics", "extra", "held_out_accuracy"}
    assert report["held_out_accuracy"] == [{"step": 0, "accuracy": 0.25, "ci95": [0.18, 0.33]}]  # no step for after
    imp = report["improvement"]
    assert imp["reward_mean"] == pytest.approx(0.31) and imp["accuracy"] == pytest.approx(0.25)
    assert imp["accuracy_significant"] is True  # Wilson(64/128).lo = 0.4147 > 0.33
    assert sorted(report["plots"]) == ["kl.png", "reward.png"]
    assert report["final_metrics"]["reward"] == pytest.approx(0.5) and report["final_metrics"]["step"] == 5
    assert report["extra"] == {"x": None} and report["config"]["path"] == str(tmp_path)

    md = md_path.read_text()
    assert md_path.name == "report.md" and md.startswith("# ")
    assert "![](reward.png)" in md and "![](kl.png)" in md and "![](entropy.png)" not in md
    assert "ci95 [0.180, 0.330]" in md and "ci95 [0.415, 0.585]" in md
    assert "| loss_type | dapo |" in md and "| steps | 95 |" in md and "| learning_rate | 1e-06 |" in md
    assert "&lt;think&gt;a \\| b&lt;/think&gt;<br>" in md and "What is 2+3?<br>Answer:" in md
    sample_rows = [line for line in md.splitlines() if line.startswith("| 1 |")]
    assert len(sample_rows) == 2 and all(len(r) < 400 for r in sample_rows)
    assert not list(tmp_path.glob(".*tmp*"))  # atomic writes leave no temp files


def test_report_without_eval_or_metrics(tmp_path):
    md_path = write_report(tmp_path, config={}, eval_before=None, eval_after=None, samples_before=None,
                           samples_after=None, wall_time_s=1.0)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["improvement"] is None and report["plots"] == [] and report["final_metrics"] == {}
    assert "No evaluation" in md_path.read_text()


def test_improvement_not_significant_and_md_escape():
    b = {"reward_mean": 0.3, "accuracy": 0.25, "accuracy_ci95": [0.18, 0.33], "n": 128}
    a = {"reward_mean": 0.35, "accuracy": 0.3, "accuracy_ci95": [0.22, 0.38], "n": 128}
    assert compute_improvement(b, a)["accuracy_significant"] is False
    assert md_escape("a|b\nc", limit=None) == "a\\|b<br>c"
    assert len(md_escape("y" * 1000)) <= 200


def test_log_completions_table():
    from rich.console import Console

    console = Console(record=True, width=120)
    table = log_completions_table(["p [bold]x[/bold]"] * 10, [f"completion {i} | ok" for i in range(10)],
                                  {"accuracy": [1.0] * 10, "format": [0.5] * 10}, [0.1 * i for i in range(10)],
                                  step=7, max_rows=3, console=console)
    text = console.export_text()
    assert table.row_count == 3 and "step 7" in text and "[bold]x[/bold]" in text
    assert "accuracy" in text and "advantage" in text and "0.20" in text


def test_held_out_points_order_before_during_after():
    from grpokit.reporting.report import held_out_points

    records = [{"step": 1, "reward": 0.1}, {"step": 4, "heldout/accuracy": 0.5, "heldout/accuracy_ci_low": 0.4,
                                             "heldout/accuracy_ci_high": 0.6},
               {"step": 2, "heldout/accuracy": 0.25, "heldout/accuracy_ci_low": 0.2, "heldout/accuracy_ci_high": 0.3}]
    before = {"accuracy": 0.0, "accuracy_ci95": [0.0, 0.1]}
    after = {"accuracy": 0.75, "accuracy_ci95": [0.6, 0.9]}
    assert held_out_points(records, before, after, 6) == [(0, 0.0, 0.0, 0.1), (2, 0.25, 0.2, 0.3),
                                                          (4, 0.5, 0.4, 0.6), (6, 0.75, 0.6, 0.9)]
    assert held_out_points(records) == [(2, 0.25, 0.2, 0.3), (4, 0.5, 0.4, 0.6)]
    assert held_out_points([], {"accuracy": None}, after, None) == []  # no accuracy, no step for after
    lo, hi = held_out_points([], None, {"accuracy": 0.5, "n": 128}, 3)[0][2:]  # no interval given: Wilson's
    assert lo == pytest.approx(0.4147, abs=1e-4) and hi == pytest.approx(0.5853, abs=1e-4)


def test_example_lines_pair_before_and_after():
    from grpokit.run.job import example_lines

    before = [{"prompt": "What is 1 + 1?", "completion": "Well,\nlet me think " + "x" * 100, "answer": "2",
               "correct": False}] * 4
    after = [{"prompt": "What is 1 + 1?", "completion": "Answer: 2", "answer": "2", "correct": True}] * 4
    lines = example_lines(before, after)
    assert lines[0] == "examples (held-out questions):" and len(lines) == 1 + 3 * 3
    assert example_lines(before, after, judge="correctness")[0] == (
        "examples (held-out questions; right or wrong as the 'correctness' reward scores them):")
    assert lines[1] == "  What is 1 + 1?  [answer 2]"
    assert lines[2].startswith("    before  wrong  Well, let me think xxx") and lines[2].endswith("…")
    assert len(lines[2]) == len("    before  wrong  ") + 72
    assert lines[3] == "    after   right  Answer: 2"
    assert example_lines(None, after) == [] and example_lines(before, []) == []
