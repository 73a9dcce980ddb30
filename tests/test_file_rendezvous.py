"""The file rendezvous a stalled run's ranks meet through (grpokit/run/file_rendezvous.py)."""

from __future__ import annotations

import threading

import pytest

from grpokit.run.file_rendezvous import FileRendezvous, RendezvousTimeout, remove_stale_rendezvous


def test_every_rank_gets_every_rank_s_value_once_all_have_arrived(tmp_path):
    where = tmp_path / ".stall-rendezvous-3"
    got = {}

    def rank(r):
        got[r] = FileRendezvous(where, r, 3, timeout_s=60).wait("vote", f"from {r}" if r else "")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {r: {0: "", 1: "from 1", 2: "from 2"} for r in range(3)}


def test_a_rank_that_does_not_come_is_named_within_the_bound(tmp_path):
    meeting = FileRendezvous(tmp_path / "m", 0, 3, timeout_s=0.2)
    FileRendezvous(tmp_path / "m", 2, 3, timeout_s=0.2).directory.joinpath("vote-2").write_text("")
    with pytest.raises(RendezvousTimeout, match=r"^rank 1 did not reach 'vote' within 0.2 s$") as e:
        meeting.wait("vote")
    assert e.value.missing == [1]


def test_closing_removes_the_meeting_place_once_every_rank_is_done(tmp_path):
    where = tmp_path / "run" / ".stall-rendezvous-1"
    main, other = FileRendezvous(where, 0, 2, timeout_s=5), FileRendezvous(where, 1, 2, timeout_s=5)
    other.close()
    main.close()
    assert not where.exists()


def test_a_killed_run_s_meeting_place_is_removed_at_the_next_start(tmp_path):
    (tmp_path / ".stall-rendezvous-7").mkdir()
    (tmp_path / ".stall-rendezvous-7" / "vote-0").write_text("")
    (tmp_path / "checkpoint-7").mkdir()
    remove_stale_rendezvous(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-7"]
