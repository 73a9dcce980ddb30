"""A whole training job from one spec (a YAML file's contents or the demo's preset): validate everything before
any model is loaded, evaluate before, train, evaluate after, write the report."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import json
import logging
import time
import typing
from pathlib import Path
from typing import Any

from .config import CHOICE_FIELDS, GRPOConfig
from .files import atomic_write_text
from .reporting._util import jsonable

logger = logging.getLogger("grpokit")

JOB_KEYS = {
    "model": "model id, local directory, .gguf file, or smollm2-135m-instruct (the embedded model)",
    "task": "a built-in task name (see `grpokit tasks`)",
    "dataset": "a local JSONL/Parquet/CSV file with prompt and answer columns",
    "reward_funcs": "built-in reward names or module:function (default: the task's)",
    "tools": "functions the model may call, as module:function or file.py:function (added to the task's)",
    "environment": "one environment per rollout: module:Class, or a mapping of names to them (an 'environment' column "
                   "picks one per row)",
    "chat_template": "a Jinja chat template file, or chatml-tools (grpokit's ChatML with tools, for SmolLM2)",
    "lora": "LoRA settings: r, alpha, dropout, target_modules (default all-linear)",
    "eval": "held-out evaluation: n (128), before (true), after (true), max_new_tokens, greedy (true)",
    "time_budget_s": "stop training after this many seconds of training wall time",
    "task_args": "extra keyword arguments for the task (e.g. seed, n_eval)",
}

def algorithms() -> dict[str, dict[str, Any]]:
    """Named recipes: the GRPOConfig fields that make each algorithm (``grpokit demo --algo NAME``), from the loss
    registry (each loss describes its own)."""
    from .algorithms.losses import recipes

    return recipes()


class JobError(ValueError):
    """A wrong job spec: the CLI prints it in one line and exits 2."""


class TrainingInterrupted(Exception):
    """Training stopped on SIGINT/SIGTERM after saving a checkpoint; the CLI exits with 128 + the signal number."""

    def __init__(self, signum: int, checkpoint: str | None, step: int):
        import signal

        self.signum, self.checkpoint, self.step = signum, checkpoint, step
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"interrupted by {self.signal_name} at step {step}; checkpoint: {checkpoint}")


def config_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(GRPOConfig) if f.init}


def _type_name(field: dataclasses.Field) -> str:
    t = field.type
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def coerce_value(name: str, value: Any, field: dataclasses.Field) -> Any:
    """Check a YAML value against the field's type; numbers written as strings (YAML reads ``1e-5`` as a string)
    become numbers. Raises :class:`JobError` naming the field, the value and the expected type."""
    t = _type_name(field).replace(" ", "")
    parts = set(t.replace("Optional[", "").replace("]", "").split("|"))
    if value is None:
        if "None" in parts or field.default is None:
            return None
        raise JobError(f"{name}=None is not allowed: expected {t}")
    if "bool" in parts and isinstance(value, bool):
        return value
    if parts & {"float", "int"} and not isinstance(value, bool):
        if isinstance(value, (int, float)):
            return int(value) if parts == {"int"} and float(value).is_integer() else value
        if isinstance(value, str) and not parts & {"str"}:
            try:
                number = float(value)
            except ValueError:
                raise JobError(f"{name}={value!r} is not allowed: expected {t}") from None
            return int(number) if "float" not in parts and number.is_integer() else number
    if parts <= {"bool", "None"} and not isinstance(value, bool):
        raise JobError(f"{name}={value!r} is not allowed: expected true or false")
    if parts <= {"int", "None"} and not isinstance(value, int):
        raise JobError(f"{name}={value!r} is not allowed: expected an integer")
    if parts <= {"float", "None"} and not isinstance(value, (int, float)):
        raise JobError(f"{name}={value!r} is not allowed: expected a number")
    if parts <= {"str", "None"} and not isinstance(value, str) and name not in CHOICE_FIELDS:
        raise JobError(f"{name}={value!r} is not allowed: expected a string")  # (choices: GRPOConfig lists them)
    if any(p.startswith("dict") for p in parts) and not isinstance(value, dict) and not (
            "str" in parts and isinstance(value, str)):
        raise JobError(f"{name}={value!r} is not allowed: expected a mapping (key: value)")
    if any(p.startswith("list") for p in parts) and not isinstance(value, list) and not (
            "str" in parts and isinstance(value, str)):
        raise JobError(f"{name}={value!r} is not allowed: expected a list")
    choices = _enum_values(field)
    if choices and not (isinstance(value, str) and value in choices):
        raise JobError(f"{name}={value!r} is not allowed: use one of {', '.join(map(repr, choices))}")
    return value


def _enum_values(field: dataclasses.Field) -> list[str]:
    """The allowed values of a TrainingArguments field typed ``SomeEnum | str`` (save_strategy, optim, ...)."""
    t = field.type
    if isinstance(t, str):
        return []
    for arg in typing.get_args(t) or (t,):
        try:
            if isinstance(arg, type) and issubclass(arg, enum.Enum):
                return [str(m.value) for m in arg]
        except TypeError:  # a parametrised generic such as list[DebugOption]
            continue
    return []


def split_spec(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate job keys from GRPOConfig fields, rejecting unknown keys with a suggestion."""
    if not isinstance(spec, dict):
        raise JobError(f"the config must be a mapping of field: value, got {type(spec).__name__}")
    fields = config_fields()
    job, cfg = {}, {}
    for key, value in spec.items():
        if key in JOB_KEYS:
            job[key] = value
        elif key in fields:
            cfg[key] = coerce_value(key, value, fields[key])
        else:
            close = difflib.get_close_matches(str(key), list(fields) + list(JOB_KEYS), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise JobError(f"unknown config key {key!r}{hint} (GRPOConfig fields and: {', '.join(JOB_KEYS)})")
    if "model" not in job:
        raise JobError("the config has no 'model' (e.g. model: smollm2-135m-instruct)")
    if ("task" in job) == ("dataset" in job):
        raise JobError("the config needs exactly one of 'task' (a built-in task) or 'dataset' (a local file)")
    for key in ("model", "task", "dataset"):
        if key in job and (not isinstance(job[key], str) or not job[key].strip()):
            raise JobError(f"{key}={job[key]!r} is not allowed: expected {JOB_KEYS[key]}, as a string")
    for key in ("task_args", "eval"):
        if job.get(key) is not None and not isinstance(job[key], dict):
            raise JobError(f"{key}={job[key]!r} is not allowed: expected a mapping ({JOB_KEYS[key]})")
    names = job.get("reward_funcs")
    if names is not None and not (isinstance(names, str) or (
            isinstance(names, list) and names and all(isinstance(n, str) for n in names))):
        raise JobError(f"reward_funcs={names!r} is not allowed: expected a reward name or module:function, or a "
                       "list of them")
    return job, cfg


def prepare(spec: dict[str, Any]):
    """Everything that can fail on bad input, before a model is loaded: config, task, reward functions.
    Any such failure is a :class:`JobError`."""
    try:
        return _prepare(spec)
    except JobError:
        raise
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        raise JobError(str(e)) from None


def _prepare(spec: dict[str, Any]):
    from .rewards import check_reward_weights, get_reward_func, reward_func_name
    from .tasks import get_task
    from .tools import MultiTurn, check_tools

    job, cfg_kwargs = split_spec(spec)
    cfg_kwargs.setdefault("output_dir", "runs/grpokit")
    config = GRPOConfig(**cfg_kwargs)
    task_args = dict(job.get("task_args") or {})
    if "task" in job:
        task = get_task(job["task"], **task_args)
    else:
        task = get_task(f"file:{job['dataset']}", **task_args)
    reward_funcs = task.reward_funcs
    if job.get("reward_funcs"):
        names = job["reward_funcs"]
        names = [names] if isinstance(names, str) else names
        reward_funcs = [get_reward_func(n) for n in names]
    tools, environment = _multiturn_parts(job, task)
    if job.get("chat_template") is not None:
        task.chat_template = chat_template_text(job["chat_template"])  # the job's template over the task's
    multiturn = None
    if tools or environment is not None:
        multiturn = MultiTurn(check_tools(tools), environment, config.max_tool_calling_iterations,
                              config.chat_template_kwargs)
    check_reward_weights(config.reward_weights, [reward_func_name(f) for f in reward_funcs + (
        multiturn.reward_funcs() if multiturn is not None else [])])
    if str(getattr(config.eval_strategy, "value", config.eval_strategy)) != "no":
        raise JobError(f"eval_strategy={str(getattr(config.eval_strategy, 'value', config.eval_strategy))!r} is not "
                       "allowed in a job: use 'no' (the job's 'eval' section evaluates before and after training)")
    lora = job.get("lora")
    if lora is not None:
        check_lora(lora)
    ev = {"n": 128, "before": True, "after": True, "max_new_tokens": config.max_completion_length, "greedy": True}
    unknown = set(job.get("eval") or {}) - set(ev)
    if unknown:
        raise JobError(f"unknown eval key(s) {sorted(unknown)}; allowed: {sorted(ev)}")
    for key, value in (job.get("eval") or {}).items():
        if key in ("n", "max_new_tokens") and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise JobError(f"eval.{key}={value!r} is not allowed: expected a positive integer")
        if key in ("before", "after", "greedy") and not isinstance(value, bool):
            raise JobError(f"eval.{key}={value!r} is not allowed: expected true or false")
    ev.update(job.get("eval") or {})
    budget = job.get("time_budget_s")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
        raise JobError(f"time_budget_s={budget!r} is not allowed: expected a positive number of seconds")
    return job, config, task, reward_funcs, lora, ev, multiturn


def _multiturn_parts(job: dict[str, Any], task) -> tuple[list, Any]:
    """The job's tools (the task's and the YAML's) and its environment factory (the YAML's, else the task's)."""
    from .imports import import_object

    specs = job.get("tools") or []
    specs = [specs] if isinstance(specs, str) else specs
    if not isinstance(specs, list) or not all(isinstance(t, str) for t in specs):
        raise JobError(f"tools={job.get('tools')!r} is not allowed: expected module:function or a list of them")
    tools = list(task.tools) + [import_object(t, "tools") for t in specs]
    env = job.get("environment")
    if env is None:
        return tools, task.environment_factory
    if isinstance(env, str):
        return tools, import_object(env, "environment")
    if isinstance(env, dict) and env and all(isinstance(v, str) for v in env.values()):
        return tools, {str(k): import_object(v, f"environment.{k}") for k, v in env.items()}
    raise JobError(f"environment={env!r} is not allowed: expected module:Class or a mapping of names to them")


def chat_template_text(spec: str) -> str:
    """The job's ``chat_template``: grpokit's tool-capable ChatML (``chatml-tools``) or a template file's text."""
    from .tools import CHATML_TOOLS_TEMPLATE

    if spec == "chatml-tools":
        return CHATML_TOOLS_TEMPLATE
    if not isinstance(spec, str) or not Path(spec).expanduser().is_file():
        raise JobError(f"chat_template={spec!r} is not allowed: expected chatml-tools or a Jinja template file")
    return Path(spec).expanduser().read_text()


LORA_KEYS = ("r", "alpha", "dropout", "target_modules")


def check_lora(lora: Any) -> None:
    """The job's ``lora`` section: a mapping of known keys with values of the right type (checked before a model
    is loaded)."""
    if not isinstance(lora, dict):
        raise JobError(f"lora={lora!r} is not allowed: expected a mapping like {{r: 16, alpha: 32}}")
    unknown = set(lora) - set(LORA_KEYS)
    if unknown:
        raise JobError(f"unknown lora key(s) {sorted(map(str, unknown))}; allowed: {list(LORA_KEYS)}")
    for key in ("r", "alpha"):
        v = lora.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise JobError(f"lora.{key}={v!r} is not allowed: expected a positive integer")
    d = lora.get("dropout")
    if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < 1):
        raise JobError(f"lora.dropout={d!r} is not allowed: expected a number in [0, 1)")
    t = lora.get("target_modules")
    if t is not None and not (isinstance(t, str) or (isinstance(t, list) and t and all(isinstance(m, str) for m in t))):
        raise JobError(f"lora.target_modules={t!r} is not allowed: expected 'all-linear' or a list of module names")


