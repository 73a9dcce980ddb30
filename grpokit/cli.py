"""``grpokit train | demo | eval | tasks``: the command line.

Wrong input (config values, unknown keys, unknown tasks or rewards, missing files, a damaged checkpoint) is
printed in one line without a traceback and exits with status 2. A first SIGINT (Ctrl-C) or SIGTERM during
training finishes the current step, saves a checkpoint and exits with 128 + the signal number (130, 143);
``grpokit train CONFIG --resume`` continues from it. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

DEMO_SPEC: dict[str, Any] = {
    "model": "smollm2-135m-instruct",
    "task": "arithmetic",
    "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
    "eval": {"n": 128, "before": True, "after": True, "max_new_tokens": 48, "greedy": True},
    "time_budget_s": 540,
    "learning_rate": 1e-4,
    "lr_scheduler_type": "constant",
    "per_device_train_batch_size": 8,
    "num_generations": 8,
    "max_completion_length": 48,
    "temperature": 0.7,
    "beta": 0.0,
    "gradient_checkpointing": False,
    "max_steps": 200,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "seed": 0,
    "use_cpu": True,
}
"""The demo: LoRA on the embedded SmolLM2-135M, the arithmetic task, ~6 s a step on a 2-core CPU
(docs/demo.md: this recipe took greedy held-out accuracy from 1.6% to 71–75% with TRL in 10 minutes)."""


def _parse_set(pairs: list[str]) -> dict[str, Any]:
    import yaml

    from .job import JobError

    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise JobError(f"--set {pair!r} is not key=value")
        key, value = pair.split("=", 1)
        out[key.strip()] = yaml.safe_load(value) if value != "" else None
    return out


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

    from .job import JobError

    p = Path(path)
    if not p.is_file():
        raise JobError(f"config file {path!r} does not exist")
    try:
        data = yaml.load(p.read_text(), Loader=_unique_key_loader())
    except yaml.YAMLError as e:
        raise JobError(f"config file {path!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        raise JobError(f"config file {path!r} is empty")
    if not isinstance(data, dict):
        raise JobError(f"config file {path!r} must hold a mapping of field: value, got {type(data).__name__}")
    return data


def cmd_train(ns: argparse.Namespace) -> int:
    from .job import run_job

    spec = _load_yaml(ns.config)
    spec.update(_parse_set(ns.set or []))
    if ns.output_dir:
        spec["output_dir"] = ns.output_dir
    run_job(spec, quiet=ns.quiet, resume=ns.resume)
    return 0


def cmd_demo(ns: argparse.Namespace) -> int:
    from .job import algorithms, run_job

    spec = dict(DEMO_SPEC)
    spec.update(algorithms()[ns.algo])
    spec["output_dir"] = ns.output_dir
    if ns.time_budget is not None:
        spec["time_budget_s"] = ns.time_budget
    if ns.max_steps is not None:
        spec["max_steps"] = ns.max_steps
    if ns.eval_n is not None:
        spec["eval"] = {**spec["eval"], "n": ns.eval_n}
    if ns.seed is not None:
        spec["seed"] = ns.seed
    spec.update(_parse_set(ns.set or []))
    print(f"grpokit demo: {ns.algo} on SmolLM2-135M-Instruct (LoRA), task 'arithmetic', "
          f"training for at most {spec['time_budget_s']} s → {ns.output_dir}", flush=True)
    run_job(spec, quiet=ns.quiet, resume=ns.resume)
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    from .evaluation import evaluate
    from .job import JobError
    from .models import load_tokenizer
    from .tasks import get_task

    try:
        task = get_task(ns.task)
    except (ValueError, FileNotFoundError) as e:
        raise JobError(str(e)) from None
    if task.eval_dataset is None:
        raise JobError(f"task {ns.task!r} has no held-out split")
    model = _load_for_eval(ns.model)
    tok = load_tokenizer(ns.tokenizer or _tokenizer_source(ns.model))
    summary, samples = evaluate(model, tok, task.eval_dataset, task.reward_funcs, accuracy_reward=task.accuracy_reward,
                                n=ns.n, max_new_tokens=ns.max_new_tokens, greedy=not ns.sample)
    from .job import _eval_line

    print(_eval_line(ns.model, summary))
    if ns.json:
        print(json.dumps(summary, indent=2))
    return 0


def _tokenizer_source(model_path: str) -> str:
    cfg = Path(model_path) / "adapter_config.json"
    if cfg.is_file():  # a LoRA adapter saved by a run: the tokenizer sits beside it, else on the base model
        if (Path(model_path) / "tokenizer_config.json").is_file():
            return model_path
        return json.loads(cfg.read_text()).get("base_model_name_or_path") or model_path
    return model_path


def _load_for_eval(path: str):
    from .models import load_model

    cfg = Path(path) / "adapter_config.json"
    if cfg.is_file():
        from peft import PeftModel

        base = json.loads(cfg.read_text()).get("base_model_name_or_path")
        return PeftModel.from_pretrained(load_model(base), path).eval()
    return load_model(path).eval()


def cmd_tasks(ns: argparse.Namespace) -> int:
    from .job import algorithms
    from .tasks import list_tasks

    print("tasks:", ", ".join(list_tasks()))
    print("algorithms (--algo):", ", ".join(algorithms()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .job import algorithms

    p = argparse.ArgumentParser(prog="grpokit", description="GRPO-family RL fine-tuning of language models.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train from a YAML config (every GRPOConfig field, plus model/task/...)")
    t.add_argument("config")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    t.add_argument("--output-dir")
    t.add_argument("--quiet", action="store_true", help="log lines only, no live progress bar")
    t.add_argument("--resume", nargs="?", const="auto", metavar="PATH|auto",
                   help="continue from a checkpoint directory, or 'auto' (the default when the flag has no value): "
                        "the latest checkpoint in output_dir, or a fresh start when there is none")
    t.set_defaults(func=cmd_train)

    d = sub.add_parser("demo", help="train the embedded SmolLM2-135M on arithmetic (CPU, ~10 minutes)")
    d.add_argument("--algo", choices=list(algorithms()), default="grpo")
    d.add_argument("--output-dir", default="runs/demo")
    d.add_argument("--time-budget", type=float, help="seconds of training (default 540)")
    d.add_argument("--max-steps", type=int)
    d.add_argument("--eval-n", type=int, help="held-out prompts evaluated before and after (default 128)")
    d.add_argument("--seed", type=int)
    d.add_argument("--set", action="append", metavar="KEY=VALUE")
    d.add_argument("--quiet", action="store_true")
    d.add_argument("--resume", nargs="?", const="auto", metavar="PATH|auto",
                   help="continue an interrupted demo from its latest checkpoint (or PATH)")
    d.set_defaults(func=cmd_demo)

    e = sub.add_parser("eval", help="mean reward and accuracy (95%% CI) of a model on a task's held-out prompts")
    e.add_argument("--model", required=True, help="model id, directory, or a run's final/ adapter directory")
    e.add_argument("--task", required=True)
    e.add_argument("-n", type=int, default=128)
    e.add_argument("--max-new-tokens", type=int, default=48)
    e.add_argument("--sample", action="store_true", help="sample at temperature 0.7 instead of greedy")
    e.add_argument("--tokenizer")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_eval)

    ls = sub.add_parser("tasks", help="list built-in tasks and algorithm recipes")
    ls.set_defaults(func=cmd_tasks)
    return p


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in ("transformers", "accelerate", "peft", "bitsandbytes", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    parser = build_parser()
    ns = parser.parse_args(argv)
    from .job import JobError, TrainingInterrupted

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
    except FloatingPointError as e:
        print(f"grpokit: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("grpokit: interrupted", file=sys.stderr)
        return 130


def _one_line(error: BaseException) -> str:
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
