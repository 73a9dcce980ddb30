"""Which kernel vLLM's CPU 8-bit products run on (grpokit/rollout/fp8_kernel.py): read from oneDNN's own log, and
``rollout_precision="int8"`` refused in one line, before any server starts, where it is oneDNN's reference loop."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grpokit.cli import main
from grpokit.rollout import fp8_kernel
from grpokit.rollout.vllm_launch import ServeOptions, running_server

# oneDNN's log of the probe's product on a 2-core Xeon with AVX512-FP16 and AMX (torch 2.13.0+cpu), as printed
REFERENCE_LOG = "\n".join([
    "onednn_verbose,v1,info,oneDNN v3.9.1 (commit 0)",
    "onednn_verbose,v1,primitive,info,template:operation,engine,primitive,implementation,prop_kind,memory_descriptors,"
    "attributes,auxiliary,problem_desc,exec_time",
    "onednn_verbose,v1,primitive,exec,cpu,matmul,ref:any,undef,src:f8_e4m3:a:blocked:ab::f0 "
    "wei:f8_e4m3:a:blocked:ab::f0 dst:f32:a:blocked:ab::f0,attr-scratchpad:user,,1x64:64x64,0.376953",
]) + "\n"


def test_the_kernel_is_read_from_onednns_log():
    assert fp8_kernel.parse_fp8_kernel(REFERENCE_LOG) == "ref:any"
    fast = REFERENCE_LOG.replace(",ref:any,", ",brg_matmul:avx10_1_512_amx_fp16,")
    assert fp8_kernel.parse_fp8_kernel(fast) == "brg_matmul:avx10_1_512_amx_fp16"
    bf16 = REFERENCE_LOG.replace("f8_e4m3", "bf16").replace(",ref:any,", ",brg_matmul:avx512_core_amx,")
    assert fp8_kernel.parse_fp8_kernel(bf16) is None  # not an 8-bit product
    assert fp8_kernel.parse_fp8_kernel("") is None  # torch computed it without oneDNN (no log)
    assert fp8_kernel.parse_fp8_kernel("onednn_verbose,v1,primitive,exec,cpu") is None  # a cut line


def test_the_probe_asks_the_interpreter_it_is_given(tmp_path):
    """A stand-in interpreter that prints the log: what it prints is what comes back; one that fails gives None."""
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport os, sys\nassert os.environ['ONEDNN_VERBOSE'] == '1'\n"
                    f"sys.stdout.write({REFERENCE_LOG!r})\n")
    fake.chmod(0o755)
    assert fp8_kernel.fp8_matmul_kernel(str(fake)) == "ref:any"
    assert fp8_kernel.fp8_matmul_kernel(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("kernel", ["brg_matmul:avx10_1_512_amx_fp16", None])
def test_int8_is_served_where_the_kernel_is_not_the_reference_loop(monkeypatch, kernel):
    monkeypatch.setattr(fp8_kernel, "fp8_matmul_kernel", lambda python: kernel)
    fp8_kernel.check_fp8_serving(sys.executable)  # no refusal


def test_grpokit_vllm_serve_refuses_int8_in_one_line_before_starting_anything(monkeypatch, capsys):
    monkeypatch.setattr(fp8_kernel, "fp8_matmul_kernel", lambda python: "ref:any")
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    assert main(["vllm-serve", "--model", "/models/tiny", "--rollout-precision", "int8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpokit: error: rollout_precision='int8' is not allowed with vLLM on this CPU: use 'bf16' "
                          "or 'auto'") and "ref:any" in err and "\n" not in err
    assert started == []
    with pytest.raises(ValueError, match="rollout_precision='int8' is not allowed"):  # the library's entry too
        with running_server(ServeOptions(model="/models/tiny", rollout_precision="int8")):
            pass
    assert started == []


def test_a_colocated_engine_refuses_int8_in_one_line_before_building_vllm(monkeypatch):
    from types import SimpleNamespace

    from grpokit.rollout.vllm_backend import VLLMRollout

    monkeypatch.setattr(fp8_kernel, "fp8_matmul_kernel", lambda python: "ref:any")
    with pytest.raises(ValueError) as e:
        VLLMRollout._make_llm("/models/tiny", SimpleNamespace(rollout_precision="int8"), 0)
    assert str(e.value).startswith("rollout_precision='int8' is not allowed with vLLM on this CPU") and "\n" not in str(e.value)
