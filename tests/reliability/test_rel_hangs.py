"""Nothing hangs (one process; tests/distributed/test_hangs_two_ranks.py has two): a reward function, a judge, a tool,
an environment's reset / tool method / get_reward and a rollout_func that never return, synchronous and asynchronous
(max_staleness=1). Each is abandoned at its bound, counted and named; rewards give None or a stop, as the config
says; tools become a message to the model; a busy environment is replaced. Tool results and observations are cut.
The watchdog names the stuck stage and saves a checkpoint.

Every hanging function is a tests/hang.py Hang, released when its test ends: a bound that never fires fails the test
after HANG_GUARD_S instead of hanging the suite."""

from __future__ import annotations

import asyncio
import logging
import math
import threading

import pytest
from datasets import Dataset
from hang import Hang
from reliability_helpers import make_args, make_trainer, varied_reward
from scripted_tools import ScriptedBackend, tokenizer
from tiny import tiny_model

from grpokit.bounds.user_calls import STOPPING, CallBounds, CallTimeout, Incidents, RunStopped
from grpokit.rewards import RewardFunctionError, score_completions
from grpokit.run.checkpoints import verify_checkpoint
from grpokit.trainer import GRPOTrainer

BOUND = 0.5  # seconds: every bound in these runs (user code that returns takes microseconds here)
HANGS: dict[str, Hang] = {}


@pytest.fixture(autouse=True)
def hangs():
    """Fresh hanging functions for each test, released when it ends (their abandoned threads then finish)."""
    HANGS.clear()
    HANGS.update({name: Hang(result=1.0, name=name) for name in ("reset", "poke", "get_reward", "wait_for_it")})
    yield HANGS
    for h in HANGS.values():
        h.release()


def wait_for_it(seconds: int) -> str:
    """Wait for something that never comes.

    Args:
        seconds: how long to wait
    """
    HANGS["wait_for_it"]()
    return "came"


class Flaky:
    """An environment whose row says which of its calls hangs: ``mode`` is ok, reset_hangs, poke_hangs or
    reward_hangs."""

    made = 0

    def __init__(self):
        Flaky.made += 1

    def reset(self, **row):
        self.mode = row["mode"]
        if self.mode == "reset_hangs":
            HANGS["reset"]()
        return " Begin."

    def poke(self) -> str:
        """Poke the environment."""
        if self.mode == "poke_hangs":
            HANGS["poke"]()
        return "poked"

    def get_reward(self) -> float:
        if self.mode == "reward_hangs":
            HANGS["get_reward"]()
        return 1.0


MODES = ["ok", "reset_hangs", "poke_hangs", "reward_hangs"]
POKE = '<tool_call>{"name": "poke", "arguments": {}}</tool_call>'
WAIT = '<tool_call>{"name": "wait_for_it", "arguments": {"seconds": 5}}</tool_call>'


def agent_trainer(tmp_path, reward_funcs, **kw):
    """Four prompts × two completions a step, one per mode (in order); even rows poke their environment, odd rows
    call wait_for_it; then every reply answers."""
    tok = tokenizer()
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Go {i}."}] for i in range(8)],
                            "mode": MODES * 2})
    args = make_args(tmp_path / "out", per_device_train_batch_size=8, num_generations=2, max_completion_length=400,
                     shuffle_dataset=False, reward_timeout_s=BOUND, tool_timeout_s=BOUND, **kw)
    backend = ScriptedBackend(tok, first=lambda i: POKE if i % 2 == 0 else WAIT)
    return GRPOTrainer(tiny_model(tok, max_positions=2048), reward_funcs, args=args, train_dataset=ds,
                       processing_class=tok, tools=[wait_for_it], environment_factory=Flaky, rollout_backend=backend)


def record_batches(trainer) -> list:
    seen = []
    finish = trainer.pipeline.finish

    def spy(s, *a, **kw):
        seen.append(s)
        return finish(s, *a, **kw)

    trainer.pipeline.finish = spy
    return seen


