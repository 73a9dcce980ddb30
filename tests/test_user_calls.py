"""grpokit.bounds.user_calls: a bounded call returns, raises, or is abandoned past its bound (and keeps running, discarded);
an abandoned call's object is busy until it ends; at most MAX_ABANDONED run at once; coroutines are cancelled at
their bound; several calls share one bound. Every hanging function here is a tests/hang.py Hang: if a bound never
fires the test fails after HANG_GUARD_S instead of hanging."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from hang import Hang

from grpokit.bounds import user_calls
from grpokit.bounds.user_calls import CallBounds, CallTimeout, Incidents, call, call_many, gather, is_busy

BOUND = 0.2  # seconds, for calls that hang: short, so the tests are quick
ROOMY = 60  # seconds, for calls that must return: no test depends on how fast the machine is


@pytest.fixture
def hang():
    h = Hang(result="late")
    yield h
    h.release()


def wait_until(condition, what: str, limit: float = 60.0) -> None:
    end = time.monotonic() + limit
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {limit} s")
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def no_abandoned_call_left_from_other_files():
    """These tests count the process's abandoned calls: one left running by another file on this worker (the
    reliability battery abandons a reward that sleeps 30 s) ends first."""
    wait_until(lambda: not user_calls.abandoned_running(), "the end of calls abandoned before this test")


def test_a_call_within_its_bound_returns_or_raises_as_it_is():
    assert call(lambda a, b=0: a + b, args=(2,), kwargs={"b": 3}, timeout_s=ROOMY, what="add") == 5

    def boom():
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        call(boom, timeout_s=ROOMY, what="boom")


def test_without_a_bound_the_call_runs_in_the_callers_thread():
    assert call(threading.get_ident, timeout_s=None, what="ident") == threading.get_ident()
    assert call(threading.get_ident, timeout_s=ROOMY, what="ident") != threading.get_ident()


def test_a_hanging_call_is_abandoned_named_and_discarded(hang):
    with pytest.raises(CallTimeout) as e:
        call(hang, timeout_s=BOUND, what="reward function 'judge'", where=" on rows 0-3 of 4")
    assert str(e.value) == f"reward function 'judge' did not return within {BOUND:g} s on rows 0-3 of 4"
    assert e.value.seconds == BOUND and hang.calls == 1
    assert [what for what, _ in user_calls.abandoned_running()] == ["reward function 'judge'"]
    hang.release()  # it ends by itself later: its result ("late") is dropped, and it is no longer counted
    wait_until(lambda: not user_calls.abandoned_running(), "the abandoned call's end")


def test_an_abandoned_calls_object_is_busy_until_it_ends(hang):
    class Env:
        def step(self):
            return hang()

        def look(self) -> str:
            return "fine"

    env, other = Env(), Env()
    with pytest.raises(CallTimeout):
        call(env.step, timeout_s=BOUND, what="tool 'step'", owner=env)
    assert is_busy(env) and not is_busy(other)
    with pytest.raises(CallTimeout, match="was not called: an earlier call on the same Env timed out and is still run"):
        call(env.look, timeout_s=BOUND, what="tool 'look'", owner=env)
    with pytest.raises(CallTimeout, match="was not called"):  # unbounded calls too
        call(env.look, timeout_s=None, what="tool 'look'", owner=env)
    assert call(other.look, timeout_s=ROOMY, what="tool 'look'", owner=other) == "fine"
    assert call(env.look, timeout_s=ROOMY, what="tool 'look'") == "fine"  # without an owner nothing is refused
    hang.release()
    wait_until(lambda: not is_busy(env), "the environment becoming free")
    assert call(env.look, timeout_s=ROOMY, what="tool 'look'", owner=env) == "fine"


def test_at_most_max_abandoned_calls_run(hang, monkeypatch):
    monkeypatch.setattr(user_calls, "MAX_ABANDONED", 2)
    for _ in range(2):
        with pytest.raises(CallTimeout, match="did not return"):
            call(hang, timeout_s=BOUND, what="tool 'slow'")
    ran = []
    with pytest.raises(CallTimeout, match="2 calls that timed out are still running in the background"):
        call(lambda: ran.append(1), timeout_s=BOUND, what="tool 'quick'")
    assert ran == [] and hang.calls == 2
    hang.release()
    wait_until(lambda: not user_calls.abandoned_running(), "the abandoned calls' end")
    assert call(lambda: 7, timeout_s=ROOMY, what="tool 'quick'") == 7


def test_coroutines_are_cancelled_at_their_bound_and_their_own_timeouts_stay_theirs():
    cancelled = threading.Event()

    async def forever():
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    with pytest.raises(CallTimeout, match="did not return within"):
        call(forever, timeout_s=BOUND, what="tool 'forever'")
    assert cancelled.wait(60) and not user_calls.abandoned_running()  # cancelled, not abandoned

    async def own_timeout():
        raise TimeoutError("the remote said no")

    with pytest.raises(TimeoutError, match="the remote said no"):
        call(own_timeout, timeout_s=ROOMY, what="tool 'remote'")

    async def add(a):
        await asyncio.sleep(0)
        return a + 1

    assert call(add, args=(1,), timeout_s=ROOMY, what="tool 'add'") == 2
    assert call(add, args=(1,), timeout_s=None, what="tool 'add'") == 2


def test_gather_runs_coroutines_together_each_within_the_bound(hang):
    async def ok():
        return 1.0

    async def raises():
        raise ValueError("bad")

    async def sleeps():
        await asyncio.sleep(3600)

    async def blocks_the_loop():  # a synchronous wait inside async def: the loop itself is stuck
        hang()

    out = gather([ok(), raises(), sleeps()], BOUND, ["a", "b", "c"], " on the batch")
    assert out[0] == 1.0 and isinstance(out[1], ValueError)
    assert isinstance(out[2], CallTimeout) and str(out[2]) == f"c did not return within {BOUND:g} s on the batch"
    out = gather([blocks_the_loop(), sleeps()], BOUND, ["a", "b"])  # a blocked loop runs nothing else either
    assert [type(x).__name__ for x in out] == ["CallTimeout", "CallTimeout"]
    assert gather([ok()], None, ["a"]) == [1.0]


def test_call_many_shares_one_bound_and_keeps_order_when_asked(hang):
    out = call_many([hang, hang], BOUND, ["h1", "h2"], [" row 0", " row 1"])
    assert [type(x).__name__ for x in out] == ["CallTimeout", "CallTimeout"]
    assert str(out[1]) == f"h2 did not return within {BOUND:g} s row 1"  # the bound, not what was left of it
    out = call_many([lambda: 3, lambda: 1 / 0], ROOMY, ["three", "div"])
    assert out[0] == 3 and isinstance(out[1], ZeroDivisionError)
    order = []
    out = call_many([lambda i=i: order.append(i) or i for i in range(5)], ROOMY, ["f"] * 5, concurrent=False)
    assert out == list(range(5)) and order == list(range(5))


def test_the_call_gets_the_callers_grad_mode():
    with torch.no_grad():
        assert call(torch.is_grad_enabled, timeout_s=ROOMY, what="f") is False
    assert call(torch.is_grad_enabled, timeout_s=ROOMY, what="f") is True


def test_incidents_and_bounds():
    a, b = Incidents(), Incidents()
    a.count("tools/timeout_total")
    b.count("tools/timeout_total", 2)
    bounds = CallBounds()
    b.stop("first cause", bounds)
    b.stop("second cause", bounds)
    a.merge(b)
    assert a.counts == {"tools/timeout_total": 3.0} and a.stop_cause == "first cause" and bounds.stopping
    assert (CallBounds().reward_timeout_s, CallBounds().tool_timeout_s) == (300.0, 60.0)
