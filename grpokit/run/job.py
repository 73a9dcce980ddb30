"""A whole training job from one spec (a YAML file's contents or the demo's preset): validate everything before
any model is loaded, evaluate before, train, evaluate after, write the report."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import time
import typing
from pathlib import Path
from typing import Any

from ..validation import refusal
from .files import atomic_write_text
from .job_spec import JOB_KEYS, JobError, TrainingInterrupted, check_lora, split_spec

__all__ = ["JOB_KEYS", "JobError", "PreparedJob", "TrainingInterrupted", "algorithms", "prepare", "run_job"]

logger = logging.getLogger("grpokit")

AFTER_TRAINING_S = 15.0
"""``finish_within_s``: seconds kept, beside the evaluation after training, for saving the model and the report."""
AFTER_EVAL_GUESS_S = 30.0
"""``finish_within_s``: the evaluation after training, when no evaluation before it measured how long one takes."""
MIN_TRAINING_S = 30.0
"""``finish_within_s``: training gets at least this long, however little time is left."""


def algorithms() -> dict[str, dict[str, Any]]:
    """Named recipes: the GRPOConfig fields that make each algorithm (``grpokit demo --algo NAME``), from the loss
    registry (each loss describes its own)."""
    from ..algorithms.losses import recipes

    return recipes()


def config_fields() -> dict[str, dataclasses.Field]:
    from ..config import GRPOConfig

    return {f.name: f for f in dataclasses.fields(GRPOConfig) if f.init}


def _type_name(field: dataclasses.Field) -> str:
    t = field.type
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def coerce_value(name: str, value: Any, field: dataclasses.Field) -> Any:
    """Check a YAML value against the field's type; numbers written as strings (YAML reads ``1e-5`` as a string)
    become numbers. Raises :class:`JobError` naming the field, the value and the expected type."""
    t = _type_name(field).replace(" ", "")
    parts = set(t.replace("Optional[", "").replace("]", "").split("|"))

    def bad(allowed: str) -> JobError:
        return refusal(name, value, allowed, error=JobError)

    if value is None:
        if "None" in parts or field.default is None:
            return None
        raise bad(f"expected {t}")
    if "bool" in parts and isinstance(value, bool):
        return value
    if parts & {"float", "int"} and not isinstance(value, bool):
        if isinstance(value, (int, float)):
            return int(value) if parts == {"int"} and float(value).is_integer() else value
        if isinstance(value, str) and not parts & {"str"}:
            try:
                number = float(value)
            except ValueError:
                raise bad(f"expected {t}") from None
            return int(number) if "float" not in parts and number.is_integer() else number
    if parts <= {"bool", "None"} and not isinstance(value, bool):
        raise bad("expected true or false")
    if parts <= {"int", "None"} and not isinstance(value, int):
        raise bad("expected an integer")
    if parts <= {"float", "None"} and not isinstance(value, (int, float)):
        raise bad("expected a number")
    from ..config import CHOICE_FIELDS

    if parts <= {"str", "None"} and not isinstance(value, str) and name not in CHOICE_FIELDS:
        raise bad("expected a string")  # (choices: GRPOConfig lists them)
    if any(p.startswith("dict") for p in parts) and not isinstance(value, dict) and not (
            "str" in parts and isinstance(value, str)):
        raise bad("expected a mapping (key: value)")
    if any(p.startswith("list") for p in parts) and not isinstance(value, list) and not (
            "str" in parts and isinstance(value, str)):
        raise bad("expected a list")
    choices = _enum_values(field)
    if choices and not (isinstance(value, str) and value in choices):
        raise bad(f"use one of {', '.join(map(repr, choices))}")
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


@dataclasses.dataclass(frozen=True)
class PreparedJob:
    """What :func:`prepare` checked and built from a job spec, before any model is loaded."""

    job: dict[str, Any]
    """The job's own keys (``model``, ``task``, ``eval``, ...; :data:`JOB_KEYS`)."""
    config: Any
    """The ``GRPOConfig``."""
    task: Any
    """The task (a built-in's, or one from the ``dataset`` file)."""
    reward_funcs: list
    """The reward functions (the job's ``reward_funcs``, else the task's)."""
    lora: dict[str, Any] | None
    """The job's ``lora`` section (None: full fine-tuning)."""
    ev: dict[str, Any]
    """The held-out evaluation's settings: the job's ``eval`` section over the defaults."""
    multiturn: Any
    """The tools and environment of a multi-turn job (a ``MultiTurn``), or None."""