@pytest.mark.parametrize("staleness", [0, 1], ids=["sync", "async"])
def test_hanging_rewards_tools_and_environments_are_abandoned_counted_and_named(tmp_path, caplog, staleness):
    judge = Hang(result=None, name="stuck_judge")
    HANGS["judge"] = judge
    Flaky.made = 0
    steps = 1 if staleness else 2  # two batches show the pool's fresh instances; the producer's one its thread
    trainer = agent_trainer(tmp_path, [varied_reward, judge], max_staleness=staleness, max_steps=steps)
    batches = record_batches(trainer)
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        trainer.train()
    assert trainer.state.global_step == steps and len(batches) == steps
    nan = math.nan
    for s in batches:  # columns: varied_reward, stuck_judge, Flaky (the environments' get_reward)
        assert s.rewards[:, 1].isnan().all()  # the judge timed out: None for every row
        env = s.rewards[:, 2].tolist()
        assert [x if x == x else nan for x in env] == pytest.approx([1, 1, nan, nan, nan, 1, nan, nan], nan_ok=True)
        messages = [[m["content"] for m in c if m["role"] == "tool"] for c in s.completions]
        assert messages[0] == ["poked"]
        assert messages[4] == [str({"error": f"tool 'poke' did not return within {BOUND:g} s"})]
        assert "was not called: an earlier call on the same Flaky timed out" in messages[2][0]  # its reset hung
        assert all(m == [str({"error": f"tool 'wait_for_it' did not return within {BOUND:g} s"})]
                   for m in messages[1::2])
        assert "Begin." in s.prompt_texts[0] and "Begin." not in s.prompt_texts[2]  # no observation after a hung reset
    logs = [h for h in trainer.state.log_history if "reward" in h]
    for log in logs:
        assert log["rewards/stuck_judge/timeout_total"] == 1 and "rewards/stuck_judge/mean" not in log
        assert log["rewards/Flaky/timeout_total"] == 5  # 2 hung get_reward, 3 refused on busy environments
        assert log["tools/reset/timeout_total"] == 2 and log["tools/poke/timeout_total"] == 2
        assert log["tools/wait_for_it/timeout_total"] == 4 and log["tools/timeout_total"] == 8
        assert log["tools/failure_frequency"] == pytest.approx(6 / 8)
    produced = HANGS["reset"].calls // 2  # asynchronous rollouts may make one batch more before they are closed
    assert produced == steps or (staleness and produced == steps + 1)
    assert Flaky.made == 1 + 7 + 5 * (produced - 1)  # the probe, the first batch's others, then 5 fresh ones a batch
    text = caplog.text
    assert (f"reward function 'stuck_judge' did not return within {BOUND:g} s on the batch of 8 completions (rows 0-7; "
            "first prompt 'Go 0.") in text and "it counts as None there (reward_timeout_action='none'); the call is" in text
    assert f"Flaky.reset() did not return within {BOUND:g} s on row 2 of 8" in text
    assert f"Flaky.get_reward() did not return within {BOUND:g} s on row 6 of 8" in text
    assert f"tool 'wait_for_it' did not return within {BOUND:g} s (row 1)" in text


def score(funcs, bounds, **call_kwargs):
    n = 4
    incidents = Incidents()
    rewards = score_completions(funcs, [None] * len(funcs), prompts=[f"Q{i}" for i in range(n)],
                                completions=[f"A{i}" for i in range(n)], completion_ids=[[1]] * n,
                                rows=[{"prompt": f"Q{i}"} for i in range(n)], bounds=bounds, incidents=incidents,
                                **call_kwargs)
    return rewards, incidents


def test_async_judges_are_cancelled_at_their_bound_while_the_others_score():
    cancelled = threading.Event()

    async def remote_judge(completions, **kw):  # an endpoint that never answers
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    async def quick_async(completions, **kw):
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    def quick(completions, **kw):
        return [2.0] * len(completions)

    rewards, incidents = score([remote_judge, quick_async, quick], CallBounds(reward_timeout_s=BOUND))
    assert rewards[:, 0].isnan().all() and rewards[:, 1].tolist() == [1.0] * 4 and rewards[:, 2].tolist() == [2.0] * 4
    assert incidents.counts == {"rewards/remote_judge/timeout_total": 1.0} and incidents.stop_cause is None
    assert cancelled.wait(60)  # cancelled, not left running


