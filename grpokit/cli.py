"""``grpokit train | demo | eval | tasks``: the command line.

Wrong input (config values, unknown keys, unknown tasks or rewards, missing files, a damaged checkpoint) is
printed in one line without a traceback and exits with status 2. A first SIGINT (Ctrl-C) or SIGTERM during
training finishes the current step, saves a checkpoint and exits with 128 + the signal number (130, 143);
``grpokit train CONFIG --resume`` continues from it. A second signal stops at once. A full disk, a non-finite loss
and a stop asked for by ``reward_timeout_action="stop"`` (or a ``rollout_func`` that timed out) are one line and
status 1; the watchdog (``stall_timeout_s`` with ``stall_action="save_and_exit"``) ends a stuck run with status 124
(grpokit/callbacks/stall.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

from .validation import refusal, short_repr

DEMO_SPEC: dict[str, Any] = {
    "model": "smollm2-135m-instruct",
    "task": "arithmetic",
    "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
    "eval": {"n": 128, "before": True, "after": True, "max_new_tokens": 48, "greedy": True, "batch_size": 128,
             "every_steps": 10},
    "time_budget_s": 550,
    "learning_rate": 5e-4,
    "lr_scheduler_type": "warmup_stable_decay",
    "warmup_steps": 10,
    "lr_scheduler_kwargs": {"num_stable_steps": 40, "num_decay_steps": 80, "decay_type": "linear"},
    "per_device_train_batch_size": 32,
    "num_generations": 4,
    "max_completion_length": 32,
    "temperature": 0.9,
    "top_k": 50,
    "dynamic_sampling": True,
    "dynamic_sampling_oversample": 4,
    "dynamic_sampling_explore_prob": 0.5,
    "dynamic_sampling_explore_prob_hard": 1.0,
    "scale_rewards": "batch",
    "ema_decay": 0.9,
    "beta": 0.0,
    "gradient_checkpointing": False,
    "max_steps": 130,  # where the learning rate reaches 0 (10 + 40 + 80 steps): later steps would not move the weights
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "seed": 0,
    "use_cpu": True,
}
"""The demo: LoRA on the embedded SmolLM2-135M, the arithmetic task, 8 questions × 4 completions a step with DAPO's
dynamic sampling (an extra round asks for up to 4× the batch's questions, as many as the share of groups kept so far
says are needed; the first round is sized by the last batch's keep rate; a question whose last ``z`` groups all scored
alike is asked again with probability 0.5**z, skipped otherwise: GRESO's pre-rollout filter; one whose groups all
failed is always asked again, ``dynamic_sampling_explore_prob_hard`` 1.0), advantages scaled by the
batch's reward spread (``scale_rewards`` "batch": a group that differs only in the 0.2 format reward gets a fifth of a
correctness group's advantage, not the same), learning rate 5e-4 after a linear warmup over 10 steps (without it some
seeds collapse onto one answer in the first steps), held for 40 steps, then falling linearly to 0 at step 130 (at a
constant rate the held-out accuracy wandered by ±5 points from step 50 on: a run's end landed anywhere in it), and
training stops there (``max_steps`` 130) if the time budget has not ended it first,
sampling at temperature 0.9 among the 50 likeliest tokens, the
trained weights averaged (``ema_decay`` 0.9: what is evaluated and saved), held-out accuracy every 10 steps (the 128
questions generated together); a few seconds a step on the 2-core CPUs measured, the fewest on an AMD EPYC with
AVX512-BF16 once the reply style has settled (benchmarks/RESULTS.md, 'Measurements behind design choices').
docs/demo.md has the
recipe search behind it and the measured runs."""


DEMO_ALGO = "dapo"
"""The demo's loss unless ``--algo`` says otherwise: DAPO's token-level loss (TRL 1.16's default ``loss_type``), each
completion token weighted alike over the batch. On the demo's on-policy steps it learned faster than GRPO's
per-sequence mean: three seeds on a 2-core Xeon with AMX capped, float32, 88.3 / 90.6 / 86.7% held out against GRPO's
77.3 / 80.5 / 78.9% (`grpokit demo`, model cached); from a fresh clone's `make demo` 75.8 / 85.9 / 82.8%."""


def demo_spec(algo: str) -> dict[str, Any]:
    """The demo's job for ``--algo algo``: :data:`DEMO_SPEC`, the algorithm's own settings, and the model's weights in
    bf16 where this CPU multiplies bf16 natively (AMX / AVX512-BF16) and measurably faster than float32, else float32
    (:func:`grpokit.machine.cpu_features.cpu_dtype`; docs/demo.md, "Why bf16")."""
    from .machine.cpu_features import cpu_dtype
    from .run.job import JobError, algorithms

    recipes = algorithms()
    if algo not in recipes:
        raise refusal("--algo", algo, f"expected one of {', '.join(recipes)}", error=JobError)
    spec = dict(DEMO_SPEC)
    spec.update(recipes[algo])
    spec["model_init_kwargs"] = {"dtype": cpu_dtype()}
    return spec


def _parse_set(pairs: list[str]) -> dict[str, Any]:
    import yaml

    from .run.job import JobError

    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise JobError(f"--set {short_repr(pair)} is not key=value")
        key, value = pair.split("=", 1)
        if not value.strip():  # `--set output_dir=$UNSET`: kept as written, so the field refuses it as from a file
            out[key.strip()] = value
            continue
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise JobError(f"--set {short_repr(pair)}: the value is not valid YAML ({_yaml_problem(e)}); quote it, "
                           "e.g. --set 'key=\"text\"'") from None
    return out


def _yaml_problem(error) -> str:
    """What a YAML error says, with its line and column (1-based)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    context = getattr(error, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}" + (f" ({context})" if context else "")


def _unique_key_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (line {key_node.start_mark.line + 1})", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return Loader


def _load_yaml(path: str) -> dict[str, Any]:
    import yaml

    from .run.job import JobError

    p = Path(path)
    if not p.is_file():
        raise JobError(f"config file {path!r} does not exist" if not p.exists() else f"config file {path!r} is not a file")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise JobError(f"config file {path!r} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
    except OSError as e:
        raise JobError(f"config file {path!r} cannot be read: {e.strerror or e}") from None
    try:
        data = yaml.load(text, Loader=_unique_key_loader())
    except yaml.YAMLError as e:
        raise JobError(f"config file {path!r} is not valid YAML: {_yaml_problem(e)}") from None
    if data is None:
        raise JobError(f"config file {path!r} is empty")
    if not isinstance(data, dict):
        raise JobError(f"config file {path!r} must hold a mapping of field: value, got {type(data).__name__}")
    return data


def cmd_train(ns: argparse.Namespace) -> int:
    from .run.job import run_job

    spec = _load_yaml(ns.config)
    spec.update(_parse_set(ns.set or []))
    if ns.output_dir:
        spec["output_dir"] = ns.output_dir
    run_job(spec, quiet=ns.quiet, resume=ns.resume, overwrite=ns.overwrite, force_resume=ns.force,
            config_dir=Path(ns.config).parent)
    return 0


def _free_demo_dir(base: str = "runs/demo") -> str:
    """``runs/demo``, or the first of ``runs/demo-2``, ``-3``, ... that no earlier run occupies: the demo never
    replaces an earlier demo's results unless told where to write (``--output-dir``) and to ``--overwrite``."""
    from .run.run_dir import earlier_run

    candidate, n = base, 1
    while earlier_run(candidate, job_outputs=True):
        n += 1
        candidate = f"{base}-{n}"
    return candidate


def cmd_demo(ns: argparse.Namespace) -> int:
    from .run.job import run_job

    spec = demo_spec(ns.algo)
    if ns.output_dir is None:
        ns.output_dir = "runs/demo" if ns.resume else _free_demo_dir()
    spec["output_dir"] = ns.output_dir
    if ns.time_budget is not None:
        spec["time_budget_s"] = ns.time_budget
    if ns.finish_within is not None:
        spec["finish_within_s"] = ns.finish_within
    if ns.started_at is not None:
        spec["started_at"] = ns.started_at
    if ns.max_steps is not None:
        spec["max_steps"] = ns.max_steps
    if ns.eval_n is not None:
        spec["eval"] = {**spec["eval"], "n": ns.eval_n}
    if ns.seed is not None:
        spec["seed"] = ns.seed
    overrides = _parse_set(ns.set or [])
    spec.update(overrides)
    if spec.get("dynamic_sampling") is False:  # the recipe's own dynamic-sampling settings go with it, unwarned
        from .config import DYNAMIC_SAMPLING_OPTIONS

        for name in set(DYNAMIC_SAMPLING_OPTIONS) - set(overrides):
            spec.pop(name, None)
    dtype = (spec.get("model_init_kwargs") or {}).get("dtype", "float32")
    budget = spec.get("time_budget_s")
    shown = f"{budget:g}" if isinstance(budget, (int, float)) else budget
    limit = f"training for at most {shown} s" if budget else f"training for {spec['max_steps']} steps"
    print(f"grpokit demo: {ns.algo} on SmolLM2-135M-Instruct (LoRA, {dtype} weights), task 'arithmetic', {limit} "
          f"→ {ns.output_dir}", flush=True)
    run_job(spec, quiet=ns.quiet, resume=ns.resume, overwrite=ns.overwrite, force_resume=ns.force)
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    from .run.job import JobError, _eval_line
    from .tasks import get_task

    try:
        task = get_task(ns.task)
    except (ValueError, FileNotFoundError, TypeError) as e:
        raise JobError(str(e)) from None
    if task.eval_dataset is None:
        raise JobError(f"task {ns.task!r} has no held-out split")
    model, tok = _load_for_eval(ns.model, ns.tokenizer)
    multiturn = None
    if task.tools or task.environment_factory is not None:
        from .tools import MultiTurn

        if task.chat_template is not None:
            tok.chat_template = task.chat_template
        multiturn = MultiTurn(task.tools, task.environment_factory, 2)
        multiturn.check_template(tok)
    from .evaluation import evaluate

    summary, samples = evaluate(model, tok, task.eval_dataset, task.reward_funcs, accuracy_reward=task.accuracy_reward,
                                n=ns.n, max_new_tokens=ns.max_new_tokens, greedy=not ns.sample, multiturn=multiturn,
                                max_completion_length=2 * ns.max_new_tokens if multiturn is not None else None)
    print(_eval_line(ns.model, summary))
    if ns.json:
        print(json.dumps(summary, indent=2))
    return 0


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


class _PositiveInt(argparse.Action):
    """An integer flag (``type=_integer``) refused below 1, in the one line :func:`grpokit.validation.refusal` words
    (naming the flag as typed: ``--max-steps=0``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values < 1:
            parser.error(str(refusal(option_string, values, "expected a positive integer")))
        setattr(namespace, self.dest, values)


def _load_for_eval(path: str, tokenizer: str | None):
    """The model (a run's ``final/`` adapter on its base model, or a model) and its tokenizer; every loading
    problem is one line naming the model."""
    from .models import no_progress_bars
    from .run.job import JobError

    try:
        with no_progress_bars():
            return _load_checked(path, tokenizer)
    except JobError:
        raise
    except Exception as e:  # noqa: BLE001 - any loading failure is one line naming the model
        raise JobError(f"model {path!r} could not be loaded: {type(e).__name__}: {_one_line(e)}") from None


def _load_checked(path: str, tokenizer: str | None):
    """:func:`_load_for_eval` without the error wrapping."""
    from .models import check_model_source, load_model, load_tokenizer

    check_model_source(path)
    cfg = Path(path) / "adapter_config.json"
    base = None
    if cfg.is_file():
        base = json.loads(cfg.read_text()).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"adapter {path!r} does not name its base model (base_model_name_or_path in "
                             "adapter_config.json); load the base model and the adapter in Python")
        check_model_source(base)
    if base is None:
        model = load_model(path).eval()
    else:
        from peft import PeftModel

        model = PeftModel.from_pretrained(load_model(base), path).eval()
    source = tokenizer or _tokenizer_source(path)
    from .vision.detection import is_vlm

    if is_vlm(model):  # a vision-language model's prompts go through its processor
        from .vision.loading import load_processor

        return model, load_processor(source)
    return model, load_tokenizer(source)


def _tokenizer_source(model_path: str) -> str:
    cfg = Path(model_path) / "adapter_config.json"
    if cfg.is_file():  # a LoRA adapter saved by a run: the tokenizer sits beside it, else on the base model
        if (Path(model_path) / "tokenizer_config.json").is_file():
            return model_path
        return json.loads(cfg.read_text()).get("base_model_name_or_path") or model_path
    return model_path


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def cmd_vllm_serve(ns: argparse.Namespace) -> int:
    from .rollout.precision import ROLLOUT_PRECISIONS
    from .rollout.vllm_launch import ServeOptions, running_server
    from .run.job_spec import JobError

    if ns.rollout_precision not in ROLLOUT_PRECISIONS:
        raise refusal("--rollout-precision", ns.rollout_precision, f"use one of {', '.join(ROLLOUT_PRECISIONS)}",
                      error=JobError)
    extra = [a for a in ns.vllm_args if a != "--"]
    opts = ServeOptions(model=ns.model, host=ns.host, port=ns.port, dtype=ns.dtype, max_model_len=ns.max_model_len,
                        enable_lora=ns.enable_lora, max_lora_rank=ns.max_lora_rank, python=ns.python, extra=extra,
                        rollout_precision=ns.rollout_precision)
    signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM stops the server as Ctrl-C does (its whole group)
    try:
        with running_server(opts, show_output=True) as server:
            print(f"grpokit vllm-serve: {ns.model} at {server.url}; train with use_vllm=True, vllm_mode='server', "
                  f"vllm_server_base_url='{server.url}' (Ctrl-C stops it)", flush=True)
            return server.process.wait()
    except (RuntimeError, ValueError) as e:  # a server that did not start; a precision this CPU cannot serve
        raise JobError(str(e)) from None


def cmd_tasks(ns: argparse.Namespace) -> int:
    from .run.job import algorithms
    from .tasks import list_tasks

    print("tasks:", ", ".join(list_tasks()))
    print("algorithms (--algo):", ", ".join(algorithms()))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (``grpokit: error: ...``, exit 2) like every other user error, and no
    abbreviated flags (``--resum`` is a typo, not ``--resume``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"grpokit: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="grpokit", description="GRPO-family RL fine-tuning of language models.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train from a YAML config (every GRPOConfig field, plus model/task/...)")
    t.add_argument("config")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    t.add_argument("--output-dir")
    t.add_argument("--quiet", action="store_true", help="log lines only, no live progress bar")
    t.add_argument("--resume", nargs="?", const="auto", metavar="PATH|auto",
                   help="continue from a checkpoint directory, or 'auto' (the default when the flag has no value): "
                        "the latest checkpoint in output_dir, or a fresh start when there is none")
    _run_dir_flags(t)
    t.set_defaults(func=cmd_train)

    d = sub.add_parser("demo", help="train the embedded SmolLM2-135M on arithmetic (CPU, ~10 minutes)")
    d.add_argument("--algo", default=DEMO_ALGO,
                   help=f"an algorithm recipe (default {DEMO_ALGO}; `grpokit tasks` lists them)")
    d.add_argument("--output-dir", help="default: runs/demo, or runs/demo-2, -3, ... when an earlier demo is there")
    d.add_argument("--time-budget", type=float,
                   help=f"seconds of training (default {DEMO_SPEC['time_budget_s']}, cut by --finish-within)")
    d.add_argument("--finish-within", type=float, metavar="SECONDS",
                   help="end the whole demo, evaluations included, within SECONDS of --started-at (training is cut "
                        "short when less is left; make demo passes 590)")
    d.add_argument("--started-at", type=float, metavar="EPOCH",
                   help="when that clock started, in seconds since the epoch (default: now; make demo passes the time "
                        "it was run, before installing)")
    d.add_argument("--max-steps", type=_integer, action=_PositiveInt)
    d.add_argument("--eval-n", type=_integer, action=_PositiveInt,
                   help="held-out prompts evaluated before and after (default 128)")
    d.add_argument("--seed", type=int)
    d.add_argument("--set", action="append", metavar="KEY=VALUE")
    d.add_argument("--quiet", action="store_true")
    d.add_argument("--resume", nargs="?", const="auto", metavar="PATH|auto",
                   help="continue an interrupted demo from its latest checkpoint (or PATH)")
    _run_dir_flags(d)
    d.set_defaults(func=cmd_demo)

    e = sub.add_parser("eval", help="mean reward and accuracy (95%% CI) of a model on a task's held-out prompts")
    e.add_argument("--model", required=True, help="model id, directory, or a run's final/ adapter directory")
    e.add_argument("--task", required=True)
    e.add_argument("-n", type=_integer, action=_PositiveInt, default=128)
    e.add_argument("--max-new-tokens", type=_integer, action=_PositiveInt, default=48)
    e.add_argument("--sample", action="store_true", help="sample at temperature 0.7 instead of greedy")
    e.add_argument("--tokenizer")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_eval)

    v = sub.add_parser("vllm-serve", help="start vLLM's OpenAI server for vllm_mode='server' (weight and adapter "
                                          "sync included; a CPU too: docs/vllm.md)")
    v.add_argument("--model", required=True, help="the trainer's model: a built-in name, a directory or a hub id")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=_integer, action=_PositiveInt, default=8000)
    v.add_argument("--dtype", default="auto", help="the engine's dtype (auto, bfloat16, float32, ...)")
    v.add_argument("--rollout-precision", default="auto", metavar="{auto,float32,bf16,int8}",
                   help="the trainer's rollout_precision: the engine's dtype, and for int8 its 8-bit weights "
                        "(vLLM's fp8_per_channel); overrides --dtype")
    v.add_argument("--max-model-len", type=_integer, action=_PositiveInt, default=1024)
    v.add_argument("--enable-lora", action="store_true", help="load LoRA adapters at runtime (vllm_lora_sync)")
    v.add_argument("--max-lora-rank", type=_integer, action=_PositiveInt, default=16)
    v.add_argument("--python", default=sys.executable,
                   help="the Python that has vLLM, e.g. a virtual environment of its own (default: this one)")
    v.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: more of vLLM's own flags")
    v.set_defaults(func=cmd_vllm_serve)

    ls = sub.add_parser("tasks", help="list built-in tasks and algorithm recipes")
    ls.set_defaults(func=cmd_tasks)
    return p


def _run_dir_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run in output_dir (its checkpoints, final model, report, metrics)")
    p.add_argument("--force", action="store_true",
                   help="with --resume: continue even though the model, batch shape, generations or loss changed")


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # "Generating train split" bars
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in ("transformers", "accelerate", "peft", "bitsandbytes", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    from .machine.reproducible import reproducible_blas

    reproducible_blas()  # before anything multiplies: MKL takes the setting once (grpokit/machine/reproducible.py)
    _quiet_libraries()
    parser = build_parser()
    ns = parser.parse_args(argv)
    from .bounds.user_calls import CallTimeout, RunStopped
    from .run.job_spec import JobError, TrainingInterrupted

    try:
        return ns.func(ns)
    except JobError as e:
        print(f"grpokit: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except TrainingInterrupted as e:
        again = f"grpokit train {ns.config} --resume" if ns.command == "train" else "the same command with --resume"
        print(f"grpokit: interrupted by {e.signal_name} at step {e.step}; checkpoint saved to {e.checkpoint}; "
              f"continue with: {again}", file=sys.stderr)
        return 128 + e.signum
    except (FloatingPointError, RunStopped, CallTimeout) as e:
        print(f"grpokit: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except Exception as e:
        if type(e).__name__ == "DiskFullError":  # a checkpoint: the message says what is intact
            print(f"grpokit: error: {_one_line(e)} (with --resume)", file=sys.stderr)
            return 1
        from .run.files import is_disk_full

        if not is_disk_full(e):
            raise
        filename = getattr(e, "filename", None)
        where = f" (writing {filename})" if filename else ""
        print(f"grpokit: error: no space left on device{where}; files grpokit writes are replaced whole or not at all, "
              "so nothing half-written is left: free some space, then continue with --resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("grpokit: interrupted", file=sys.stderr)
        return 130


MAX_MESSAGE = 600
"""Characters of an error message the CLI prints: a value echoed in it (a multi-MB string) never floods the screen."""


def _one_line(error: BaseException) -> str:
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 40] + f" ... [{len(text)} characters]"


def entry_point() -> None:
    """The ``grpokit`` command and ``python -m grpokit.cli``: :func:`main`, then an exit that a launched rank
    survives (grpokit/bounds/process_group.py)."""
    from .bounds.process_group import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry_point()