def prepare(spec: dict[str, Any], config_dir: str | Path | None = None) -> PreparedJob:
    """Everything that can fail on bad input, before a model is loaded: config, task, reward functions.
    Any such failure is a :class:`JobError`. ``config_dir``: the config file's folder, where user modules
    (rewards, tools, environments) are also looked up."""
    from ..imports import beside_config

    try:
        with beside_config(config_dir):
            return _prepare(spec)
    except JobError:
        raise
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        raise JobError(str(e)) from None


def _prepare(spec: dict[str, Any]) -> PreparedJob:
    job, raw = split_spec(spec)  # the spec's shape first: no heavy import before a typo is reported

    from ..config import GRPOConfig
    from ..rewards import check_reward_weights, get_reward_func, reward_func_name
    from ..tasks import get_task
    from ..tools import MultiTurn, check_tools

    fields = config_fields()
    if "output_dir" in raw and raw["output_dir"] is None:  # `output_dir:` with nothing after it (a template's hole)
        raise refusal("output_dir", None, "expected a directory path", error=JobError)
    cfg_kwargs = {key: coerce_value(key, value, fields[key]) for key, value in raw.items()}
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
        names = [names] if isinstance(names, (str, dict)) else names
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
    eval_strategy = str(getattr(config.eval_strategy, "value", config.eval_strategy))
    if eval_strategy != "no":
        raise refusal("eval_strategy", eval_strategy, "use 'no' (the job's 'eval' section evaluates before and after "
                      "training)", when="in a job", error=JobError)
    lora = job.get("lora")
    ev = {"n": 128, "before": True, "after": True, "max_new_tokens": config.max_completion_length, "greedy": True,
          "batch_size": 32}
    ev.update(job.get("eval") or {})
    _check_before_loading(job, config, task)
    return PreparedJob(job, config, task, reward_funcs, lora, ev, multiturn)


def _check_before_loading(job: dict[str, Any], config, task) -> None:
    """What would otherwise fail only after the model loaded: the model's files, the output directory, the
    dataset's size and column names, and ``model_init_kwargs``."""
    from ..data import check_column_names, check_prompt_count
    from ..models import check_model_source
    from .run_dir import check_output_dir

    check_model_source(job["model"])
    check_output_dir(config.output_dir, create=False)
    prompts = config.generation_batch_size // config.num_generations
    check_prompt_count(len(task.train_dataset), prompts)
    check_column_names("the task's dataset", task.train_dataset.column_names)
    _check_images_before_loading(job, config, task)
    kwargs = config.model_init_kwargs or {}
    unknown = sorted(set(kwargs) - MODEL_INIT_KWARGS)
    if unknown:
        raise JobError(f"model_init_kwargs {unknown} are not used by grpokit train; allowed: "
                       f"{', '.join(sorted(MODEL_INIT_KWARGS))}")


def _check_images_before_loading(job: dict[str, Any], config, task) -> None:
    """A task with images (``shapes``, a data file naming pictures) needs a vision-language model: one line before
    any weights load. Each picture was read already (built by the task, or checked when its data file was read)."""
    from ..models import is_vlm_source
    from ..vision.images import image_column

    if image_column(task.train_dataset.column_names) is None:
        return
    if not is_vlm_source(job["model"], trust_remote_code=config.trust_remote_code):
        raise JobError(f"the task's dataset has images (an {image_column(task.train_dataset.column_names)!r} column) "
                       f"but model {job['model']!r} is not a vision-language model: it cannot see them; use a VLM "
                       "(a local directory or hub id of Qwen2.5-VL, SmolVLM, Gemma 3, LLaVA, ...: docs/vision.md)")


MODEL_INIT_KWARGS = {"dtype", "torch_dtype", "attn_implementation", "revision", "device_map", "low_cpu_mem_usage",
                     "use_safetensors", "trust_remote_code"}
