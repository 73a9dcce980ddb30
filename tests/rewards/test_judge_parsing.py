"""Reading a judge's reply as a score (numbers in a range, labels, JSON fields) and the Retry-After header, against
hand-worked cases."""

import email.utils
import time

import pytest

from grpokit.rewards.judge_parsing import ScoreRule, find_json_object, label_score, parse_score
from grpokit.rewards.service import ResponseCache, retry_after_seconds

NUMBER = ScoreRule().check("t")
RAW = ScoreRule(score_range=(1, 5), normalize=False).check("t")


@pytest.mark.parametrize("reply,expected", [
    ("8", 0.8), ("Score: 7/10", 0.7), ("I'd give it 10.", 1.0), ("0", 0.0), ("  2.5 ", 0.25),
    ("Score: 11", None), ("-1", None), ("no number here", None), ("", None), (None, None), ("1e1", 1.0),
])
def test_numbers_normalised_into_the_range(reply, expected):
    assert parse_score(reply, NUMBER) == (None if expected is None else pytest.approx(expected))


def test_raw_numbers_and_a_pattern():
    assert parse_score("3", RAW) == 3.0 and parse_score("6", RAW) is None
    rule = ScoreRule(pattern=r"Final score:\s*(\d+)").check("t")
    assert parse_score("On a scale of 1-10... Final score: 9", rule) == pytest.approx(0.9)
    assert parse_score("On a scale of 1-10, nine", rule) is None


def test_labels_the_last_one_wins_and_the_longer_at_the_same_end():
    labels = {"correct": 1.0, "incorrect": 0.0, "not correct": 0.0}
    assert label_score("Incorrect at first glance. Verdict: correct", labels) == 1.0
    assert label_score("Verdict: NOT CORRECT", labels) == 0.0
    assert label_score("It is incorrect.", labels) == 0.0
    assert label_score("correctness unclear", labels) is None  # whole words only
    assert parse_score("yes", ScoreRule(labels={"yes": 1, "no": -1}).check("t")) == 1.0


def test_json_objects_whole_fenced_or_inline():
    assert find_json_object('{"score": 4}') == {"score": 4}
    assert find_json_object('Here:\n```json\n{"a": 1}\n```\nand\n```json\n{"b": 2}\n```') == {"b": 2}
    assert find_json_object('My verdict {"score": 3, "why": "ok"} done') == {"score": 3, "why": "ok"}
    assert find_json_object("{not json} {\"x\": 1}") == {"x": 1}
    assert find_json_object("[1, 2]") is None and find_json_object("none") is None
    rule = ScoreRule(json_field="score", score_range=(0, 5)).check("t")
    assert parse_score('{"score": 5}', rule) == 1.0
    assert parse_score('{"score": "4"}', rule) == pytest.approx(0.8)
    assert parse_score('{"score": true}', rule) is None and parse_score('{"other": 1}', rule) is None
    assert parse_score('{"score": "high"}', rule) is None
    labelled = ScoreRule(json_field="verdict", labels={"pass": 1.0, "fail": 0.0}).check("t")
    assert parse_score('{"verdict": "fail"}', labelled) == 0.0


def test_retry_after_forms():
    assert retry_after_seconds({"retry-after": "2"}) == 2.0
    assert retry_after_seconds({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    date = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 20 <= retry_after_seconds({"retry-after": date}) <= 31
    assert retry_after_seconds({"retry-after": "soon"}) is None and retry_after_seconds({}) is None
    assert retry_after_seconds({"retry-after": "-3"}) is None and retry_after_seconds(None) is None


def test_the_cache_drops_the_least_recently_used():
    cache = ResponseCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == (True, 1)
    cache.put("c", 3)
    assert cache.get("b") == (False, None) and cache.get("a") == (True, 1) and len(cache) == 2
    off = ResponseCache(0)
    off.put("a", 1)
    assert off.get("a") == (False, None)
