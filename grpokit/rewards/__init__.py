"""Reward functions (TRL's calling convention), the registry that names them, and the scoring of completions.

>>> from grpokit.rewards import get_reward_func
>>> get_reward_func("correctness")(prompts=None, completions=["2 + 2 = 4. Answer: 4."], answer=["4"])
[1.0]

Built-ins: ``correctness`` (1.0 for the right final ``Answer:``), ``format`` (0.2 for ending with
``Answer: <number>``), ``length`` (graded closeness to a ``target_words`` column) and
``word_count`` (1.0 for exactly ``target_words`` words). Any other function is reachable as
``"package.module:function"``; :func:`resolve_reward_funcs` also takes reward models (a directory or hub id of a
sequence-classification model). :func:`score_completions` calls them on a batch.

Scoring services (docs/rewards.md): :class:`LLMJudge` (a chat model behind an OpenAI-compatible endpoint grades each
completion), :class:`CodeExecution` (the completion's code run against the row's tests in a sandbox) and
:class:`RemoteRewardModel` (a reward model served over HTTP); a config names them as ``{LLMJudge: {...}}``.
"""

from .answers import answers_match, extract_answer, extract_gsm8k_answer, parse_number
from .builtin import (
    FORMAT_REWARD,
    completion_text,
    correctness,
    count_words,
    format_reward,
    length,
    make_length_reward,
    word_count,
)
from .classes import reward_class
from .code_execution import CodeExecution
from .judge import LLMJudge
from .registry import (
    REWARD_CLASSES,
    REWARD_FUNCS,
    check_reward_weights,
    get_reward_func,
    list_reward_funcs,
    register_reward_func,
    resolve_reward_funcs,
    reward_from_mapping,
    reward_func_name,
)
from .remote_model import RemoteRewardModel
from .service import HttpRewardService, RewardServiceError


def __getattr__(name):  # scoring needs torch; the rest of the package does not (a job's spec is checked without it)
    if name in ("RewardFunctionError", "score_completions"):
        from . import scoring

        return getattr(scoring, name)
    raise AttributeError(f"module 'grpokit.rewards' has no attribute {name!r}")


__all__ = [
    "FORMAT_REWARD",
    "REWARD_CLASSES",
    "REWARD_FUNCS",
    "CodeExecution",
    "HttpRewardService",
    "LLMJudge",
    "RemoteRewardModel",
    "RewardFunctionError",
    "RewardServiceError",
    "answers_match",
    "check_reward_weights",
    "completion_text",
    "correctness",
    "count_words",
    "extract_answer",
    "extract_gsm8k_answer",
    "format_reward",
    "get_reward_func",
    "length",
    "list_reward_funcs",
    "make_length_reward",
    "parse_number",
    "register_reward_func",
    "resolve_reward_funcs",
    "reward_class",
    "reward_func_name",
    "reward_from_mapping",
    "score_completions",
    "word_count",
]