def test_an_abandoned_reward_that_returns_later_changes_nothing():
    """Its value is discarded and what it logs after its batch was scored is dropped."""
    logged, done = [], threading.Event()
    stuck = HANGS["judge"] = Hang(result=None, name="late")

    def late(completions, log_metric, **kw):
        stuck()
        log_metric("late/metric", 1.0)
        done.set()
        return [5.0] * len(completions)

    rewards, incidents = score([late], CallBounds(reward_timeout_s=BOUND),
                               log_metric=lambda name, value: logged.append(name))
    assert rewards.isnan().all() and incidents.counts == {"rewards/late/timeout_total": 1.0}
    stuck.release()
    assert done.wait(60) and logged == []


def test_once_a_run_is_stopping_no_user_code_is_called_and_the_batch_carries_the_stop():
    called = []

    def reward(completions, **kw):
        called.append(1)
        return [1.0] * len(completions)

    bounds = CallBounds()
    bounds.stop()
    rewards, incidents = score([reward], bounds)
    assert called == [] and rewards.isnan().all() and incidents.stop_cause == STOPPING  # never silently unscored
    bounds.clear_stop()  # what each train() starts with
    rewards, incidents = score([reward], bounds)
    assert called == [1] and rewards.tolist() == [[1.0]] * 4 and incidents.stop_cause is None


def test_a_raising_reward_whose_rows_hang_alone_is_still_named():
    def fussy(completions, **kw):
        if len(completions) > 1:
            raise ValueError("only one at a time")
        HANGS["get_reward"]()

    with pytest.raises(RewardFunctionError) as e:
        score([fussy], CallBounds(reward_timeout_s=BOUND))
    assert str(e.value) == (f"reward function 'fussy' raised ValueError: only one at a time on the batch of 4 "
                            f"completions (row 0 alone did not return within {BOUND:g} s)")


def stuck_rollout(prompts, trainer):
    HANGS["reset"]()  # any Hang: never released while the run lasts


@pytest.mark.parametrize("staleness,what", [(0, "reward"), (1, "reward"), (0, "rollout_func"), (1, "rollout_func")],
                         ids=["sync-reward", "async-reward", "sync-rollout_func", "async-rollout_func"])
def test_a_timeout_that_must_stop_the_run_stops_it_with_the_cause(tmp_path, staleness, what):
    judge = Hang(result=None, name="stuck_judge")
    HANGS["judge"] = judge
    kw = dict(max_staleness=staleness, reward_timeout_s=BOUND)
    if what == "reward":
        trainer = make_trainer(tmp_path / "out", reward=[varied_reward, judge], reward_timeout_action="stop", **kw)
    else:
        tok = tokenizer()
        trainer = GRPOTrainer(tiny_model(tok), varied_reward, args=make_args(tmp_path / "out", **kw),
                              train_dataset=Dataset.from_dict({"prompt": [f"Say {i}." for i in range(8)]}),
                              processing_class=tok, rollout_func=stuck_rollout)
    with pytest.raises(RunStopped) as e:
        trainer.train()
    if what == "reward":
        assert str(e.value).startswith(f"the run stopped: reward function 'stuck_judge' did not return within "
                                       f"{BOUND:g} s on the batch of 4 completions (rows 0-3; first prompt")
        assert str(e.value).endswith("(reward_timeout_action='stop')")
        assert judge.calls == 1  # once stopping, no more user code is called
    else:
        assert str(e.value) == (f"the run stopped: rollout_func did not return within {BOUND:g} s on 4 prompts; a "
                                "rollout_func that times out stops the run (nothing to train on)")
        assert HANGS["reset"].calls == 1
    assert trainer.state.global_step == 0


def chatty_dump(what: str) -> str:
    """Print a lot.

    Args:
        what: what to print
    """
    return "x" * 10_000_000


