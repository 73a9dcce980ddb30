"""The shape of a job spec (a YAML file's contents), checked without importing torch or transformers: unknown keys
(with a suggestion), the job's own keys and their types. A mistake here is reported in a fraction of a second;
``grpokit.run.job`` then checks the values of the ``GRPOConfig`` fields, which needs transformers."""

from __future__ import annotations

import difflib
import math
from typing import Any

from ..validation import Checker, refusal, short_repr

JOB_KEYS = {
    "model": "model id, local directory, .gguf file, or smollm2-135m-instruct (the embedded model)",
    "task": "a built-in task name (see `grpokit tasks`)",
    "dataset": "a local JSONL/Parquet/CSV file with prompt and answer columns",
    "reward_funcs": "built-in reward names, module:function, or {LLMJudge|CodeExecution|RemoteRewardModel: {options}} "
                    "(default: the task's)",
    "tools": "functions the model may call, as module:function or file.py:function (added to the task's)",
    "environment": "one environment per rollout: module:Class, or a mapping of names to them (an 'environment' column "
                   "picks one per row)",
    "chat_template": "a Jinja chat template file, or chatml-tools (grpokit's ChatML with tools, for SmolLM2)",
    "lora": "LoRA settings: r, alpha, dropout, target_modules (default all-linear)",
    "eval": "held-out evaluation: n (128), before (true), after (true), max_new_tokens, greedy (true; false: sampled "
            "with the config's temperature, top_k and top_p, as training samples), batch_size "
            "(32 prompts generated together), every_steps "
            "(also every this many steps during training; default none)",
    "time_budget_s": "stop training after this many seconds of training wall time",
    "finish_within_s": "end the whole job, evaluations included, within this many seconds of started_at: training "
                       "stops early enough for what comes after it",
    "started_at": "when the clock of finish_within_s started, in seconds since the epoch (default: the job's start; "
                  "make demo passes the time it was run, before installing)",
    "task_args": "extra keyword arguments for the task (e.g. seed, n_eval)",
}
LORA_KEYS = ("r", "alpha", "dropout", "target_modules")
EVAL_KEYS = ("n", "before", "after", "max_new_tokens", "greedy", "batch_size", "every_steps")


class JobError(ValueError):
    """A wrong job spec: the CLI prints it in one line and exits 2."""


class TrainingInterrupted(Exception):
    """Training stopped on SIGINT/SIGTERM after saving a checkpoint; the CLI exits with 128 + the signal number."""

    def __init__(self, signum: int, checkpoint: str | None, step: int):
        import signal

        self.signum, self.checkpoint, self.step = signum, checkpoint, step
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"interrupted by {self.signal_name} at step {step}; checkpoint: {checkpoint}")


def split_spec(spec: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate the job's keys from ``GRPOConfig`` fields (values unchecked), rejecting unknown keys with a
    suggestion, and check the job's own keys (:func:`check_job_keys`)."""
    if not isinstance(spec, dict):
        raise JobError(f"the config must be a mapping of field: value, got {type(spec).__name__}")
    from ..config_names import config_field_names

    fields = config_field_names()
    job, cfg = {}, {}
    for key, value in spec.items():
        if key in JOB_KEYS:
            job[key] = value
        elif key in fields:
            cfg[key] = value
        else:
            close = difflib.get_close_matches(str(key), sorted(fields) + list(JOB_KEYS), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise JobError(f"unknown config key {short_repr(key)}{hint} (GRPOConfig fields and: {', '.join(JOB_KEYS)})")
    check_job_keys(job)
    return job, cfg


def check_job_keys(job: dict[str, Any]) -> None:
    """The job's own keys: present where needed, of the right types, known sub-keys."""
    if "model" not in job:
        raise JobError("the config has no 'model' (e.g. model: smollm2-135m-instruct)")
    if ("task" in job) == ("dataset" in job):
        raise JobError("the config needs exactly one of 'task' (a built-in task) or 'dataset' (a local file)")
    check = Checker(job, JobError, get=dict.get)
    for key in ("model", "task", "dataset"):
        if key in job and (not isinstance(job[key], str) or not job[key].strip()):
            raise check.bad(key, f"expected {JOB_KEYS[key]}, as a string")
    for key in ("task_args", "eval"):
        if job.get(key) is not None and not isinstance(job[key], dict):
            raise check.bad(key, f"expected a mapping ({JOB_KEYS[key]})")
    if job.get("reward_funcs") is not None:  # names, module:function, {LLMJudge: {...}}: built and checked, no torch
        from ..rewards.registry import check_reward_specs

        try:
            check_reward_specs(job["reward_funcs"])
        except (ValueError, ImportError) as e:
            raise JobError(str(e)) from None
    tools = job.get("tools")
    if tools is not None and not (isinstance(tools, str) or (
            isinstance(tools, list) and all(isinstance(t, str) for t in tools))):
        raise check.bad("tools", "expected module:function or a list of them")
    env = job.get("environment")
    if env is not None and not (isinstance(env, str) or (
            isinstance(env, dict) and env and all(isinstance(v, str) for v in env.values()))):
        raise check.bad("environment", "expected module:Class or a mapping of names to them")
    template = job.get("chat_template")
    if template is not None and (not isinstance(template, str) or not template.strip()):
        raise check.bad("chat_template", "expected chatml-tools or a Jinja template file")
    if job.get("lora") is not None:
        check_lora(job["lora"])
    check_eval(job.get("eval") or {})
    for key in ("time_budget_s", "finish_within_s", "started_at"):
        value = job.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise check.bad(key, "expected a positive number of seconds")


def check_eval(ev: dict[str, Any]) -> None:
    unknown = set(ev) - set(EVAL_KEYS)
    if unknown:
        raise JobError(f"unknown eval key(s) {sorted(map(str, unknown))}; allowed: {sorted(EVAL_KEYS)}")
    check = Checker(ev, JobError, prefix="eval.", get=dict.get)
    for key, value in ev.items():
        if key == "every_steps" and value is None:
            continue
        if key in ("n", "max_new_tokens", "batch_size", "every_steps") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise check.bad(key, "expected a positive integer"
                            + (" (or null: no evaluation during training)" if key == "every_steps" else ""))
        if key in ("before", "after", "greedy"):
            check.boolean(key)


def check_lora(lora: Any) -> None:
    """The job's ``lora`` section: a mapping of known keys with values of the right type."""
    if not isinstance(lora, dict):
        raise refusal("lora", lora, "expected a mapping like {r: 16, alpha: 32}", error=JobError)
    unknown = set(lora) - set(LORA_KEYS)
    if unknown:
        raise JobError(f"unknown lora key(s) {sorted(map(str, unknown))}; allowed: {list(LORA_KEYS)}")
    check = Checker(lora, JobError, prefix="lora.", get=dict.get)
    for key in ("r", "alpha"):
        v = lora.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise check.bad(key, "expected a positive integer")
    d = lora.get("dropout")
    if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < 1):
        raise check.bad("dropout", "expected a number in [0, 1)")
    t = lora.get("target_modules")
    if t is not None and not (isinstance(t, str) or (isinstance(t, list) and t and all(isinstance(m, str) for m in t))):
        raise check.bad("target_modules", "expected 'all-linear' or a list of module names")