"""``model_init_kwargs`` a job passes to the model loader (anything else is refused, never ignored)."""


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def _multiturn_parts(job: dict[str, Any], task) -> tuple[list, Any]:
    """The job's tools (the task's and the YAML's) and its environment factory (the YAML's, else the task's); their
    types were checked by :func:`grpokit.run.job_spec.check_job_keys`."""
    from ..imports import import_object

    specs = job.get("tools") or []
    specs = [specs] if isinstance(specs, str) else specs
    tools = list(task.tools) + [import_object(t, "tools") for t in specs]
    env = job.get("environment")
    if env is None:
        return tools, task.environment_factory
    if isinstance(env, str):
        return tools, import_object(env, "environment")
    return tools, {str(k): import_object(v, f"environment.{k}") for k, v in env.items()}


def chat_template_text(spec: str) -> str:
    """The job's ``chat_template``: grpokit's tool-capable ChatML (``chatml-tools``) or a template file's text."""
    from ..tools import CHATML_TOOLS_TEMPLATE

    if spec == "chatml-tools":
        return CHATML_TOOLS_TEMPLATE
    if not isinstance(spec, str) or not Path(spec).expanduser().is_file():
        raise refusal("chat_template", spec, "expected chatml-tools or a Jinja template file", error=JobError)
    return Path(spec).expanduser().read_text()


def lora_config(lora: dict[str, Any], model=None):
    """The job's ``lora`` section as a ``peft.LoraConfig``. Without ``target_modules``: every linear layer
    (``all-linear``), and for a vision-language ``model`` every linear layer of its language model (its vision tower
    and projector stay frozen: :func:`grpokit.vision.lora_settings`)."""
    from peft import LoraConfig

    check_lora(lora)
    r = int(lora.get("r", 16))
    targets = lora.get("target_modules", "all-linear")
    if "target_modules" not in lora and model is not None:
        from ..vision.detection import is_vlm

        if is_vlm(model):
            from ..vision.adapters import lora_settings

            targets = lora_settings(model)["target_modules"]
    return LoraConfig(r=r, lora_alpha=int(lora.get("alpha", 2 * r)), lora_dropout=float(lora.get("dropout", 0.0)),
                      target_modules=targets, task_type="CAUSAL_LM")


def run_job(spec: dict[str, Any], *, quiet: bool = False, resume: str | None = None, overwrite: bool = False,
            force_resume: bool = False, config_dir: str | Path | None = None,
            callbacks: list | None = None) -> dict[str, Any]:
    """Run a whole job; returns the report dict (also written to ``output_dir/report.json``).

    ``resume``: a checkpoint directory, or ``"auto"`` for the latest checkpoint in ``output_dir`` (a fresh start
    when there is none). A fresh run into an ``output_dir`` that holds an earlier run is refused unless
    ``overwrite`` (its files are then removed first); a resume whose settings differ from the checkpoint's is
    refused unless ``force_resume``. A SIGINT/SIGTERM during training saves a checkpoint and raises
    :class:`TrainingInterrupted`. ``config_dir``: where user modules named in the spec are also looked up.
    ``callbacks``: ``TrainerCallback`` s added to the trainer after the job's own (a benchmark's probes)."""
    return _JobRun(spec, quiet=quiet, resume=resume, overwrite=overwrite, force_resume=force_resume,
                   config_dir=config_dir, callbacks=callbacks).run()


