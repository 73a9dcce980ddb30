"""Built-in reward functions: plain and conversational completions, near misses, None, threads."""

from __future__ import annotations

import threading
import time

import pytest

from grpokit.rewards import (
    FORMAT_REWARD,
    completion_text,
    correctness,
    count_words,
    format_reward,
    length,
    make_length_reward,
    word_count,
)


def conv(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


# --------------------------------------------------------------------------- correctness


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("11 + 16 = 27. Answer: 27.", "27", 1.0),
        ("Answer: 27", "27", 1.0),
        ("Let me think.\nAnswer: 27\n", "27", 1.0),
        ("Answer: 27.", "27.5", 0.0),  # "27." is 27 followed by a full stop
        ("Answer: 27.5", "27", 0.0),
        ("Answer: 27.5", "27.5", 1.0),
        ("Answer: 26", "27", 0.0),
        ("Answer: -3", "-3", 1.0),
        ("Answer: 3", "-3", 0.0),
        ("Answer: 1,234", "1234", 1.0),
        ("Answer: 0.5", "1/2", 1.0),
        ("answer: 27", "27", 1.0),  # correctness is lenient about case; format is not
        ("**Answer:** 27", "27", 1.0),
        ("Answer: $27$", "27", 1.0),
        ("Answer: \\boxed{27}", "27", 1.0),
        ("Answer: 27 apples", "27", 1.0),  # graded by math-verify
        ("Answer: \\frac{1}{2}", "0.5", 1.0),  # graded by math-verify
        ("Answer: 20\nNo wait.\nAnswer: 27", "27", 1.0),  # the last Answer: counts
        ("Answer: 27\nActually, Answer: 26", "27", 0.0),
        ("The sum is 27.", "27", 0.0),  # no Answer: line, no credit
        ("", "27", 0.0),
        ("Answer:", "27", 0.0),
        ("Answer: <number>", "27", 0.0),
        ("Answer: twenty-seven", "27", 0.0),
    ],
)
def test_correctness_plain(completion, answer, expected):
    assert correctness(prompts=["q"], completions=[completion], answer=[answer]) == [expected]


def test_correctness_conversational_and_batch():
    completions = [conv("11 + 16 = 27. Answer: 27."), conv("Answer: 26"), conv("no idea")]
    out = correctness(prompts=[[{"role": "user", "content": "q"}]] * 3, completions=completions, answer=["27"] * 3)
    assert out == [1.0, 0.0, 0.0]


def test_correctness_none_answer_gives_none():
    assert correctness(completions=["Answer: 1", "Answer: 2"], answer=[None, "2"]) == [None, 1.0]


def test_correctness_needs_answer_column():
    with pytest.raises(ValueError, match="answer"):
        correctness(prompts=["q"], completions=["Answer: 1"])
    with pytest.raises(ValueError, match="2 values"):
        correctness(prompts=["q"], completions=["Answer: 1"], answer=["1", "2"])


def test_correctness_accepts_trl_keywords():
    out = correctness(
        prompts=["q"], completions=["Answer: 4"], completion_ids=[[1, 2]], trainer_state=object(),
        answer=["4"], log_metric=None, log_extra=None, other_column=["x"],
    )  # fmt: skip
    assert out == [1.0]


def test_correctness_refuses_expensive_expressions_quickly():
    start = time.perf_counter()
    out = correctness(completions=["Answer: 9^9^9^9", "Answer: 99!!!", "Answer: 9**9**9"], answer=["1", "1", "1"])
    assert out == [0.0, 0.0, 0.0]
    assert time.perf_counter() - start < 2.0


def test_correctness_from_threads():
    """math-verify's default timeouts use signals, which only work in the main thread; ours must not."""
    results: list = []
    errors: list = []

    def work():
        try:
            results.append(
                correctness(completions=["Answer: 27 apples", "Answer: \\frac{3}{4}"], answer=["27", "0.75"])
            )
        except Exception as error:  # pragma: no cover - the failure being tested
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == [[1.0, 1.0]] * 4


def test_correctness_fast_path_is_fast():
    completions = ["11 + 16 = 27. Answer: 27."] * 64
    start = time.perf_counter()
    for _ in range(10):
        correctness(completions=completions, answer=["27"] * 64)
    per_call = (time.perf_counter() - start) / 640
    assert per_call < 1e-3  # measured ~10 µs per completion


# --------------------------------------------------------------------------- format


@pytest.mark.parametrize(
    "completion, ok",
    [
        ("11 + 16 = 27. Answer: 27.", True),
        ("Some working.\nAnswer: 27", True),
        ("Answer: 27\n", True),
        ("Answer: -3.", True),
        ("Answer: 27.5", True),
        ("Answer: 1,234", True),
        ("Answer: 27 apples", False),
        ("Answer: 27\nHope that helps!", False),
        ("answer: 27", False),
        ("Answer: <number>", False),
        ("Answer: $27$", False),
        ("FinalAnswer: 27", False),
        ("27", False),
        ("", False),
    ],
)
def test_format(completion, ok):
    expected = FORMAT_REWARD if ok else 0.0
    assert format_reward(completions=[completion]) == [expected]
    assert format_reward(completions=[conv(completion)]) == [expected]


def test_format_value_and_name():
    assert FORMAT_REWARD == 0.2
    assert format_reward.__name__ == "format"
    assert correctness.__name__ == "correctness"


# --------------------------------------------------------------------------- length / word_count


def test_count_words():
    assert count_words("The sea is deep.") == 4
    assert count_words("Don't stop, well-known 42 cats!") == 5
    assert count_words("  ") == 0
    assert count_words("— , . !") == 0


def test_word_count_and_length():
    completions = ["one two three four five", "one two three four five six", "one " * 50]
    targets = [5, 5, 5]
    assert word_count(completions=completions, target_words=targets) == [1.0, 0.0, 0.0]
    scores = length(completions=[conv(c) for c in completions], target_words=targets)
    assert scores[0] == 1.0
    assert scores[1] == pytest.approx(5 / 6)
    assert scores[2] == pytest.approx(0.1)
    # graded: too long replies still differ, so a group of all-wrong replies has a gradient
    assert length(completions=["a " * 20, "a " * 30], target_words=[5, 5])[0] > length(
        completions=["a " * 30], target_words=[5]
    )[0]


def test_length_none_target_and_missing_column():
    assert length(completions=["a b"], target_words=[None]) == [None]
    with pytest.raises(ValueError, match="target_words"):
        length(completions=["a b"])
    with pytest.raises(ValueError, match="target_words"):
        word_count(completions=["a b"])


def test_make_length_reward():
    brevity = make_length_reward(max_words=10)
    assert brevity.__name__ == "brevity"
    assert brevity(completions=["", "a b c d e", "a " * 20]) == [1.0, 0.5, 0.0]
    tokens = make_length_reward(max_tokens=4, name="short")
    assert tokens.__name__ == "short"
    assert tokens(completions=["x", "y"], completion_ids=[[1], [1, 2, 3, 4]]) == [0.75, 0.0]
    with pytest.raises(ValueError, match="exactly one"):
        make_length_reward()
    with pytest.raises(ValueError, match="positive"):
        make_length_reward(max_words=0)


# --------------------------------------------------------------------------- completion_text


def test_completion_text_shapes():
    assert completion_text("plain") == "plain"
    assert completion_text(None) == ""
    assert completion_text([{"role": "assistant", "content": "a"}]) == "a"
    assert completion_text({"role": "assistant", "content": "a"}) == "a"
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "a"}]}]) == "a"
    assert completion_text([{"role": "tool", "content": "x"}, {"role": "assistant", "content": "b"}]) == "b"
