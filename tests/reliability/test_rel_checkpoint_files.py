"""Checkpoint files: written atomically (a kill mid-write leaves the previous checkpoint intact and is never resumed
from), rotated without counting unfinished ones, and checked before a resume (a damaged file is named)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from hang import HANG_S
from reliability_helpers import FaultyPart, LoadGuard, make_trainer

from grpokit.cli import main
from grpokit.run.checkpoints import resolve_resume, verify_checkpoint
from grpokit.run.run_dir import CheckpointError, latest_checkpoint, list_checkpoints

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished run with checkpoints at steps 1 and 2 (copied by each test that damages one)."""
    out = tmp_path_factory.mktemp("run") / "out"
    make_trainer(out, max_steps=2, save_strategy="steps", save_steps=1).train()
    return out


def copy_run(run_dir, tmp_path) -> Path:
    dst = tmp_path / "out"
    shutil.copytree(run_dir, dst)
    return dst


def test_checkpoints_are_complete_and_safetensors(run_dir):
    assert [p.name for p in list_checkpoints(run_dir)] == ["checkpoint-1", "checkpoint-2"]
    for p in list_checkpoints(run_dir):
        files = {f.name for f in p.iterdir()}
        assert {"model.safetensors", "trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state.pth"} <= files
        assert not files & {"pytorch_model.bin"}  # weights never pickled
        assert verify_checkpoint(p) == int(p.name.split("-")[1])
    assert not [p for p in run_dir.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_a_failure_mid_write_leaves_the_previous_checkpoint(tmp_path):
    """An exception inside the save: the staging directory is removed and checkpoint-1 stays the latest. What a real
    kill leaves behind (a ``checkpoint-2.tmp-<pid>`` directory, see the SIGKILL test below) is never resumed from
    and is cleared by the next save."""
    def die():
        raise SystemExit("killed while writing")

    dies_on_step_2 = FaultyPart(die, when=lambda step: step == 2)
    trainer = make_trainer(tmp_path / "out", max_steps=2, save_strategy="steps", save_steps=1, extra_part=dies_on_step_2)
    dies_on_step_2.trainer = trainer
    with pytest.raises(SystemExit):
        trainer.train()
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-1"]
    assert latest_checkpoint(out).name == "checkpoint-1" and verify_checkpoint(out / "checkpoint-1") == 1

    leftover = out / "checkpoint-2.tmp-424242"  # what a SIGKILL mid-save leaves: a partial copy
    shutil.copytree(out / "checkpoint-1", leftover)
    (leftover / "optimizer.pt").unlink()
    assert resolve_resume("auto", out) == str(out / "checkpoint-1")
    with pytest.raises(CheckpointError, match="unfinished"):
        verify_checkpoint(leftover)

    resumed = make_trainer(out, max_steps=3, save_strategy="steps", save_steps=1)
    resumed.train(resume_from_checkpoint="auto")
    assert resumed.state.global_step == 3
    assert not leftover.exists()
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_sigkill_during_a_save_in_a_child_process(tmp_path):
    """A real SIGKILL while checkpoint-2 is being written (the child stalls inside the save)."""
    out = tmp_path / "out"
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = [{str(TESTS)!r}, {str(TESTS.parent)!r}]
        from reliability_helpers import FaultyPart, make_trainer
        def stall():
            print("WRITING", flush=True)
            time.sleep(60)
        stalls_on_step_2 = FaultyPart(stall, when=lambda step: step == 2)
        trainer = make_trainer({str(out)!r}, max_steps=3, save_strategy="steps", save_steps=1,
                               extra_part=stalls_on_step_2)
        stalls_on_step_2.trainer = trainer
        trainer.train()
    """))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        deadline = time.monotonic() + HANG_S
        line = ""
        while time.monotonic() < deadline and "WRITING" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert "WRITING" in line, proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    names = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint"))
    assert names == ["checkpoint-1", f"checkpoint-2.tmp-{proc.pid}"]
    assert latest_checkpoint(out).name == "checkpoint-1"
    assert verify_checkpoint(out / "checkpoint-1") == 1
    # the next run's first save clears the dead process's leftovers
    trainer = make_trainer(out, max_steps=2, save_strategy="steps", save_steps=1)
    trainer.train(resume_from_checkpoint="auto")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-1", "checkpoint-2"]


def test_rotation_ignores_and_clears_unfinished_checkpoints(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    stale = out / "checkpoint-9.tmp-999999999"  # a dead writer's leftover (no such pid)
    (stale / "sub").mkdir(parents=True)
    trainer = make_trainer(out, max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=2)
    trainer.train()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-3", "checkpoint-4"]


def test_saving_the_same_step_twice_replaces_it(tmp_path):
    trainer = make_trainer(tmp_path / "out", max_steps=1, save_strategy="steps", save_steps=1)
    trainer.train()
    first = (tmp_path / "out" / "checkpoint-1" / "trainer_state.json").stat().st_mtime_ns
    time.sleep(0.01)
    trainer.save_checkpoint()
    assert (tmp_path / "out" / "checkpoint-1" / "trainer_state.json").stat().st_mtime_ns > first
    assert verify_checkpoint(tmp_path / "out" / "checkpoint-1") == 1
    assert not [p for p in (tmp_path / "out").iterdir() if ".old-" in p.name or ".tmp-" in p.name]


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


DAMAGES = [
    ("model_truncated", lambda c: truncate(c / "model.safetensors"), "model.safetensors is damaged", "truncated"),
    ("model_header_only", lambda c: truncate(c / "model.safetensors", 0.001), "model.safetensors is damaged", ""),
    ("model_missing", lambda c: (c / "model.safetensors").unlink(), "holds no model weights", "model.safetensors"),
    ("state_truncated", lambda c: truncate(c / "trainer_state.json"), "trainer_state.json is damaged",
     "not valid JSON"),
    ("state_missing", lambda c: (c / "trainer_state.json").unlink(), "trainer_state.json is missing", ""),
    ("state_no_step", lambda c: (c / "trainer_state.json").write_text("{}"), "trainer_state.json is damaged",
     "global_step"),
    ("optimizer_truncated", lambda c: truncate(c / "optimizer.pt"), "optimizer.pt is damaged", "torch.save"),
    ("rng_truncated", lambda c: truncate(c / "rng_state.pth", 0.9), "rng_state.pth is damaged", ""),
    ("scheduler_empty", lambda c: (c / "scheduler.pt").write_bytes(b""), "scheduler.pt is damaged", ""),
    ("config_garbage", lambda c: (c / "config.json").write_text("{oops"), "config.json is damaged", ""),
]


@pytest.mark.parametrize("case,damage,message,detail", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_a_damaged_checkpoint_names_the_file(run_dir, tmp_path, case, damage, message, detail):
    out = copy_run(run_dir, tmp_path)
    ckpt = out / "checkpoint-2"
    damage(ckpt)
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(ckpt)
    assert message in str(e.value) and detail in str(e.value) and str(ckpt) in str(e.value)
    trainer = make_trainer(out, max_steps=3)
    with pytest.raises(CheckpointError, match=message):
        trainer.train(resume_from_checkpoint=str(ckpt))
    with pytest.raises(CheckpointError, match=message):  # auto picks the latest and does not skip it silently
        trainer.train(resume_from_checkpoint="auto")


def test_corruption_inside_a_torch_file_is_caught_by_its_checksum(run_dir, tmp_path):
    """Damage that keeps the file's length and zip directory (bytes zeroed inside optimizer.pt's tensor data):
    torch.load would read it without complaint; the CRC-32 of the zip entry does not match."""
    out = copy_run(run_dir, tmp_path)
    opt = out / "checkpoint-2" / "optimizer.pt"
    data = bytearray(opt.read_bytes())
    import zipfile

    with zipfile.ZipFile(opt) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    name_len = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], "little")
    extra_len = int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len  # the local header's own lengths
    data[start:start + 64] = bytes(64)  # zero the start of the biggest tensor: its CRC no longer matches
    opt.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optimizer\.pt is damaged: entry .* does not match its CRC-32"):
        verify_checkpoint(out / "checkpoint-2")
    trainer = make_trainer(out, max_steps=3)
    with pytest.raises(CheckpointError, match=r"optimizer\.pt"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))


def test_a_loader_failure_is_wrapped_with_the_checkpoint(run_dir, tmp_path, monkeypatch):
    """What the checks cannot foresee (here: torch.load fails) still names the checkpoint and the files."""
    out = copy_run(run_dir, tmp_path)
    real_load = torch.load

    def failing_load(f, *a, **k):
        if str(f).endswith("optimizer.pt"):
            raise RuntimeError("PytorchStreamReader failed reading file data/0: invalid header")
        return real_load(f, *a, **k)

    monkeypatch.setattr(torch, "load", failing_load)
    trainer = make_trainer(out, max_steps=3)
    with pytest.raises(CheckpointError, match=r"optimizer or scheduler state in .*checkpoint-2 \(optimizer\.pt"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))


def test_cli_resume_of_a_damaged_checkpoint_is_one_line(run_dir, tmp_path, monkeypatch, capsys):
    out = copy_run(run_dir, tmp_path)
    truncate(out / "checkpoint-2" / "model.safetensors")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": "never-loaded", "task": "arithmetic", "output_dir": str(out),
                                   "per_device_train_batch_size": 4, "num_generations": 4}))
    guard = LoadGuard(monkeypatch)
    for flag in (["--resume"], ["--resume", str(out / "checkpoint-2")]):
        assert main(["train", str(cfg), *flag]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err
        assert f"{out / 'checkpoint-2' / 'model.safetensors'} is damaged" in err
    assert guard.calls == []


def test_resume_true_without_checkpoint_is_an_error_and_auto_starts_fresh(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        resolve_resume(True, tmp_path)
    assert resolve_resume("auto", tmp_path) is None
    trainer = make_trainer(tmp_path / "fresh", max_steps=1)
    trainer.train(resume_from_checkpoint="auto")
    assert trainer.state.global_step == 1


def test_a_deepspeed_engine_checkpoint_counts_as_weights(tmp_path):
    """ZeRO-3 without 16-bit gathering on save keeps the weights in DeepSpeed's own files: ``latest`` names the tag
    directory with every rank's model states (the full two-process resume: tests/distributed/test_sharded.py)."""
    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text('{"global_step": 3}')
    with pytest.raises(CheckpointError, match="holds no model weights"):
        verify_checkpoint(ckpt)
    (ckpt / "latest").write_text("global_step3")
    with pytest.raises(CheckpointError, match="holds no model states"):
        verify_checkpoint(ckpt)
    (ckpt / "global_step3").mkdir()
    torch.save({"module": {}}, ckpt / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert verify_checkpoint(ckpt) == 3
    states = ckpt / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[:40])  # truncated: named like any other damaged file
    with pytest.raises(CheckpointError, match="zero_pp_rank_0_mp_rank_00_model_states.pt"):
        verify_checkpoint(ckpt)
