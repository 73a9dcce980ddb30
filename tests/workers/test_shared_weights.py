"""Weights through shared memory (grpokit/pipeline/workers/weights.py, shared.py): a worker reads the newest complete
publication, never a torn one; pickling with tensors in shared memory keeps tied weights tied; what cannot cross into
a worker is named before the model loads."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest
import torch

from grpokit.pipeline.workers.crossing import check_crossing, why_not_crossing
from grpokit.pipeline.workers.shared import dump_shared, load_shared
from grpokit.pipeline.workers.weights import WeightSlots


def tensors(value: float) -> dict[str, torch.Tensor]:
    return {"a.weight": torch.full((3, 5), float(value)), "b.bias": torch.full((7,), value, dtype=torch.bfloat16),
            "c": torch.full((2, 2), int(value), dtype=torch.int64)}


def zeros_like(ts):
    return {n: torch.zeros_like(t) for n, t in ts.items()}


def test_a_reader_gets_the_newest_complete_publication():
    slots = WeightSlots.create(tensors(0))
    into = zeros_like(tensors(0))
    assert slots.read(into, newer_than=-1) is None  # nothing published yet
    slots.write(1, tensors(1))
    slots.write(2, tensors(2))
    slots.write(3, tensors(3))
    assert slots.versions() in ([3, 2], [2, 3])
    assert slots.read(into, newer_than=0) == 3
    assert all(torch.equal(into[n], t) for n, t in tensors(3).items())
    assert slots.read(into, newer_than=3) is None  # nothing newer: left as it is
    assert slots.bytes_per_publication == 15 * 4 + 7 * 2 + 4 * 8


def test_a_publication_torn_mid_write_is_never_read():
    """The learner dies half-way through copying version 3: its slot stays odd (being written) and a reader keeps
    loading version 2, whole; the next complete publication is read as usual."""
    slots = WeightSlots.create(tensors(0))
    slots.write(1, tensors(1))
    slots.write(2, tensors(2))
    copied = []

    def dies_after_one(dest, source):
        if copied:
            raise KeyboardInterrupt  # the learner killed mid-write
        copied.append(1)
        dest.copy_(source)

    with pytest.raises(KeyboardInterrupt):
        slots.write(3, tensors(3), copy=dies_after_one)
    assert sorted(slots.versions()) == [-1, 2]
    into = zeros_like(tensors(0))
    assert slots.read(into, newer_than=0) == 2
    assert all(torch.equal(into[n], t) for n, t in tensors(2).items())
    slots.write(4, tensors(4))  # into the torn slot (it counts as empty)
    assert slots.read(into, newer_than=2) == 4 and torch.equal(into["a.weight"], tensors(4)["a.weight"])


def test_a_read_overtaken_by_two_writes_reads_again():
    """The learner publishes twice while a reader copies a slot: the second write overwrites that slot, the reader
    sees its counter move and reads again, getting one whole version and never a mix."""
    slots = WeightSlots.create(tensors(0))
    slots.write(1, tensors(1))
    into = zeros_like(tensors(0))
    real_copy, calls = torch.Tensor.copy_, []

    class Interleaved(dict):
        def __getitem__(self, name):
            target = dict.__getitem__(self, name)
            if not calls:
                calls.append(name)
                slots.write(2, tensors(2))  # into the other slot
                slots.write(3, tensors(3))  # into the slot being read
            return target

    wrapped = Interleaved(into)
    version = slots.read(wrapped, newer_than=0)
    assert version == 3 and calls
    assert all(torch.equal(into[n], t) for n, t in tensors(3).items())
    assert real_copy is torch.Tensor.copy_


def test_another_process_reads_what_the_learner_published():
    slots = WeightSlots.create(tensors(0))
    slots.write(5, tensors(5))
    layout = [(n, str(d).removeprefix("torch."), s) for n, d, s in slots.layout]
    code = ("import torch; from grpokit.pipeline.workers.weights import WeightSlots;"
            f"s = WeightSlots.attach([(n, getattr(torch, d), sh) for n, d, sh in {layout!r}], {slots.shared.fd});"
            "into = {n: torch.zeros(sh, dtype=d) for n, d, sh in s.layout};"
            "v = s.read(into, newer_than=0); print(v, float(into['a.weight'].sum()), float(into['b.bias'].float().sum()))")
    out = subprocess.run([sys.executable, "-c", code], pass_fds=(slots.shared.fd,), capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["5", str(5.0 * 15), str(5.0 * 7)]


def test_pickling_with_tensors_in_shared_memory_keeps_ties_and_parameters():
    lin = torch.nn.Linear(4, 4)
    emb = torch.nn.Embedding(4, 4)
    emb.weight = lin.weight  # tied
    frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    blob, arena, offsets = dump_shared({"lin": lin, "emb": emb, "frozen": frozen, "plain": torch.arange(5),
                                        "n": 3}, "test")
    assert len(blob) < 4096  # the tensors are not in the pickle
    got = load_shared(blob, arena, offsets)
    assert got["emb"].weight is got["lin"].weight and isinstance(got["lin"].weight, torch.nn.Parameter)
    assert torch.equal(got["lin"].weight, lin.weight) and torch.equal(got["plain"], torch.arange(5))
    assert not got["frozen"].requires_grad and got["lin"].bias.requires_grad and got["n"] == 3
    got["plain"][0] = 7  # a private copy: the shared memory is not written
    assert int(load_shared(blob, arena, offsets)["plain"][0]) == 0
    arena.close()


PLAIN = {"bonus": 0.5}


def locked_reward():
    lock = threading.Lock()

    def closes_over_a_lock(completions, **kw):
        with lock:
            return [0.0] * len(completions)

    return closes_over_a_lock


def test_what_cannot_cross_is_named():
    assert why_not_crossing(lambda completions, **kw: [PLAIN["bonus"]] * len(completions)) is None
    bonus = 0.25
    assert why_not_crossing(lambda completions, **kw: [bonus] * len(completions)) is None  # a closure over plain data
    assert "holds a lock" in why_not_crossing(locked_reward())
    sock = socket.socket()
    try:
        def uses_a_socket(completions, **kw):
            return [float(sock.fileno())] * len(completions)

        why = why_not_crossing(uses_a_socket)
        assert why is not None and "socket" in why
    finally:
        sock.close()


def test_a_reward_that_cannot_cross_is_refused_before_the_model_loads(tmp_path):
    from runs import run_args

    from grpokit.trainer import GRPOTrainer

    args = run_args(tmp_path, rollout_workers=1)
    with pytest.raises(ValueError, match=r"^reward_funcs\[1\] \('closes_over_a_lock'\) cannot cross into a rollout "
                                         r"worker process \(rollout_workers=1\): it holds a lock \(_thread.lock\)"):
        GRPOTrainer("no/such/model", [lambda completions, **kw: [1.0] * len(completions), locked_reward()],
                    args=args, train_dataset=[{"prompt": "a"}] * 8)
    with pytest.raises(ValueError, match="rollout_workers=1 is not allowed with a rollout_func"):
        check_crossing(args, [], None, None, lambda prompts, trainer: None, None)


def test_config_lines():
    from grpokit.config import GRPOConfig

    for kw, line in [({"rollout_workers": -1}, "rollout_workers=-1 is not allowed"),
                     ({"rollout_workers": 1, "staleness_mode": "exact"},
                      "staleness_mode='exact' is not allowed with rollout_workers=1: use 'bounded'"),
                     ({"rollout_workers": 2, "use_vllm": True}, "use_vllm=True is not allowed with rollout_workers=2"),
                     ({"rollout_workers": 1, "routing_replay": "old"},
                      "routing_replay='old' is not allowed with rollout_workers=1")]:
        with pytest.raises(ValueError, match=line.replace("(", r"\(").replace(")", r"\)")):
            GRPOConfig(output_dir="/tmp/x", **kw)
