"""Answer extraction and comparison, and the reward registry."""

from __future__ import annotations

import sys
import textwrap
from fractions import Fraction

import pytest

from grpokit.rewards import (
    REWARD_FUNCS,
    answers_match,
    correctness,
    extract_answer,
    extract_gsm8k_answer,
    format_reward,
    get_reward_func,
    list_reward_funcs,
    parse_number,
    register_reward_func,
)


@pytest.mark.parametrize(
    "text, value",
    [
        ("27", Fraction(27)),
        ("27.", Fraction(27)),
        (" **27** ", Fraction(27)),
        ("$-3$", Fraction(-3)),
        ("−3", Fraction(-3)),
        ("1,234", Fraction(1234)),
        ("27.5", Fraction(55, 2)),
        ("3/4", Fraction(3, 4)),
        (42, Fraction(42)),
        (0.5, Fraction(1, 2)),
        ("27 apples", None),
        ("1/0", None),
        ("", None),
        (None, None),
        (True, None),
        (float("nan"), None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Answer: 27", "27"),
        ("x\nAnswer: 27.\nmore", "27."),
        ("Answer: 1\nAnswer: 2", "2"),
        ("**Answer:** 27", "27"),
        ("ANSWER : 5", "5"),
        ("no marker", None),
        ("Answer:   ", None),
        (None, None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "gold, expected",
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("#### -5", "-5"),
        ("  42  ", "42"),
        ("\\frac{1}{2}", "\\frac{1}{2}"),
        (42, "42"),
        (42.0, "42"),
        (2.5, "2.5"),
        (float("nan"), None),
        (None, None),
    ],
)
def test_extract_gsm8k_answer(gold, expected):
    assert extract_gsm8k_answer(gold) == expected


def test_answers_match():
    assert answers_match("27", 27)
    assert answers_match("27.0", "27")
    assert not answers_match("27", "28")
    assert not answers_match(None, "1")
    assert not answers_match("1", None)
    assert answers_match("$\\frac{1}{2}$", "0.5")
    assert not answers_match("x" * 200, "1")  # long text never reaches sympy


@pytest.mark.parametrize("predicted,gold", [("14 - 12", "2"), ("4 + 6", 10), ("11+20", "31"), ("3 \\times 4", "12"),
                                            ("2*3", "6"), ("(2)(3)-0+6", "6")])
def test_an_unevaluated_expression_is_not_a_numeric_answer(predicted, gold):
    """The arithmetic demo's policy learned to answer "Answer: 14 - 12" and let math-verify compute it (100%
    "accuracy" with no arithmetic done): for a numeric gold answer, the grader does not evaluate expressions."""
    assert not answers_match(predicted, gold)


@pytest.mark.parametrize("predicted,gold", [("10", "10"), ("$10$", "10"), ("-12", "-12"), ("10.", "10"),
                                            ("1,234", "1234"), ("1/2", "0.5"), ("\\frac{1}{2}", "0.5"),
                                            ("27 apples", "27")])
def test_numbers_in_other_notations_still_match(predicted, gold):
    assert answers_match(predicted, gold)


def test_the_arithmetic_reward_refuses_the_echoed_question():
    completions = [[{"role": "assistant", "content": "Answer: 14 - 12"}], [{"role": "assistant", "content": "Answer: 2"}]]
    assert correctness(completions=completions, answer=["2", "2"]) == [0.0, 1.0]


# --------------------------------------------------------------------------- registry


def test_builtin_names():
    assert {"correctness", "format", "length", "word_count"} <= set(list_reward_funcs())
    for name, func in REWARD_FUNCS.items():
        assert func.__name__ == name
    assert get_reward_func("correctness") is correctness
    assert get_reward_func("format") is format_reward
    assert get_reward_func(correctness) is correctness


def test_get_reward_func_spec(tmp_path, monkeypatch):
    module = tmp_path / "my_rewards_mod.py"
    module.write_text(
        textwrap.dedent(
            """
            def exclaim(prompts, completions, **kwargs):
                return [1.0 if str(c).endswith("!") else 0.0 for c in completions]
            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        func = get_reward_func("my_rewards_mod:exclaim")
        assert func(prompts=None, completions=["hi!", "hi"]) == [1.0, 0.0]
        assert get_reward_func("grpokit.rewards.builtin:correctness") is correctness
        with pytest.raises(ValueError, match="no attribute 'missing'"):
            get_reward_func("my_rewards_mod:missing")
        with pytest.raises(ValueError, match="not a function"):
            get_reward_func("my_rewards_mod:NOT_CALLABLE")
    finally:
        sys.modules.pop("my_rewards_mod", None)


@pytest.mark.parametrize("bad", ["correctnes", "no_such_module_xyz:f", ":f", "mod:", "", None, 3])
def test_get_reward_func_errors(bad):
    with pytest.raises(ValueError) as info:
        get_reward_func(bad)
    message = str(info.value)
    assert repr(bad) in message or (isinstance(bad, str) and bad.strip() in message)


def test_unknown_name_lists_builtins():
    with pytest.raises(ValueError, match="correctness.*format"):
        get_reward_func("accuracy")


def test_register_reward_func():
    def shouting(prompts=None, completions=None, **kwargs):
        return [float(str(c).isupper()) for c in completions]

    try:
        assert register_reward_func(shouting) is shouting
        assert get_reward_func("shouting") is shouting
        register_reward_func(shouting)  # same function again: fine
        with pytest.raises(ValueError, match="already registered"):
            register_reward_func(lambda **k: [], name="shouting")
    finally:
        REWARD_FUNCS.pop("shouting", None)
