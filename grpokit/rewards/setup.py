"""The trainer's reward sources put together: the user's reward functions (by object or name) and environments'
``get_reward``, each reward model's tokenizer, the names they are logged under, their weights, and the reward process
the user's functions score in when ``reward_process`` is on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import transformers

from ..validation import refusal
from .registry import check_reward_weights, resolve_reward_funcs, reward_func_name


@dataclass
class Rewards:
    """The reward functions the trainer scores with (the user's, then environments' ``get_reward``), their tokenizers
    (reward models), the names they are logged under and their weights (one more, 1.0, for DAPO's overlong penalty
    column)."""

    funcs: list
    processing_classes: list
    names: list[str]
    weights: torch.Tensor
    process: Any = None
    """The reward process the user's functions score in (``reward_process=True``: grpokit/rewards/process.py)."""


def setup_rewards(reward_funcs, reward_processing_classes, args, multiturn) -> Rewards:
    extra = multiturn.reward_funcs() if multiturn is not None else []  # environments' get_reward
    if reward_funcs is None or (isinstance(reward_funcs, (list, tuple)) and not reward_funcs):
        if not extra:
            raise ValueError("No reward source provided: pass reward_funcs, or an environment_factory whose "
                             "environments have a get_reward() method")
        user = []
    else:
        user = resolve_reward_funcs(reward_funcs)
    check_reward_weights(args.reward_weights, [reward_func_name(f) for f in user])
    funcs = user + extra
    if reward_processing_classes is None:
        reward_processing_classes = [None] * len(user)
    elif not isinstance(reward_processing_classes, (list, tuple)):
        reward_processing_classes = [reward_processing_classes]
    if len(reward_processing_classes) != len(user):
        raise ValueError(
            f"reward_processing_classes has {len(reward_processing_classes)} entries for "
            f"{len(user)} reward functions: the lengths must match (None for a reward function that is not a model)"
        )
    processing_classes = [_reward_tokenizer(func, proc) for func, proc in
                          zip(funcs, list(reward_processing_classes) + [None] * len(extra))]
    weights = list(args.reward_weights or [1.0] * len(user)) + [1.0] * len(extra)
    if args.overlong_buffer_length is not None:
        weights.append(1.0)  # the overlong penalty enters as one more reward column
    names = [reward_func_name(f) for f in funcs]
    funcs, process = _in_reward_process(funcs, len(user), args, multiturn)
    return Rewards(funcs, processing_classes, names, torch.tensor(weights, dtype=torch.float32), process)


def _in_reward_process(funcs: list, n_user: int, args, multiturn) -> tuple[list, Any]:
    """With ``reward_process``: the user's reward functions (not reward models, which stay on the trainer's device)
    replaced by their stand-ins in one reward process (grpokit/rewards/process.py), after checking each can cross."""
    from .process import ProcessReward, RewardProcess, check_picklable, default_memory_mb

    moved = [i for i, f in enumerate(funcs[:n_user]) if not isinstance(f, torch.nn.Module)]
    if not args.reward_process or not moved:
        return funcs, None
    if multiturn is not None and multiturn.environments is not None:
        raise refusal("reward_process", True, "reward functions receive the environment instances (environments=), "
                      "which live in the trainer's process; use reward_process=False", when="with environment_factory")
    check_picklable([funcs[i] for i in moved])
    memory = args.worker_memory_mb if args.worker_memory_mb is not None else default_memory_mb()
    process = RewardProcess([funcs[i] for i in moved], memory)
    out = list(funcs)
    for k, i in enumerate(moved):
        out[i] = ProcessReward(funcs[i], k, process)
    return out, process


def _reward_tokenizer(func, proc):
    """A reward model's tokenizer (loaded with it when not given), padded; the model learns its pad token."""
    if isinstance(func, torch.nn.Module) and proc is None:
        proc = transformers.AutoTokenizer.from_pretrained(func.config._name_or_path)
    if proc is not None and proc.pad_token_id is None:
        proc.pad_token = proc.eos_token
    if isinstance(func, torch.nn.Module) and proc is not None:
        # the reward is read at the last non-padding token: the model must know which token pads
        config = func.config.get_text_config() if hasattr(func.config, "get_text_config") else func.config
        config.pad_token_id = proc.pad_token_id
    return proc