def lora_config(lora: dict[str, Any]):
    from peft import LoraConfig

    check_lora(lora)
    r = int(lora.get("r", 16))
    return LoraConfig(r=r, lora_alpha=int(lora.get("alpha", 2 * r)), lora_dropout=float(lora.get("dropout", 0.0)),
                      target_modules=lora.get("target_modules", "all-linear"), task_type="CAUSAL_LM")


def run_job(spec: dict[str, Any], *, quiet: bool = False, resume: str | None = None) -> dict[str, Any]:
    """Run a whole job; returns the report dict (also written to ``output_dir/report.json``).

    ``resume``: a checkpoint directory, or ``"auto"`` for the latest checkpoint in ``output_dir`` (a fresh start
    when there is none). A SIGINT/SIGTERM during training saves a checkpoint and raises
    :class:`TrainingInterrupted`."""
    return _JobRun(spec, quiet=quiet, resume=resume).run()


class _JobRun:
    """The stages of :func:`run_job`, sharing what they need: validate, load, evaluate before, train, evaluate
    after, report. Under accelerate/torchrun every rank runs the job; the main process prints and writes."""

    def __init__(self, spec: dict[str, Any], *, quiet: bool, resume: str | None):
        self.wall_start = time.perf_counter()
        self.job, self.config, self.task, self.reward_funcs, self.lora, self.ev, self.multiturn = prepare(spec)
        self.quiet, self.resume = quiet, resume
        self.main = self.config.process_index == 0
        self.out = Path(self.config.output_dir)

    def tell(self, message: str) -> None:
        if self.main:
            say(self.quiet, message)

    def run(self) -> dict[str, Any]:
        import transformers

        resume_path = self._start()
        transformers.set_seed(self.config.seed)
        model, tokenizer = self._load()
        eval_funcs = self._eval_funcs()
        before = self._evaluate_before(model, tokenizer, eval_funcs, resume_path)
        trainer, train_time = self._train(model, tokenizer, resume_path)
        after = (None, None)
        if self.ev["after"] and self.task.eval_dataset is not None:
            self.tell("evaluating the trained model")
            after = self._evaluate(trainer.model, tokenizer, eval_funcs)
            self.tell(_eval_line("after", after[0]))
        if not self.main:
            return {"eval_before": before[0], "eval_after": after[0], "steps": trainer.state.global_step}
        return self._report(trainer, before, after, train_time)

    def _start(self) -> str | None:
        """What to resume from, said in one line; the output directory made."""
        from .checkpoints import CheckpointError, latest_checkpoint, resolve_resume

        try:
            resume_path = resolve_resume(self.resume, self.config.output_dir)
        except CheckpointError as e:
            raise JobError(str(e)) from None
        if resume_path:
            self.tell(f"resuming from {resume_path}")
        elif self.resume is not None:
            self.tell(f"no checkpoint in {self.out} yet: starting from scratch")
        elif latest_checkpoint(self.out) is not None:
            self.tell(f"note: {self.out} holds checkpoints up to {latest_checkpoint(self.out).name}; starting from "
                      "scratch (--resume auto continues from the latest)")
        self.out.mkdir(parents=True, exist_ok=True)
        return resume_path

    def _load(self):
        from .models import load_model, load_tokenizer

        name, trust = self.job["model"], self.config.trust_remote_code
        try:
            tokenizer = load_tokenizer(name, trust_remote_code=trust)
        except (OSError, ValueError, ImportError) as e:
            raise JobError(f"model {name!r} could not be loaded: {e}") from None
        if self.task.chat_template is not None:
            tokenizer.chat_template = self.task.chat_template
        if self.multiturn is not None:  # before the weights load: a wrong template fails fast
            try:
                self.multiturn.check_template(tokenizer)
            except ValueError as e:
                raise JobError(f"{e} (in a job: chat_template: chatml-tools, or a template file)") from None
        try:
            return load_model(name, trust_remote_code=trust), tokenizer
        except (OSError, ValueError, ImportError) as e:
            raise JobError(f"model {name!r} could not be loaded: {e}") from None

    def _eval_funcs(self) -> list:
        """The training rewards, plus the task's accuracy reward when training uses others: accuracy is the task's
        own measure."""
        from .rewards import reward_func_name

        funcs = list(self.reward_funcs) + (self.multiturn.reward_funcs() if self.multiturn is not None else [])
        if self.task.accuracy_reward not in [reward_func_name(f) for f in funcs]:
            funcs += [f for f in self.task.reward_funcs if f.__name__ == self.task.accuracy_reward]
        return funcs

    def _evaluate(self, model, tokenizer, eval_funcs):
        from .evaluation import evaluate

        ev, c = self.ev, self.config
        return evaluate(model, tokenizer, self.task.eval_dataset, eval_funcs, accuracy_reward=self.task.accuracy_reward,
                        max_new_tokens=int(ev["max_new_tokens"]), greedy=bool(ev["greedy"]), temperature=c.temperature,
                        n=int(ev["n"]), max_prompt_length=c.max_prompt_length, gather=c.ds3_gather_for_generation,
                        multiturn=self.multiturn, max_completion_length=c.max_completion_length)

    def _evaluate_before(self, model, tokenizer, eval_funcs, resume_path):
        """The held-out evaluation before training; a resumed run reads the one its first run measured."""
        from .sharding import full_weights, sharding_kind

        if not self.ev["before"] or self.task.eval_dataset is None:
            return None, None
        cached = self.out / "eval_before.json"
        if resume_path and cached.is_file():
            result = json.loads(cached.read_text())
            self.tell(_eval_line("before (measured by the first run)", result[0]))
            return tuple(result)
        self.tell(f"evaluating the model before training on {min(self.ev['n'], len(self.task.eval_dataset))} "
                  "held-out prompts")
        # With DeepSpeed's zero3_init_flag the model was loaded partitioned and is not in DeepSpeed's engine yet
        # (no hooks gather its layers): gather it whole for this evaluation.
        with full_weights(model) if sharding_kind(model) == "zero3" else contextlib.nullcontext():
            result = self._evaluate(model, tokenizer, eval_funcs)
        self.tell(_eval_line("before", result[0]))
        if self.main:
            atomic_write_text(cached, json.dumps(jsonable(list(result))))
        return result

    def _train(self, model, tokenizer, resume_path):
        import transformers

        from .callbacks import MetricsJsonlCallback, ProgressCallback, TimeBudget
        from .checkpoints import CheckpointError
        from .trainer import GRPOTrainer

        budget = self.job.get("time_budget_s")
        mt = self.multiturn
        trainer = GRPOTrainer(model, self.reward_funcs or None, args=self.config, train_dataset=self.task.train_dataset,
                              processing_class=tokenizer,
                              peft_config=lora_config(self.lora) if self.lora is not None else None,
                              tools=mt.tools if mt is not None else None,
                              environment_factory=mt.environments.factory if mt is not None and mt.environments else None)
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        trainer.remove_callback(transformers.trainer_callback.ProgressCallback)
        trainer.add_callback(MetricsJsonlCallback(str(self.out)))
        trainer.add_callback(ProgressCallback(quiet=self.quiet, time_budget_s=budget))
        if budget:
            trainer.add_callback(TimeBudget(float(budget)))
        start = time.perf_counter()
        try:
            trainer.train(resume_from_checkpoint=resume_path)
        except CheckpointError as e:
            raise JobError(str(e)) from None
        if trainer.interrupted:
            checkpoint = trainer.interrupt_checkpoint
            if checkpoint is None:  # the signal came after the last step: keep that state too
                checkpoint = trainer.save_checkpoint()
            raise TrainingInterrupted(trainer.interrupted, checkpoint, trainer.state.global_step)
        trainer.save_model(str(self.out / "final"))
        return trainer, time.perf_counter() - start

    def _report(self, trainer, before, after, train_time: float) -> dict[str, Any]:
        from .reporting import write_report

        cfg = jsonable(self.config.to_dict())
        cfg.update(model=self.job["model"], task=self.job.get("task") or self.job.get("dataset"), lora=self.lora,
                   steps=trainer.state.global_step)
        write_report(str(self.out), config=cfg, eval_before=before[0], eval_after=after[0],
                     samples_before=before[1], samples_after=after[1],
                     wall_time_s=time.perf_counter() - self.wall_start, train_time_s=train_time,
                     extra={"task": self.task.name, "description": self.task.description,
                            "distributed": _distributed_summary(trainer)})
        self.tell(f"report: {self.out / 'report.md'}")
        return json.loads((self.out / "report.json").read_text())


def _eval_line(label: str, e: dict[str, Any]) -> str:
    acc = e.get("accuracy")
    parts = [f"{label}: reward {e['reward_mean']:.3f}"]
    if acc is not None:
        lo, hi = e["accuracy_ci95"]
        parts.append(f"accuracy {acc:.1%} (95% CI {lo:.1%}–{hi:.1%}, n={e['n']})")
    if "format_rate" in e:
        parts.append(f"format {e['format_rate']:.1%}")
    return " | ".join(parts)


def _distributed_summary(trainer) -> dict[str, Any]:
    """How the run was spread: processes, accelerate's distributed type, the sharding and ZeRO stage."""
    from .sharding import sharding_kind

    acc = trainer.accelerator
    ds = getattr(acc.state, "deepspeed_plugin", None)
    wrapped = trainer.model_wrapped if trainer.model_wrapped is not None else trainer.model
    return {"num_processes": acc.num_processes, "type": str(acc.distributed_type).split(".")[-1],
            "sharding": sharding_kind(wrapped), "zero_stage": getattr(ds, "zero_stage", None)}


def say(quiet: bool, message: str) -> None:
    """Job milestones are printed even with --quiet (which only drops the live progress bar)."""
    print(message, flush=True)
