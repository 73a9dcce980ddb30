"""Reward classes a config can name with their arguments (``{LLMJudge: {base_url: ..., ...}}``): each registers
itself with :func:`reward_class` where it is defined; :mod:`grpokit.rewards.registry` builds them from a config."""

from __future__ import annotations

REWARD_CLASSES: dict[str, type] = {}
"""The registered reward classes, by class name."""


def reward_class(cls: type) -> type:
    """Class decorator: a reward class a config can name with its arguments, ``{ClassName: {option: value}}``."""
    if REWARD_CLASSES.get(cls.__name__, cls) is not cls:
        raise ValueError(f"A reward class named {cls.__name__!r} is already registered.")
    REWARD_CLASSES[cls.__name__] = cls
    return cls