class Chatty:
    def reset(self, **row):
        return " " + "y" * 100_000


def test_long_tool_results_and_observations_are_cut_and_the_budget_holds(tmp_path):
    tok = tokenizer()
    call = '<tool_call>{"name": "chatty_dump", "arguments": {"what": "all"}}</tool_call>'
    args = make_args(tmp_path / "out", max_completion_length=300, max_steps=1, max_tool_result_chars=50)
    trainer = GRPOTrainer(tiny_model(tok, max_positions=4096), varied_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Go {i}."}]
                                                                      for i in range(4)]}),
                          processing_class=tok, tools=[chatty_dump], environment_factory=Chatty,
                          rollout_backend=ScriptedBackend(tok, first=lambda i: call))
    batches = record_batches(trainer)
    trainer.train()
    s = batches[0]
    marker = "[... cut by grpokit: 10,000,000 characters, the first 50 shown]"
    assert all(c[1]["content"] == "x" * 50 + "\n" + marker for c in s.completions)
    assert " " + "y" * 49 + "\n[... cut by grpokit: 100,001 characters, the first 50 shown]" in s.prompt_texts[0]
    assert "y" * 50 not in s.prompt_texts[0]
    assert s.generation.completion_mask.sum(1).max() <= 300  # the whole completion stays within the budget
    log = [h for h in trainer.state.log_history if "reward" in h][0]
    assert log["tools/truncated_total"] == 8  # 4 observations, 4 results
    assert math.isfinite(log["loss"])


def snapshot(what: str):
    """Take a picture.

    Args:
        what: what to show
    """
    from PIL import Image

    return [{"type": "text", "text": f"a picture of {what}:"}, {"type": "image", "image": Image.new("RGB", (4, 4))}]


class Camera:
    def reset(self, **row):
        from PIL import Image

        return Image.new("RGB", (4, 4))


def test_images_from_tools_and_environments_are_replaced_by_a_marker_counted_and_said_once(tmp_path, caplog):
    """A tool or an environment's reset that returns an image, on a text model: the model reads a marker in its place
    (never a crash, never a silent drop), each is counted, and one warning per tool names it and says what to do."""
    from grpokit.tools.execution import IMAGE_MARKER, _told_about_images

    _told_about_images.clear()
    tok = tokenizer()
    call = '<tool_call>{"name": "snapshot", "arguments": {"what": "a cat"}}</tool_call>'
    trainer = GRPOTrainer(tiny_model(tok, max_positions=4096), varied_reward, args=make_args(
        tmp_path / "out", max_completion_length=400, max_steps=2), train_dataset=Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Go {i}."}] for i in range(8)]}), processing_class=tok,
        tools=[snapshot], environment_factory=Camera, rollout_backend=ScriptedBackend(tok, first=lambda i: call))
    batches = record_batches(trainer)
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        trainer.train()
    s = batches[0]
    assert all(c[1]["content"] == f"a picture of a cat:\n{IMAGE_MARKER}" for c in s.completions)
    assert all(IMAGE_MARKER in text for text in s.prompt_texts)  # reset's observation
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert [h["tools/images_dropped_total"] for h in logs] == [8, 8]  # 4 observations and 4 results a step
    assert all(h["tools/failure_frequency"] == 0 for h in logs)
    told = [r.getMessage() for r in caplog.records if "returned an image" in r.getMessage()]
    assert len(told) == 2 and {m.split(" returned")[0] for m in told} == {"grpokit: tool 'snapshot'",
                                                                           "grpokit: Camera.reset()"}
    assert "not supported yet" in told[0] and "Return text" in told[0]