class _JobRun:
    """The stages of :func:`run_job`, sharing what they need: validate, load, evaluate before, train, evaluate
    after, report. Under accelerate/torchrun every rank runs the job; the main process prints and writes."""

    def __init__(self, spec: dict[str, Any], *, quiet: bool, resume: str | None, overwrite: bool = False,
                 force_resume: bool = False, config_dir: str | Path | None = None, callbacks: list | None = None):
        self.wall_start = time.perf_counter()
        self.wall_start_epoch = time.time()
        self.callbacks = list(callbacks or [])
        prepared = prepare(spec, config_dir)
        self.job, self.config, self.task = prepared.job, prepared.config, prepared.task
        self.reward_funcs, self.lora, self.ev = prepared.reward_funcs, prepared.lora, prepared.ev
        self.multiturn = prepared.multiturn
        self.freeze_vision_given = isinstance(spec, dict) and "freeze_vision" in spec
        self.quiet, self.resume = quiet, resume
        self.overwrite, self.force_resume = overwrite, force_resume
        self.main = self.config.process_index == 0
        self.out = Path(self.config.output_dir)
        self.threads = None
        """While training on a CPU: the :class:`grpokit.machine.threads.FreeCoresFollower` torch's threads follow."""

    def tell(self, message: str) -> None:
        if self.main:
            say(self.quiet, message)

    def run(self) -> dict[str, Any]:
        from .run_dir import RunDirError, RunDirLock

        try:
            lock = RunDirLock(self.out).acquire() if self.main else None
        except RunDirError as e:
            raise JobError(str(e)) from None
        from ..models import no_progress_bars

        try:
            with no_progress_bars():  # the job prints its own progress
                return self._run()
        finally:
            if lock is not None:
                lock.release()

    def _run(self) -> dict[str, Any]:
        import transformers

        resume_path = self._start()
        if self.config.use_cpu or not _has_accelerator():
            import torch

            from ..machine.threads import FreeCoresFollower, fit_torch_threads, user_chose_threads

            ceiling = torch.get_num_threads()
            try:
                said = fit_torch_threads()
            except ValueError as e:
                raise JobError(str(e)) from None
            if said:
                self.tell(said)
            if not user_chose_threads() and self.config.world_size == 1:  # (ranks: each launcher sets its own)
                self.threads = FreeCoresFollower(ceiling)
        transformers.set_seed(self.config.seed)
        model, tokenizer = self._load()
        self._check_lora_targets(model)  # before the evaluation: a typo must not cost its minutes
        eval_funcs = self._eval_funcs()
        before = self._evaluate_before(model, tokenizer, eval_funcs, resume_path)
        trainer, train_time = self._train(model, tokenizer, resume_path, self._training_budget(before[0]))
        after = (None, None)
        if self.ev["after"] and self.task.eval_dataset is not None:
            self.tell("evaluating the trained model")
            after = self._evaluate(trainer.model, tokenizer, eval_funcs)
            self.tell(_eval_line("after", after[0]))
            for line in example_lines(before[1], after[1], judge=self.task.accuracy_reward):
                self.tell(line)
        if not self.main:
            return {"eval_before": before[0], "eval_after": after[0], "steps": trainer.state.global_step}
        return self._report(trainer, before, after, train_time)

    def _start(self) -> str | None:
        """What to resume from, said in one line; a fresh run into a directory holding an earlier run refused (or,
        with ``overwrite``, the earlier run removed)."""
        from .checkpoints import CheckpointError, resolve_resume
        from .run_dir import RunDirError, claim_output_dir

        try:
            resume_path = resolve_resume(self.resume, self.config.output_dir)
            if self.main:  # it alone judges: another rank that starts later would find what this one already wrote
                claim_output_dir(self.out, resuming=resume_path is not None, overwrite=self.overwrite,
                                 job_outputs=True, how_to_resume="--resume", how_to_overwrite="--overwrite")
        except (CheckpointError, RunDirError) as e:
            raise JobError(str(e)) from None
        if resume_path:
            self.tell(f"resuming from {resume_path}")
        elif self.resume is not None:
            self.tell(f"no checkpoint in {self.out} yet: starting from scratch")
        self.out.mkdir(parents=True, exist_ok=True)
        return resume_path

    def _load(self):
        from ..models import builtin_cache_dir, builtin_cache_missing, load_model, load_processing_class

        name, trust = self.job["model"], self.config.trust_remote_code
        converting = builtin_cache_missing(name)
        if converting:
            self.tell(f"first use of {name} on this machine: converting its GGUF file into {builtin_cache_dir(name)} "
                      "(once; later runs load that copy)")
        start = time.perf_counter()
        try:
            tokenizer = load_processing_class(name, trust_remote_code=trust)  # a built-in's first load converts it
        except Exception as e:  # noqa: BLE001 - any loading failure is one line naming the model
            raise JobError(f"the tokenizer of {name!r} could not be loaded: {type(e).__name__}: {e}") from None
        if converting:
            self.tell(f"converted in {time.perf_counter() - start:.0f} s")
        if self.task.chat_template is not None:
            tokenizer.chat_template = self.task.chat_template
        if self.multiturn is not None:  # before the weights load: a wrong template fails fast
            try:
                self.multiturn.check_template(tokenizer)
            except ValueError as e:
                raise JobError(f"{e} (in a job: chat_template: chatml-tools, or a template file)") from None
        kwargs = dict(self.config.model_init_kwargs or {})
        kwargs.pop("trust_remote_code", None)
        if "torch_dtype" in kwargs:
            kwargs.setdefault("dtype", kwargs.pop("torch_dtype"))
        try:
            return load_model(name, trust_remote_code=trust, **kwargs), tokenizer
        except Exception as e:  # noqa: BLE001 - any loading failure is one line naming the model
            raise JobError(f"model {name!r} could not be loaded: {type(e).__name__}: {e}") from None

    def _check_lora_targets(self, model) -> None:
        """``lora.target_modules`` must name modules of the loaded model (the trainer would find out only after the
        evaluation before training)."""
        if self.lora is None:
            return
        from ..models import lora_target_problem

        problem = lora_target_problem(model, lora_config(self.lora, model))
        if problem is not None:
            raise JobError(problem.replace("peft_config.target_modules", "lora.target_modules"))

    def _eval_funcs(self) -> list:
        """The training rewards, plus the task's accuracy reward when training uses others: accuracy is the task's
        own measure."""
        from ..rewards import reward_func_name

        funcs = list(self.reward_funcs) + (self.multiturn.reward_funcs() if self.multiturn is not None else [])
        if self.task.accuracy_reward not in [reward_func_name(f) for f in funcs]:
            funcs += [f for f in self.task.reward_funcs if f.__name__ == self.task.accuracy_reward]
        return funcs

    def _evaluate(self, model, tokenizer, eval_funcs):
        from ..bounds.user_calls import CallBounds
        from ..evaluation import evaluate

        ev, c = self.ev, self.config
        return evaluate(model, tokenizer, self.task.eval_dataset, eval_funcs, accuracy_reward=self.task.accuracy_reward,
                        max_new_tokens=int(ev["max_new_tokens"]), greedy=bool(ev["greedy"]), temperature=c.temperature,
                        top_k=c.top_k, top_p=c.top_p,
                        n=int(ev["n"]), batch_size=int(ev["batch_size"]), max_prompt_length=c.max_prompt_length,
                        gather=c.ds3_gather_for_generation, multiturn=self.multiturn,
                        max_completion_length=c.max_completion_length, bounds=CallBounds.from_config(c))

    def _evaluate_before(self, model, tokenizer, eval_funcs, resume_path):
        """The held-out evaluation before training; a resumed run reads the one its first run measured."""
        from ..forward.sharding import full_weights, sharding_kind

        if not self.ev["before"] or self.task.eval_dataset is None:
            return None, None
        cached = self.out / "eval_before.json"
        if resume_path and cached.is_file():
            try:
                result = json.loads(cached.read_text())
                self.tell(_eval_line("before (measured by the first run)", result[0]))
                return tuple(result)
            except (ValueError, KeyError, IndexError, TypeError, OSError):
                self.tell(f"{cached} is damaged: measuring again")
        self.tell(f"evaluating the model before training on {min(self.ev['n'], len(self.task.eval_dataset))} "
                  "held-out prompts")
        # With DeepSpeed's zero3_init_flag the model was loaded partitioned and is not in DeepSpeed's engine yet
        # (no hooks gather its layers): gather it whole for this evaluation.
        with full_weights(model) if sharding_kind(model) == "zero3" else contextlib.nullcontext():
            result = self._evaluate(model, tokenizer, eval_funcs)
        self.tell(_eval_line("before", result[0]))
        if self.main:
            from ..reporting._util import jsonable

            atomic_write_text(cached, json.dumps(jsonable(list(result))))
        return result

    def _training_budget(self, before: dict[str, Any] | None) -> float | None:
        """``time_budget_s``, cut where ``finish_within_s`` leaves less: the seconds since ``started_at`` (or the
        job's start) are spent, and the evaluation after training and the report need about what the evaluation
        before took (``AFTER_TRAINING_S`` more for saving and the report). Said in one line when it cuts
        ``time_budget_s``."""
        budget = self.job.get("time_budget_s")
        limit = self.job.get("finish_within_s")
        if not limit:
            return budget
        started = self.job.get("started_at") or self.wall_start_epoch
        elapsed = time.time() - started
        evaluation = 0.0
        if self.ev["after"] and self.task.eval_dataset is not None:  # about as long as the one before, if measured
            evaluation = float((before or {}).get("seconds") or AFTER_EVAL_GUESS_S)
        left = limit - elapsed - evaluation - AFTER_TRAINING_S
        if budget is not None and left >= budget:
            return budget
        left = max(MIN_TRAINING_S, left)
        if budget is not None:  # what was asked for is cut short: say so
            self.tell(f"training for at most {left:.0f} s, to end within {limit:g} s of the start ({elapsed:.0f} s "
                      f"spent before training, about {evaluation + AFTER_TRAINING_S:.0f} s kept for after it)")
        return left

    def _train(self, model, tokenizer, resume_path, budget: float | None):
        import transformers

        from ..callbacks import FollowFreeCores, HeldOutCurve, MetricsJsonlCallback, ProgressCallback, TimeBudget
        from ..trainer import GRPOTrainer
        from .checkpoints import CheckpointError
        from .run_dir import ResumeMismatch

        mt = self.multiturn
        # the job loaded the model with model_init_kwargs (_load): the trainer, given it loaded, would warn that they
        # are ignored
        init_kwargs, self.config.model_init_kwargs = self.config.model_init_kwargs, None
        self._default_freeze_vision(model)
        try:
            trainer = GRPOTrainer(model, self.reward_funcs or None, args=self.config,
                                  train_dataset=self.task.train_dataset, processing_class=tokenizer,
                                  peft_config=lora_config(self.lora, model) if self.lora is not None else None,
                                  tools=mt.tools if mt is not None else None,
                                  environment_factory=mt.environments.factory if mt is not None and mt.environments
                                  else None)
        except (ValueError, TypeError) as e:
            raise JobError(str(e).replace("peft_config.target_modules", "lora.target_modules")) from None
        finally:
            self.config.model_init_kwargs = init_kwargs
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        trainer.remove_callback(transformers.trainer_callback.ProgressCallback)
        metrics = MetricsJsonlCallback(str(self.out))
        trainer.add_callback(metrics)
        trainer.add_callback(ProgressCallback(quiet=self.quiet, time_budget_s=budget))
        if budget:
            trainer.add_callback(TimeBudget(float(budget)))
        if self.threads is not None:
            trainer.add_callback(FollowFreeCores(self.threads, self.tell))
        if self.ev.get("every_steps") and self.task.eval_dataset is not None:
            def evaluate_during(model):  # with ema_decay, the averaged weights: what the run would deliver now
                with trainer.averaged_weights():
                    return self._evaluate(model, tokenizer, self._eval_funcs())[0]

            trainer.add_callback(HeldOutCurve(int(self.ev["every_steps"]), evaluate_during,
                                              lambda step, summary: self._held_out(trainer, metrics, summary)))
        for callback in self.callbacks:
            trainer.add_callback(callback)
        start = time.perf_counter()
        try:
            trainer.train(resume_from_checkpoint=resume_path, force_resume=self.force_resume)
        except CheckpointError as e:
            raise JobError(e.describe("--force") if isinstance(e, ResumeMismatch) else str(e)) from None
        if trainer.interrupted:
            checkpoint = trainer.interrupt_checkpoint
            if checkpoint is None:  # the signal came after the last step: keep that state too
                checkpoint = trainer.save_checkpoint()
            raise TrainingInterrupted(trainer.interrupted, checkpoint, trainer.state.global_step)
        self._save_final(trainer)
        return trainer, time.perf_counter() - start

    def _default_freeze_vision(self, model) -> None:
        """A job trains a vision-language model's language model only, unless asked: with ``lora`` the adapters
        (:func:`lora_config`), in full fine-tuning ``freeze_vision`` (on unless the config sets it)."""
        from ..vision.detection import is_vlm

        if self.lora is None and not self.freeze_vision_given and is_vlm(model):
            self.config.freeze_vision = True
            self.tell("full fine-tuning of a vision-language model: its vision tower and projector stay frozen "
                      "(freeze_vision: false trains them too)")

    def _held_out(self, trainer, metrics, summary: dict[str, Any]) -> None:
        """One evaluation during training: into metrics.jsonl and one line on the terminal."""
        from ..callbacks import held_out_record

        metrics.write(trainer.state, held_out_record(summary))
        self.tell(_eval_line(f"held-out at step {trainer.state.global_step}", summary)
                  + f" | {summary['seconds']:.0f} s")

    def _save_final(self, trainer) -> None:
        """The trained model (or adapter) into ``final/``, whole or not at all: written into ``final.tmp`` by every
        rank that saves, flushed, then renamed into place."""
        import shutil

        from .files import fsync_tree, publish_directory

        staging, final = self.out / "final.tmp", self.out / "final"
        if self.main:
            shutil.rmtree(staging, ignore_errors=True)
        trainer.accelerator.wait_for_everyone()
        try:
            trainer.save_model(str(staging))
            trainer.accelerator.wait_for_everyone()
            if self.main:
                fsync_tree(staging)
                publish_directory(staging, final)
        except BaseException:
            if self.main:
                shutil.rmtree(staging, ignore_errors=True)
            raise

    def _report(self, trainer, before, after, train_time: float) -> dict[str, Any]:
        from ..reporting import write_report
        from ..reporting._util import jsonable

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
    if "last_number_accuracy" in e:
        lo, hi = e["last_number_ci95"]
        parts.append(f"last number right {e['last_number_accuracy']:.1%} ({lo:.1%}–{hi:.1%})")
    if "format_rate" in e:
        parts.append(f"format {e['format_rate']:.1%}")
    return " | ".join(parts)


