"""grpokit.bounds.watchdog: the stage board (nested stages per thread, described in one line, every start and end counted
as progress) and the watchdog thread (one report per stall, again after each further stall_s, none while things
move)."""

from __future__ import annotations

import threading

from grpokit.bounds.watchdog import StageBoard, Watchdog


def test_stages_nest_per_thread_and_are_described():
    board = StageBoard()
    assert "no thread is in a rollout stage" in board.describe()
    inside, leave = threading.Event(), threading.Event()

    def producer():
        with board.stage("scoring", function="'judge'"):
            inside.set()
            leave.wait(60)

    t = threading.Thread(target=producer, name="grpokit-rollout-producer")
    with board.stage("generation"), board.stage("tool", function="'search'", row=3):
        t.start()
        assert inside.wait(60)
        text = board.describe()
        assert board.innermost(threading.get_ident()) == "tool"
    assert "MainThread: generation > tool (function 'search', row 3) for 0 s" in text
    assert "grpokit-rollout-producer: scoring (function 'judge') for 0 s" in text
    assert list(board.snapshot()) == ["grpokit-rollout-producer"]  # the main thread left its stages
    leave.set()
    t.join(60)
    assert board.snapshot() == {} and board.innermost(threading.get_ident()) is None


def test_every_stage_start_and_end_is_progress():
    board = StageBoard()
    board.last_progress = 0.0
    with board.stage("generation"):
        started = board.last_progress
        assert started > 0.0
    assert board.last_progress >= started


def test_a_stall_is_reported_once_per_stall_s_and_never_while_progressing():
    board = StageBoard()
    stalls: list[float] = []
    dog = Watchdog(10.0, stalls.append, board=board)
    board.last_progress = 100.0
    assert not dog.check(now=109.9) and stalls == []
    assert dog.check(now=110.0) and stalls == [10.0]
    assert not dog.check(now=119.9)  # the same stall, reported less than stall_s ago
    assert dog.check(now=120.0) and stalls == [10.0, 20.0]
    board.last_progress = 121.0  # progress: the clock restarts
    assert not dog.check(now=130.9) and dog.check(now=131.0) and stalls[-1] == 10.0


def test_the_watchdog_thread_reports_and_stops():
    board = StageBoard()
    stalled = threading.Event()
    dog = Watchdog(0.1, lambda idle: stalled.set(), board=board, poll_s=0.01)
    dog.start()
    try:
        assert stalled.wait(60), "the watchdog thread never reported a stall"
    finally:
        dog.stop()
    assert dog._thread is None