def test_the_watchdog_names_the_stuck_stage_and_saves_a_checkpoint(tmp_path):
    """With every bound off, a reward that hangs at step 2: the watchdog reports where the run is stuck, saves
    checkpoint-1 from its own thread and ends the process (here a stand-in exit that records the status and lets the
    reward return; tests/cli has the real exit)."""
    stuck = Hang(result=lambda completions, **kw: [0.0] * len(completions), name="slow_judge")
    HANGS["judge"] = stuck

    def slow_judge(completions, **kw):
        return stuck(completions) if kw["trainer_state"].global_step == 1 else [0.0] * len(completions)

    trainer = make_trainer(tmp_path / "out", reward=[varied_reward, slow_judge], reward_timeout_s=None,
                           stall_timeout_s=0.5, stall_action="save_and_exit", max_steps=2)
    exits = []

    def stand_in_exit(code):  # on a very slow machine an earlier, genuine stall may come first: only this one releases
        exits.append(code)
        if "scoring (function 'slow_judge')" in trainer.stall_watchdog.reports[-2]:
            stuck.release()

    trainer.stall_watchdog.exit = stand_in_exit
    trainer.train()
    assert exits[-1] == 124 and trainer.state.global_step == 2
    report, outcome = trainer.stall_watchdog.reports[-2:]
    assert report.startswith("grpokit: no progress for ") and "(stall_timeout_s=0.5) at step 1, rank 0 of 1: " in report
    assert "MainThread: scoring (function 'slow_judge') for " in report
    assert outcome == (f"grpokit: checkpoint saved to {tmp_path / 'out'}/checkpoint-1; continue with --resume (Python: "
                       "resume_from_checkpoint='auto'); exiting with status 124 (stall_action='save_and_exit')")
    assert verify_checkpoint(tmp_path / "out" / "checkpoint-1") == 1
    assert trainer.stall_watchdog.dog is None  # stopped with training


SLOW_REWARDS = '''import time


def slow(completions, trainer_state, **kw):
    """Hangs at the second step (and at every step after a resume at 1)."""
    if trainer_state.global_step >= 1:
        time.sleep(10 ** 6)
    return [0.0] * len(completions)
'''


@pytest.mark.slow
def test_cli_the_watchdog_saves_exits_124_and_the_run_resumes(tmp_path, tiny_dir):
    """The real exit, through ``grpokit train``: a reward that hangs with every bound off; the watchdog reports,
    saves checkpoint-1 and ends the process with 124; ``--resume`` with a reward bound then finishes the run."""
    import subprocess
    import sys

    import yaml
    from hang import HANG_S

    (tmp_path / "slow_rewards.py").write_text(SLOW_REWARDS)
    out = tmp_path / "out"
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": str(tiny_dir), "task": "arithmetic", "reward_funcs": ["correctness", "slow_rewards:slow"],
        "output_dir": str(out), "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 6,
        "max_steps": 3, "logging_steps": 1, "save_strategy": "no", "report_to": "none", "use_cpu": True,
        "gradient_checkpointing": False, "eval": {"before": False, "after": False}, "reward_timeout_s": None,
        "stall_timeout_s": 3, "stall_action": "save_and_exit"}))

    def train(*flags):
        return subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(cfg), "--quiet", *flags],
                              cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)

    r = train()
    assert r.returncode == 124, r.stderr[-3000:]
    assert "at step 1, rank 0 of 1: MainThread: scoring (function 'slow') for " in r.stderr
    assert f"grpokit: checkpoint saved to {out}/checkpoint-1; continue with --resume" in r.stderr
    assert verify_checkpoint(out / "checkpoint-1") == 1
    r = train("--resume", "--set", "reward_timeout_s=1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "reward function 'slow' did not return within 1 s" in r.stderr
    assert (out / "final").is_dir()


def test_the_watchdog_only_reports_when_asked_to_and_the_run_goes_on(tmp_path):
    stuck = Hang(result=lambda completions, **kw: [0.0] * len(completions), name="slow_judge")
    HANGS["judge"] = stuck
    trainer = make_trainer(tmp_path / "out", reward=[varied_reward, stuck], reward_timeout_s=None,
                           stall_timeout_s=0.3, max_steps=1)  # stall_action: "report", the default
    trainer.stall_watchdog.exit = lambda code: pytest.fail(f"the watchdog exited ({code}) though only asked to report")

    def release_after_a_report():
        while not any("scoring (function 'slow_judge')" in r for r in trainer.stall_watchdog.reports):
            if stuck._released.wait(0.05):
                return
        stuck.release()

    helper = threading.Thread(target=release_after_a_report, daemon=True)
    helper.start()
    trainer.train()
    helper.join(60)
    assert trainer.state.global_step == 1
    assert any("rank 0 of 1: MainThread: scoring (function 'slow_judge')" in r for r in trainer.stall_watchdog.reports)
    assert not any("exiting" in r or "checkpoint" in r for r in trainer.stall_watchdog.reports)
    assert not (tmp_path / "out" / "checkpoint-0").exists()


def test_an_environment_factory_that_hangs_ends_the_run_with_its_name(tmp_path):
    """Making an environment is bounded too (the pool grows during the first batch): one that never returns is an
    error naming it, not a frozen run."""

    class Sticky:
        made = 0

        def __init__(self):
            Sticky.made += 1
            if Sticky.made > 1:  # the trainer's probe is made at construction; the pool's next one hangs
                HANGS["reset"]()

        def reset(self, **row):
            return None

        def get_reward(self) -> float:
            return 1.0

    tok = tokenizer()
    trainer = GRPOTrainer(tiny_model(tok), None, args=make_args(tmp_path / "out", tool_timeout_s=BOUND),
                          train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "Go."}]] * 8}),
                          processing_class=tok, environment_factory=Sticky)
    with pytest.raises(CallTimeout, match=f"^environment_factory did not return within {BOUND:g} s$"):
        trainer.train()


