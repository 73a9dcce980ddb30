"""The ``grpokit`` command asks MKL for strict conditional numerical reproducibility (``MKL_CBWR=AUTO,STRICT``) before
anything multiplies, unless the user chose a setting: without it two demo runs of one seed parted on a 2-core CPU
(grpokit/machine/reproducible.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from grpokit.cli import main


def test_the_command_sets_strict_reproducibility_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("MKL_CBWR", raising=False)
    assert main(["tasks"]) == 0
    assert os.environ["MKL_CBWR"] == "AUTO,STRICT"
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    assert main(["tasks"]) == 0
    assert os.environ["MKL_CBWR"] == "COMPATIBLE"


LAYOUT_PROBE = textwrap.dedent("""
    import sys
    if sys.argv[1] == "grpokit":
        from grpokit.cli import main
        main(["tasks"])
    import torch
    torch.set_num_threads(2)
    torch.manual_seed(0)
    a, b = torch.randn(576, 1100), torch.randn(1100, 16)  # a LoRA gradient's shape: hidden x tokens x rank
    print(int(not torch.equal(a.t().contiguous().t() @ b, a @ b)))  # the first operand stored transposed
""")


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL")
def test_mkl_takes_the_setting_from_the_command():
    """In fresh processes without MKL_CBWR: after the command has run, MKL computes a product to the same bits whichever
    way its operand is stored (strict CNR); a process that never ran it may not (a 2-core Xeon with AVX512 did not)."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}

    def probe(who):
        out = subprocess.run([sys.executable, "-c", LAYOUT_PROBE, who], capture_output=True, text=True, env=env,
                             check=True).stdout.split()
        return int(out[-1])

    assert probe("grpokit") == 0, "the transposed operand gave other bits after the grpokit command's setting"
    print(f"without the setting the layouts differed: {bool(probe('plain'))}")
