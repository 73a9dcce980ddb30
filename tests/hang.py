"""How long a test waits before calling something hung, and a call that hangs for tests of the time bounds.

These bounds catch hangs only: they are far above what the work takes on a slow, loaded 2-core machine (the
longest, a two-process ZeRO-3 run, takes about a minute on a quiet one), so no test fails for being slow."""

from __future__ import annotations

import threading

HANG_S = 1800

HANG_GUARD_S = 300
"""How long a :class:`Hang` blocks at most: a bound that never fires fails the test after this, never hangs it."""


class Hang:
    """A function that blocks until :meth:`release` (a user function that never returns, as far as a time bound of a
    few seconds can tell). If it is still blocked after :data:`HANG_GUARD_S` the bound under test never fired: it
    raises an ``AssertionError`` saying so, so the test fails instead of hanging. ``result``: what it returns once
    released; ``calls`` counts its calls."""

    def __init__(self, result=None, name: str = "hang"):
        self.result = result
        self.calls = 0
        self._released = threading.Event()
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if not self._released.wait(HANG_GUARD_S):
            raise AssertionError(f"{self.__name__} was still waiting after {HANG_GUARD_S} s: the time bound under test "
                                 "never abandoned it")
        return self.result(*args, **kwargs) if callable(self.result) else self.result

    def release(self) -> None:
        self._released.set()