def test_cli_a_stop_is_one_line_and_status_1(tmp_path, tiny_dir, capsys):
    import yaml

    from grpokit.cli import main

    (tmp_path / "sleepy_rewards.py").write_text(
        "import time\n\n\ndef sleepy(completions, **kw):\n    time.sleep(30)\n    return [0.0] * len(completions)\n")
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": str(tiny_dir), "task": "arithmetic", "reward_funcs": ["correctness", "sleepy_rewards:sleepy"],
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "num_generations": 4,
        "max_completion_length": 6, "max_steps": 2, "save_strategy": "no", "report_to": "none", "use_cpu": True,
        "gradient_checkpointing": False, "eval": {"before": False, "after": False}, "reward_timeout_s": BOUND,
        "reward_timeout_action": "stop"}))
    capsys.readouterr()
    assert main(["train", str(cfg), "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    err = captured.err.strip().splitlines()[-1]  # after the warning that said it when it happened
    assert err.startswith(f"grpokit: error: the run stopped: reward function 'sleepy' did not return within {BOUND:g} "
                          "s on the batch of 4 completions (rows 0-3; first prompt")
    assert err.endswith("(reward_timeout_action='stop')")


def test_a_reward_model_that_hangs_is_abandoned_at_the_reward_bound_counted_and_named(tmp_path, caplog):
    """A reward model (a sequence-classification checkpoint) runs under ``reward_timeout_s`` as a reward function
    does: its forward hangs at the first step, its rows count as unscored there, the run trains on; a second step
    scores normally. Through the trainer."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    reward_model = Qwen2ForSequenceClassification(cfg)
    stuck, forward = Hang(name="forward"), reward_model.forward
    HANGS["reward_model"] = stuck

    def hangs_once(*args, **kw):
        if stuck.calls == 0:
            stuck()
        return forward(*args, **kw)

    reward_model.forward = hangs_once
    trainer = GRPOTrainer(tiny_model(tok), [varied_reward, reward_model], args=make_args(
        tmp_path / "out", reward_timeout_s=BOUND, max_steps=2), train_dataset=Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Go {i}."}] for i in range(8)]}), processing_class=tok,
        reward_processing_classes=[None, tok])
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        trainer.train()
    stuck.release()
    name = trainer.reward_func_names[1]
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert trainer.state.global_step == 2
    assert logs[0][f"rewards/{name}/timeout_total"] == 1.0 and f"rewards/{name}/mean" not in logs[0]  # unscored
    assert math.isfinite(logs[1][f"rewards/{name}/mean"])
    assert f"reward model {name!r} did not return within {BOUND:g} s on the batch of" in caplog.text
