"""Nothing a user saved is lost between runs that share an output directory (grpokit/run/run_dir.py).

A fresh run never replaces an earlier run's checkpoints, final model or report unless asked (``--overwrite`` /
``overwrite_output_dir``); two runs never write into one directory at once; a resume with settings that change what
the checkpoint means is refused with the differences listed unless forced; a full disk during a save leaves nothing
half-written and the previous checkpoint intact. Through the Python API and through ``grpokit train``."""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from hang import HANG_S
from reliability_helpers import make_trainer

from grpokit.cli import main
from grpokit.run.checkpoints import DiskFullError, verify_checkpoint
from grpokit.run.run_dir import (
    LOCK_FILE,
    CheckpointError,
    ResumeMismatch,
    RunDirBusy,
    RunDirOccupied,
    latest_checkpoint,
    list_checkpoints,
)

RUN_DIR_CASES = [
    "api: fresh run into earlier checkpoints refused, nothing touched",
    "api: overwrite_output_dir replaces the earlier run",
    "api: resume with num_generations changed refused",
    "api: resume with the batch shape changed refused",
    "api: resume with the loss changed refused",
    "api: forced resume continues",
    "api: damaged run signature refused",
    "api: output directory locked by another process",
    "api: full disk during a save",
    "cli: fresh run into an earlier job refused, report and final model kept",
    "cli: --overwrite replaces the earlier job",
    "cli: output directory locked by another process",
    "cli: resume with num_generations changed refused, --force continues",
    "cli: full disk during a save",
    "cli: full disk of a real small file system during a save (safetensors' own error)",
    "files: a full disk recognised from each writer's error (OSError, safetensors, torch.save)",
    "cli: damaged eval_before.json re-measured on resume",
    "cli: the demo's default directory never replaces an earlier demo",
]


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` (but the lock) and its content hash."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


@pytest.fixture(scope="module")
def earlier(tmp_path_factory):
    """An earlier API run with checkpoints at steps 1 and 2 (each test copies it)."""
    out = tmp_path_factory.mktemp("earlier") / "out"
    make_trainer(out, max_steps=2, save_strategy="steps", save_steps=1).train()
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "out"
    shutil.copytree(run, dst)
    return dst


# -- the Python API ----------------------------------------------------------------------------------------------
def test_api_fresh_run_into_earlier_checkpoints_is_refused(earlier, tmp_path):
    out = copy_of(earlier, tmp_path)
    before = tree_digest(out)
    with pytest.raises(RunDirOccupied) as e:
        make_trainer(out, max_steps=1, save_strategy="steps", save_steps=1).train()
    msg = str(e.value)
    assert "holds an earlier run (checkpoint-1, checkpoint-2)" in msg
    assert "resume_from_checkpoint='auto'" in msg and "overwrite_output_dir=True" in msg
    assert tree_digest(out) == before


def test_api_overwrite_output_dir_replaces_the_earlier_run(earlier, tmp_path):
    out = copy_of(earlier, tmp_path)
    make_trainer(out, max_steps=1, save_strategy="steps", save_steps=1, overwrite_output_dir=True).train()
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1"]  # checkpoint-2 of the earlier run is gone
    assert verify_checkpoint(out / "checkpoint-1") == 1


@pytest.mark.parametrize("change,shown", [
    ({"num_generations": 2}, "num_generations: 4 → 2"),
    ({"per_device_train_batch_size": 8}, "per_device_train_batch_size: 4 → 8"),
    ({"loss_type": "grpo"}, "loss_type: 'dapo' → 'grpo'"),
], ids=["generations", "batch", "loss"])
def test_api_resume_with_changed_meaning_is_refused(earlier, tmp_path, change, shown):
    out = copy_of(earlier, tmp_path)
    before = tree_digest(out)
    trainer = make_trainer(out, max_steps=3, save_strategy="steps", save_steps=1, **change)
    with pytest.raises(ResumeMismatch) as e:
        trainer.train(resume_from_checkpoint="auto")
    assert shown in str(e.value) and "force_resume=True" in str(e.value) and "checkpoint-2" in str(e.value)
    assert tree_digest(out) == before


def test_api_forced_resume_continues(earlier, tmp_path):
    out = copy_of(earlier, tmp_path)
    trainer = make_trainer(out, max_steps=3, save_strategy="steps", save_steps=1, loss_type="grpo")
    trainer.train(resume_from_checkpoint="auto", force_resume=True)
    assert trainer.state.global_step == 3 and verify_checkpoint(latest_checkpoint(out)) == 3


def test_api_damaged_signature_is_refused(earlier, tmp_path):
    out = copy_of(earlier, tmp_path)
    (out / "checkpoint-2" / "grpokit_run.json").write_text('{"num_gen')
    with pytest.raises(CheckpointError, match="grpokit_run.json is damaged"):
        make_trainer(out, max_steps=3, save_strategy="steps", save_steps=1).train(resume_from_checkpoint="auto")


def hold_lock(directory: Path) -> subprocess.Popen:
    """Another process holding ``directory``'s run lock until killed."""
    directory.mkdir(parents=True, exist_ok=True)
    code = ("import fcntl, sys, time\n"
            f"f = open({str(directory / LOCK_FILE)!r}, 'a+')\n"
            "fcntl.flock(f.fileno(), fcntl.LOCK_EX)\n"
            "f.seek(0); f.truncate(); f.write('pid 424242 on elsewhere since today'); f.flush()\n"
            "print('HELD', flush=True)\n"
            "time.sleep(3600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "HELD"
    return proc


def test_api_a_locked_output_dir_is_refused(tmp_path):
    out = tmp_path / "out"
    proc = hold_lock(out)
    try:
        with pytest.raises(RunDirBusy) as e:
            make_trainer(out, max_steps=1, save_strategy="steps", save_steps=1).train()
    finally:
        proc.kill()
        proc.wait(timeout=HANG_S)
    assert "is in use by another run (pid 424242 on elsewhere since today)" in str(e.value)
    assert list_checkpoints(out) == []
    make_trainer(out, max_steps=1, save_strategy="steps", save_steps=1).train()  # free again once it ended
    assert verify_checkpoint(out / "checkpoint-1") == 1


def fill_the_disk_at_step(monkeypatch, step: int) -> None:
    """Writing the optimizer state of checkpoint ``step`` (``torch.save``, as transformers writes it) fails with ENOSPC
    half-way, after the weights were written."""
    original = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and str(f).endswith(f"checkpoint-{step}{os.sep}optimizer.pt"):
            Path(f).write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return original(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def test_api_a_full_disk_during_a_save(monkeypatch, tmp_path):
    out = tmp_path / "out"
    fill_the_disk_at_step(monkeypatch, 2)
    trainer = make_trainer(out, max_steps=3, save_strategy="steps", save_steps=1)
    with pytest.raises(DiskFullError) as e:
        trainer.train()
    assert "no space left" in str(e.value) and "checkpoint-2" in str(e.value) and "checkpoint-1 is intact" in str(e.value)
    assert sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE) == ["checkpoint-1"]  # no staging left
    assert verify_checkpoint(out / "checkpoint-1") == 1


# -- the command line ----------------------------------------------------------------------------------------------
def job_config(tmp_path: Path, tiny_dir: Path, out: Path, **over) -> Path:
    spec = {
        "model": str(tiny_dir), "task": "arithmetic", "output_dir": str(out), "per_device_train_batch_size": 4,
        "num_generations": 4, "max_completion_length": 6, "max_steps": 2, "logging_steps": 1,
        "save_strategy": "steps", "save_steps": 1, "report_to": "none", "gradient_checkpointing": False,
        "use_cpu": True, "learning_rate": 1e-3, "eval": {"n": 4, "max_new_tokens": 6},
    }
    spec.update(over)
    cfg = tmp_path / f"job{len(list(tmp_path.glob('job*.yaml')))}.yaml"
    cfg.write_text(yaml.safe_dump(spec))
    return cfg


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpokit: error:") and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def earlier_job(tmp_path_factory, tiny_dir):
    """A finished ``grpokit train`` job: checkpoints, final model, report, metrics, eval_before.json."""
    base = tmp_path_factory.mktemp("earlier_job")
    out = base / "out"
    assert main(["train", str(job_config(base, tiny_dir, out)), "--quiet"]) == 0
    assert (out / "final").is_dir() and (out / "report.json").is_file()
    return out


def test_cli_fresh_run_into_an_earlier_job_is_refused(earlier_job, tmp_path, tiny_dir, capsys):
    out = copy_of(earlier_job, tmp_path)
    before = tree_digest(out)
    capsys.readouterr()
    assert main(["train", str(job_config(tmp_path, tiny_dir, out, learning_rate=1e-2)), "--quiet"]) == 2
    err = one_line_error(capsys)
    assert "holds an earlier run (checkpoint-1, checkpoint-2, final, report.json" in err
    assert "--resume" in err and "--overwrite" in err
    assert tree_digest(out) == before


def test_cli_overwrite_replaces_the_earlier_job(earlier_job, tmp_path, tiny_dir):
    out = copy_of(earlier_job, tmp_path)
    old_report = json.loads((out / "report.json").read_text())
    cfg = job_config(tmp_path, tiny_dir, out, max_steps=1)
    assert main(["train", str(cfg), "--quiet", "--overwrite"]) == 0
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1"]
    report = json.loads((out / "report.json").read_text())
    assert report != old_report
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert set(steps) == {1}  # the earlier job's metrics (steps 1 and 2) are not mixed in


def test_cli_a_locked_output_dir_is_refused(tmp_path, tiny_dir, capsys):
    out = tmp_path / "out"
    proc = hold_lock(out)
    try:
        capsys.readouterr()
        assert main(["train", str(job_config(tmp_path, tiny_dir, out)), "--quiet"]) == 2
    finally:
        proc.kill()
        proc.wait(timeout=HANG_S)
    err = one_line_error(capsys)
    assert "is in use by another run (pid 424242" in err
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]


def test_cli_resume_with_changed_generations(earlier_job, tmp_path, tiny_dir, capsys):
    out = copy_of(earlier_job, tmp_path)
    before = tree_digest(out)
    cfg = job_config(tmp_path, tiny_dir, out, max_steps=3, num_generations=2)
    capsys.readouterr()
    assert main(["train", str(cfg), "--quiet", "--resume"]) == 2
    err = one_line_error(capsys)
    assert "num_generations: 4 → 2" in err and "force it (--force)" in err and "force_resume" not in err
    assert tree_digest(out) == before
    assert main(["train", str(cfg), "--quiet", "--resume", "--force"]) == 0
    assert verify_checkpoint(latest_checkpoint(out)) == 3


def test_cli_a_full_disk_during_a_save(monkeypatch, tmp_path, tiny_dir, capsys):
    out = tmp_path / "out"
    fill_the_disk_at_step(monkeypatch, 2)
    capsys.readouterr()
    assert main(["train", str(job_config(tmp_path, tiny_dir, out, max_steps=3)), "--quiet"]) == 1
    err = one_line_error(capsys)
    assert "no space left" in err and "checkpoint-1 is intact" in err
    assert not [p for p in out.iterdir() if ".tmp" in p.name]
    assert verify_checkpoint(out / "checkpoint-1") == 1


class FillTheDisk(transformers.TrainerCallback):
    """Once checkpoint ``after`` is saved, fill the file system of ``mount`` but ``leave`` bytes: enough for the log
    lines of the next step, not for the next checkpoint's weights."""

    def __init__(self, mount: Path, after: int, leave: int):
        self.mount, self.after, self.leave = mount, after, leave

    def on_save(self, args, state, control, **kw):
        if state.global_step == self.after:
            free = shutil.disk_usage(self.mount).free
            (self.mount / "filler").write_bytes(b"\0" * max(0, free - self.leave))


def mount_small_tmpfs(where: Path, size: str) -> str | None:
    """Mount a tmpfs of ``size`` at ``where``; None when mounted, else why it could not be."""
    if shutil.which("mount") is None:
        return "there is no mount command"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       text=True, timeout=60)
    return None if r.returncode == 0 else (r.stderr.strip() or f"mount exited with {r.returncode}")


IN_NAMESPACE = "GRPOKIT_TEST_IN_MOUNT_NAMESPACE"


def rerun_in_a_mount_namespace(test_id: str, why: str) -> None:
    """This test again, alone, in a user and mount namespace of its own (``unshare -rm``), where an unprivileged user
    may mount a tmpfs; skipped with the reasons when that is not allowed either."""
    if os.environ.get(IN_NAMESPACE):
        pytest.fail(f"a tmpfs cannot be mounted even in a mount namespace: {why}")
    if shutil.which("unshare") is None:
        pytest.skip(f"a full disk needs a small real file system: mounting a tmpfs failed ({why}) and there is no "
                    "unshare command to mount one in a namespace")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"a full disk needs a small real file system: mounting a tmpfs failed ({why}) and user namespaces "
                    f"are not allowed here (unshare -rm: {probe.stderr.strip()})")
    r = subprocess.run(["unshare", "-rm", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_id],
                       env=dict(os.environ, **{IN_NAMESPACE: "1"}), capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, f"in a mount namespace:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"


def test_cli_a_full_disk_of_a_real_small_file_system(monkeypatch, tmp_path, tiny_dir, capsys, request):
    """The disk really fills during checkpoint-2 (a tmpfs of a few MB, filled up after checkpoint-1): safetensors'
    writer fails with its own error, which carries no errno (``SafetensorError: ... No space left on device (os error
    28)``), and the run still ends in the one-line disk-full message, checkpoint-1 intact and nothing left behind."""
    mount = tmp_path / "small"
    mount.mkdir()
    why = mount_small_tmpfs(mount, "8m")
    if why is not None:
        rerun_in_a_mount_namespace(f"{request.path}::{request.node.name}", why)
        return
    try:
        import grpokit.run.checkpoints
        import grpokit.run.job

        seen = []
        judge = grpokit.run.checkpoints.is_disk_full
        monkeypatch.setattr(grpokit.run.checkpoints, "is_disk_full",
                            lambda e, path=None: seen.append(f"{type(e).__name__}: {e}") or judge(e, path))
        monkeypatch.setattr(grpokit.run.job, "run_job", functools.partial(
            grpokit.run.job.run_job, callbacks=[FillTheDisk(mount, after=1, leave=48 << 10)]))
        out = mount / "out"
        capsys.readouterr()
        assert main(["train", str(job_config(tmp_path, tiny_dir, out, max_steps=3, eval={"before": False})),
                     "--quiet"]) == 1
        err = one_line_error(capsys)
        assert err == (f"grpokit: error: no space left on the device of '{out}' while saving checkpoint-2: it was not "
                       "written (nothing half-written is left); checkpoint-1 is intact. Free some space, then resume "
                       "(with --resume)")
        assert len(seen) == 1 and seen[0].startswith("SafetensorError: ") and "(os error 28)" in seen[0]
        assert sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE) == ["checkpoint-1", "metrics.jsonl"]
        assert verify_checkpoint(out / "checkpoint-1") == 1
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=60)


def test_every_writer_s_full_disk_is_recognised(tmp_path, request):
    """On a full tmpfs each writer fails its own way: a plain write with ENOSPC, safetensors with a text only, torch.save
    with a RuntimeError that says nothing of it (recognised by the space left); an error with room to spare is not
    a full disk."""
    import torch
    from safetensors.torch import save_file

    from grpokit.run.files import is_disk_full

    mount = tmp_path / "small"
    mount.mkdir()
    why = mount_small_tmpfs(mount, "256k")
    if why is not None:
        rerun_in_a_mount_namespace(f"{request.path}::{request.node.name}", why)
        return
    try:
        (mount / "filler").write_bytes(b"\0" * (shutil.disk_usage(mount).free - (16 << 10)))
        errors = []
        for write in (lambda: (mount / "plain.bin").write_bytes(b"\0" * (64 << 10)),
                      lambda: save_file({"w": torch.zeros(16 << 10)}, str(mount / "w.safetensors")),
                      lambda: torch.save({"w": torch.zeros(16 << 10)}, str(mount / "w.pt"))):
            with pytest.raises(Exception) as e:
                write()
            errors.append(e.value)
        assert isinstance(errors[0], OSError) and errors[0].errno == errno.ENOSPC and is_disk_full(errors[0])
        assert type(errors[1]).__name__ == "SafetensorError" and is_disk_full(errors[1])  # from its text alone
        assert isinstance(errors[2], RuntimeError) and not is_disk_full(errors[2])  # nothing in torch's text...
        assert is_disk_full(errors[2], mount)  # ...but the file system it wrote to is full
        assert not is_disk_full(ValueError("bad value"), tmp_path)  # room to spare: another error
        try:
            raise RuntimeError("saving failed") from errors[1]
        except RuntimeError as chained:
            assert is_disk_full(chained)  # the cause says it
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=60)


def test_cli_damaged_eval_before_is_measured_again(earlier_job, tmp_path, tiny_dir, capsys):
    out = copy_of(earlier_job, tmp_path)
    (out / "eval_before.json").write_text('{"accuracy": 0.1')  # cut short
    capsys.readouterr()
    assert main(["train", str(job_config(tmp_path, tiny_dir, out, max_steps=3)), "--resume"]) == 0
    stdout = capsys.readouterr().out
    assert "eval_before.json" in stdout and "measuring again" in stdout
    json.loads((out / "eval_before.json").read_text())


def test_cli_the_demo_never_replaces_an_earlier_demo(tmp_path, monkeypatch):
    from grpokit.cli import _free_demo_dir

    monkeypatch.chdir(tmp_path)
    assert _free_demo_dir() == "runs/demo"
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    assert _free_demo_dir() == "runs/demo"  # an empty directory holds nothing to lose
    (tmp_path / "runs" / "demo" / "report.json").write_text("{}")
    assert _free_demo_dir() == "runs/demo-2"
    (tmp_path / "runs" / "demo-2" / "checkpoint-3").mkdir(parents=True)
    assert _free_demo_dir() == "runs/demo-3"


def test_under_a_launcher_only_the_main_process_judges_the_output_dir(tmp_path, tiny_dir):
    """Under torchrun every rank runs the job: the main one claims the directory, evaluates and writes
    eval_before.json before any collective, so a rank that starts later found that file and refused the run as an
    'earlier run' (a flaky failure of the launcher test on a loaded machine). Only the main process judges now."""
    import grpokit.run.job as job

    out = tmp_path / "out"
    spec = yaml.safe_load(job_config(tmp_path, tiny_dir, out).read_text())
    late = job._JobRun(spec, quiet=True, resume=None)
    out.mkdir()
    (out / "eval_before.json").write_text("[{}, []]")  # what the main process wrote while this rank was starting
    late.main = False
    assert late._start() is None
    main_again = job._JobRun(spec, quiet=True, resume=None)
    with pytest.raises(job.JobError, match=r"holds an earlier run \(eval_before.json\)"):
        main_again._start()
