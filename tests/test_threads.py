"""Torch's thread count follows the free cores (grpokit/machine/threads.py)."""

import pytest
import torch

from grpokit.machine import threads


@pytest.fixture
def restore_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("GRPOKIT_NUM_THREADS", raising=False)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("cores,load,start,expected", [
    (2, 0.1, 2, None),   # quiet: unchanged
    (2, 1.0, 2, 1),      # one other busy process on two cores
    (2, 3.7, 2, 1),      # never below one
    (16, 4.4, 16, 12),
    (4, 1.0, 2, None),   # already fewer threads than free cores
])
def test_threads_fit_the_free_cores(monkeypatch, restore_threads, cores, load, start, expected):
    monkeypatch.setattr(threads, "free_cores", lambda: (cores, load))
    torch.set_num_threads(start)
    said = threads.fit_torch_threads()
    if expected is None:
        assert said is None and torch.get_num_threads() == start
    else:
        assert torch.get_num_threads() == expected
        assert f"using {expected} torch thread" in said and "GRPOKIT_NUM_THREADS" in said


def test_the_users_choice_wins(monkeypatch, restore_threads):
    monkeypatch.setattr(threads, "free_cores", lambda: (2, 1.5))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    assert threads.fit_torch_threads() is None and torch.get_num_threads() == 2
    monkeypatch.setenv("GRPOKIT_NUM_THREADS", "1")
    assert threads.fit_torch_threads() is None and torch.get_num_threads() == 1
    monkeypatch.setenv("GRPOKIT_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="GRPOKIT_NUM_THREADS='many' is not allowed"):
        threads.fit_torch_threads()