def example_lines(before: list[dict] | None, after: list[dict] | None, k: int = 3, width: int = 72,
                  judge: str | None = None) -> list[str]:
    """The first ``k`` held-out questions with the answer before and after training (evaluation samples, in the
    same order), each reply on one line, cut to ``width`` characters; ``judge``: the reward that says right or
    wrong, named in the header. [] without both."""
    if not before or not after:
        return []

    def one_line(text: Any) -> str:
        text = " ".join(str(text).split())
        return text if len(text) <= width else text[:width - 1] + "…"

    def mark(sample: dict) -> str:
        return {True: "right", False: "wrong"}.get(sample.get("correct"), "     ")

    lines = ["examples (held-out questions" + (f"; right or wrong as the {judge!r} reward scores them" if judge
                                               else "") + "):"]
    for b, a in list(zip(before, after))[:k]:
        lines.append(f"  {one_line(b['prompt'])}" + (f"  [answer {b['answer']}]" if b.get("answer") else ""))
        lines.append(f"    before  {mark(b)}  {one_line(b['completion'])}")
        lines.append(f"    after   {mark(a)}  {one_line(a['completion'])}")
    return lines


def _distributed_summary(trainer) -> dict[str, Any]:
    """How the run was spread: processes, accelerate's distributed type, the sharding and ZeRO stage."""
    from ..forward.sharding import sharding_kind

    acc = trainer.accelerator
    ds = getattr(acc.state, "deepspeed_plugin", None)
    wrapped = trainer.model_wrapped if trainer.model_wrapped is not None else trainer.model
    return {"num_processes": acc.num_processes, "type": str(acc.distributed_type).split(".")[-1],
            "sharding": sharding_kind(wrapped), "zero_stage": getattr(ds, "zero_stage", None)}


def say(quiet: bool, message: str) -> None:
    """Job milestones are printed even with --quiet (which only drops the live progress bar)."""
    print(message, flush=True)
