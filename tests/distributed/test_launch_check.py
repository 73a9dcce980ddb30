"""Under a launcher of two processes on a CPU, a config that would set up a single-process run (transformers does so
without ``use_cpu=True``, as TRL's config does) is one line on every rank, instead of two runs that each train alone
and meet only at the output directory."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")

RANK = '''
import os, sys
from pathlib import Path
from grpokit import GRPOConfig
try:
    args = GRPOConfig(output_dir=sys.argv[1], report_to="none", use_cpu=sys.argv[2] == "cpu")
    said = f"world {args.world_size}"
except ValueError as e:
    said = f"refused: {e}"
Path(sys.argv[1] + "-rank" + os.environ["RANK"]).write_text(said)  # (the ranks' stdout interleave)
'''


@pytest.mark.parametrize("use_cpu", [False, True])
def test_a_config_that_would_run_each_rank_alone_is_refused_in_one_line(tmp_path, use_cpu):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), str(tmp_path / "run"), "cpu" if use_cpu else "plain"],
                         env=env, capture_output=True, text=True, timeout=600)
    lines = sorted((tmp_path / f"run-rank{r}").read_text() for r in (0, 1) if (tmp_path / f"run-rank{r}").exists())
    if use_cpu:
        assert lines == ["world 2", "world 2"], out.stderr[-2000:]
    else:
        assert len(lines) == 2 and lines[0] == lines[1], out.stderr[-2000:]
        assert lines[0] == ("refused: use_cpu=False is not allowed under a launcher of 2 processes (WORLD_SIZE): True "
                            "on a machine without an accelerator (--use_cpu on the command line): transformers set up "
                            "a single-process run here, so each of the 2 processes would train alone")
