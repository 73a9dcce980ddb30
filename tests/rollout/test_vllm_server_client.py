"""grpokit's client of vLLM's own server against a stand-in that answers as vLLM 0.32's OpenAI server does (the real
engine: tests/vllm_engine/, `make test-vllm`): every server it cannot use is one line saying what to do, a server that stops
answering is an error within the bound, and the launcher's own failures are lines too."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch
from service_servers import closed_port

from grpokit.rollout.vllm_launch import ServeOptions, running_server, server_command
from grpokit.rollout.vllm_server import WORKER_EXTENSION, VLLMServerClient, VLLMServerError


def vllm_config(**changes):
    config = {"model_config": {"logprobs_mode": "processed_logprobs", "hf_text_config": {"vocab_size": 100}},
              "parallel_config": {"worker_extension_cls": WORKER_EXTENSION}, "lora_config": None}
    for key, value in changes.items():
        section, _, name = key.partition("__")
        if name:
            config[section][name] = value
        else:
            config[section] = value
    return config


class StandIn:
    """GET answers by path (status, body); POST /v1/completions sleeps ``delay`` seconds first. Closing it ends every
    request it is still handling, without an answer (the client gave up), so nothing it does outlives its test (a
    handler writing to a closed socket afterwards printed a traceback into another test's captured stderr)."""

    def __init__(self, **config_changes):
        self.get = {"/health": (200, {}), "/version": (200, {"version": "0.32.0"}),
                    "/v1/models": (200, {"data": [{"id": "/models/tiny", "parent": None}]}),
                    "/server_info?config_format=json": (200, {"vllm_config": vllm_config(**config_changes)})}
        self.delay = 0.0
        self.posts = []
        self.stopping = threading.Event()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(*stand_in.get.get(self.path, (404, {"detail": "Not Found"})))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                stand_in.posts.append((self.path, body))
                if stand_in.stopping.wait(stand_in.delay):  # closed while "busy": the client is gone
                    return
                if self.path == "/v1/completions":
                    choices = [{"index": i, "logprobs": {"tokens": ["token_id:7", "token_id:2"],
                                                         "token_logprobs": [-0.5, -0.25]}}
                               for i in range(len(body["prompt"]))]
                    self._send(200, {"choices": choices[::-1]})  # any order: the client sorts by index
                else:
                    self._send(200, {})

        class Server(ThreadingHTTPServer):
            daemon_threads = False  # server_close() joins the request threads

            def handle_error(self, request, client_address):
                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):  # a client gone
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_in():
    servers = []

    def make(**changes):
        servers.append(StandIn(**changes))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_a_fit_server_is_used_and_generation_reads_ids_and_logps_in_prompt_order(stand_in):
    server = stand_in()
    client = VLLMServerClient(server.url, timeout=10)
    assert client.serves_openai_api()
    client.check("/models/tiny", vocab_size=100)
    ids, logps = client.generate([[1, 2], [3]], {"n": 1, "temperature": 0.7, "max_tokens": 2, "logprobs": 0})
    assert ids == [[7, 2], [7, 2]] and logps == [[-0.5, -0.25], [-0.5, -0.25]]
    path, body = server.posts[-1]
    assert path == "/v1/completions" and body["model"] == "/models/tiny" and body["prompt"] == [[1, 2], [3]]
    assert body["return_tokens_as_token_ids"] is True and body["temperature"] == 0.7 and body["n"] == 1


@pytest.mark.parametrize("changes, expected", [
    ({"model_config__logprobs_mode": "raw_logprobs"}, "reports log-probs as 'raw_logprobs'"),
    ({"parallel_config__worker_extension_cls": ""}, f"--worker-extension-cls {WORKER_EXTENSION}"),
    ({"model_config__hf_text_config": {"vocab_size": 50}}, "(vocabulary 50) but the trainer's model"),
])
def test_a_server_grpokit_cannot_use_is_one_line(stand_in, changes, expected):
    server = stand_in(**changes)
    with pytest.raises(VLLMServerError) as e:
        VLLMServerClient(server.url, timeout=10).check("/models/tiny", vocab_size=100)
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert "grpokit vllm-serve" in str(e.value) or "serve the trainer's model" in str(e.value)


def test_an_old_vllm_and_a_server_without_dev_mode_are_one_line(stand_in):
    old = stand_in()
    old.get["/version"] = (200, {"version": "0.10.2"})
    with pytest.raises(VLLMServerError, match=r"is vLLM 0\.10\.2; grpokit's client needs vLLM >= 0\.32"):
        VLLMServerClient(old.url, timeout=10).check("/models/tiny")
    plain = stand_in()
    del plain.get["/server_info?config_format=json"]
    with pytest.raises(VLLMServerError, match=r"has no /server_info \(not in dev mode: VLLM_SERVER_DEV_MODE=1"):
        VLLMServerClient(plain.url, timeout=10).check("/models/tiny")


def test_no_server_is_one_line_and_trls_server_is_told_apart(stand_in):
    with pytest.raises(VLLMServerError, match=r"no vLLM server answers at http://127\.0\.0\.1:\d+ \(.*Connection"):
        VLLMServerClient(f"http://127.0.0.1:{closed_port()}", timeout=5).serves_openai_api()
    trl_like = stand_in()
    del trl_like.get["/v1/models"]
    assert VLLMServerClient(trl_like.url, timeout=5).serves_openai_api() is False


def test_a_server_that_stops_answering_is_an_error_within_the_bound_naming_the_step(stand_in):
    server = stand_in()
    client = VLLMServerClient(server.url, timeout=1.0)
    client.check("/models/tiny")
    client.step = 7
    server.delay = 30
    start = time.monotonic()
    with pytest.raises(VLLMServerError) as e:
        client.load_weight_file("/dev/shm/none.safetensors", 3)
    assert time.monotonic() - start < 20
    assert f"vLLM server at {server.url}: loading the weights (3 tensors) failed at training step 7: " in str(e.value)
    assert "timed out" in str(e.value)


def test_adapter_sync_needs_lora_on_and_a_rank_that_fits(stand_in):
    off = VLLMServerClient(stand_in().url, timeout=5)
    off.check("/models/tiny")
    with pytest.raises(VLLMServerError, match="runs without --enable-lora.*vllm_lora_sync='full'"):
        off.check_adapter(8)
    on = VLLMServerClient(stand_in(lora_config={"max_lora_rank": 16}).url, timeout=5)
    on.check("/models/tiny")
    on.check_adapter(16)
    with pytest.raises(VLLMServerError, match="takes adapters up to rank 16, the policy's is 32: start it with "
                                              "--max-lora-rank 32"):
        on.check_adapter(32)


def test_the_launcher_says_what_is_wrong_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} on 127.0.0.1 is in use"):
            with running_server(ServeOptions(model="/nowhere", port=port)):
                pass
    # an interpreter without vLLM (this one without its site-packages: the suite may run where vLLM is installed):
    # the server's own exit ends the wait, with its cause
    bare = tmp_path / "python-without-site-packages"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    bare.chmod(0o755)
    opts = ServeOptions(model="/nowhere", port=closed_port(), python=str(bare))
    with pytest.raises(RuntimeError, match=r"exited with status 1 before answering: .*No module named 'vllm"):
        with running_server(opts, log=tmp_path / "server.log", start_timeout_s=120):
            pass


def test_the_server_command_asks_for_what_the_client_needs():
    argv, env = server_command(ServeOptions(model="/m", port=1234, enable_lora=True, max_lora_rank=32,
                                            memory_fraction=0.2, extra=["--seed", "3"]))
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(argv)
    for flag in (f"--worker-extension-cls {WORKER_EXTENSION}", "--logprobs-mode processed_logprobs", "--port 1234",
                 "--enable-lora --max-lora-rank 32", "--gpu-memory-utilization 0.2", "--seed 3"):
        assert flag in text
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


@pytest.mark.parametrize("precision, flags", [("int8", ["--dtype bfloat16", "--quantization fp8_per_channel"]),
                                              ("bf16", ["--dtype bfloat16"]), ("float32", ["--dtype float32"]),
                                              ("auto", ["--dtype auto"])])
def test_the_server_command_sets_the_rollout_precision(precision, flags):
    argv, _ = server_command(ServeOptions(model="/m", rollout_precision=precision))
    assert all(f in " ".join(argv) for f in flags) and ("--quantization" in argv) == (precision == "int8")


@pytest.mark.parametrize("served, precision, refused", [
    ({"dtype": "torch.bfloat16", "quantization": "fp8_per_channel"}, "int8", None),
    ({"dtype": "torch.bfloat16", "quantization": "fp8_per_channel"}, "auto", None),
    ({"dtype": "torch.bfloat16", "quantization": "fp8_per_channel"}, "bf16", "quantization fp8_per_channel"),
    ({"dtype": "torch.float32", "quantization": None}, "int8", "quantization none and dtype float32"),
    ({"dtype": "torch.float32", "quantization": None}, "float32", None),
    ({"dtype": "torch.float32", "quantization": None}, "bf16", "dtype float32"),
])
def test_a_server_in_another_precision_is_refused_in_one_line(stand_in, served, precision, refused):
    server = stand_in(**{f"model_config__{k}": v for k, v in served.items()})
    client = VLLMServerClient(server.url, timeout=10)
    client.check("/models/tiny")
    if refused is None:
        client.check_precision(precision, "/models/tiny")
        return
    with pytest.raises(VLLMServerError) as e:
        client.check_precision(precision, "/models/tiny")
    text = str(e.value)
    assert text.startswith(f"rollout_precision='{precision}' is not allowed with the vLLM server at ") and "\n" not in text
    assert refused in text and f"grpokit vllm-serve --model /models/tiny --rollout-precision {precision}" in text


FAKE_SERVER = '''
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
'''

PARENT = '''
import sys, time
from grpokit.rollout.vllm_launch import ServeOptions, free_port, running_server
with running_server(ServeOptions(model="/m", port=free_port(), python=sys.executable), start_timeout_s=120) as s:
    print(s.process.pid, flush=True)
    time.sleep(600)
'''


def test_a_killed_trainer_leaves_no_server_behind(tmp_path):
    """SIGKILL ends the process that started the server without any ``finally``: the kernel ends the server
    (PR_SET_PDEATHSIG). A stand-in answers as vLLM's server module would (``-m vllm.entrypoints.openai.api_server``)."""
    import os
    import signal
    import subprocess

    import psutil

    module = tmp_path / "vllm" / "entrypoints" / "openai"
    module.mkdir(parents=True)
    (module / "api_server.py").write_text(FAKE_SERVER)
    for package in (tmp_path / "vllm", module.parent, module):  # regular packages: ahead of an installed vLLM
        (package / "__init__.py").write_text("")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env=env, stdout=subprocess.PIPE, text=True)
    server = None
    try:
        server = psutil.Process(int(parent.stdout.readline()))
        assert server.is_running()
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        server.wait(timeout=60)  # psutil.TimeoutExpired if it outlived its parent
    finally:
        parent.kill()
        if server is not None and server.is_running():  # the test failed: leave nothing behind either way
            server.kill()


def test_sync_files_of_a_killed_run_are_removed_and_a_live_runs_kept(tmp_path):
    from grpokit.rollout.vllm_sync import remove_dead_runs_files

    dead, live = tmp_path / "grpokit-vllm-999999999-abc", tmp_path / f"grpokit-vllm-{os.getpid()}-def"
    for d in (dead, live):
        d.mkdir()
        (d / "weights-1.safetensors").write_bytes(b"x")
    remove_dead_runs_files(tmp_path)
    assert not dead.exists() and live.exists()


@pytest.mark.parametrize("device, expected", [("cuda", "adapter"), ("cpu", "full")])
def test_auto_syncs_the_adapter_alone_except_to_a_cpu_engine(stand_in, device, expected):
    from types import SimpleNamespace

    from grpokit.rollout.vllm_sync import WeightSync

    client = VLLMServerClient(stand_in(lora_config={"max_lora_rank": 16},
                                       device_config={"device_type": device}).url, timeout=5)
    client.check("/models/tiny")
    lora = SimpleNamespace(peft_config={"default": SimpleNamespace(r=8, modules_to_save=None, use_dora=False,
                                                                    peft_type="LORA")})
    assert WeightSync("auto").kind(lora, client) == expected
    assert WeightSync("adapter").kind(lora, client) == "adapter"  # asked for: the user's choice
    assert WeightSync("auto").kind(SimpleNamespace(), client) == "full"  # no adapter


SHARING_CHILD = '''
import sys, time
from multiprocessing import resource_tracker, shared_memory
segment = shared_memory.SharedMemory(create=True, size=1 << 16)
resource_tracker.unregister(segment._name, "shared_memory")  # as a killed server: nobody left to unlink it
print(segment.name, flush=True)
time.sleep(600)
'''


def test_a_killed_groups_shared_memory_is_found_and_removed():
    import subprocess
    import sys
    from pathlib import Path

    from grpokit.rollout.vllm_launch import remove_left_behind, shared_memory_of_group, stop_group

    proc = subprocess.Popen([sys.executable, "-c", SHARING_CHILD], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        path = Path("/dev/shm") / proc.stdout.readline().strip().lstrip("/")
        found = shared_memory_of_group(proc.pid)
        assert path in found and path.exists()
        assert not shared_memory_of_group(proc.pid + 10 ** 7)  # another group's: none
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        stop_group(proc)  # already gone: nothing to do
    assert path.exists()  # SIGKILL: the segment outlives its process
    remove_left_behind(found)
    assert not path.exists()


def per_rank_args(url: str, **changes) -> SimpleNamespace:
    """What the backend reads of a config, for asynchronous rollouts from a server on two processes."""
    args = dict(vllm_mode="server", vllm_server_base_url=url, vllm_server_host="127.0.0.1", vllm_server_port=8000,
                vllm_group_port=51216, vllm_server_timeout=10, vllm_lora_sync="auto", vllm_enable_sleep_mode=False,
                max_staleness=1, world_size=2, rollout_precision="auto")
    return SimpleNamespace(**{**args, **changes})


def test_asynchronous_rollouts_on_several_processes_give_every_rank_a_client_of_its_own(stand_in, monkeypatch):
    """Each rank's producer thread sends its own prompts (no collective: none is set up here), and only the main
    process pushes weights."""
    from tiny import tiny_tokenizer

    from grpokit.rollout.base import SamplingParams
    from grpokit.rollout.vllm_backend import VLLMRollout

    server = stand_in()
    tok = tiny_tokenizer()
    ranks = [VLLMRollout("/models/tiny", tok, per_rank_args(server.url), process_index=i) for i in (0, 1)]
    assert all(r.per_rank and isinstance(r.client, VLLMServerClient) for r in ranks)
    assert ranks[0].sync is not None and ranks[0].sync.mode == "full" and ranks[1].sync is None
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    monkeypatch.setattr("grpokit.rollout.vllm_backend._rank", lambda: 1)  # this is rank 1 of 2
    out = ranks[1].generate(None, ids, (ids != 0).long(), SamplingParams(max_new_tokens=2))
    assert out.completion_ids.tolist() == [[7, 2], [7, 2]]
    sent = [body["prompt"] for path, body in server.posts if path == "/v1/completions"]
    assert sent == [[[5, 6, 7], [8, 9]]]  # this rank's rows only, in one request


def test_trls_server_and_adapter_sync_are_refused_for_asynchronous_rollouts_on_several_processes(stand_in):
    from grpokit.rollout.vllm_backend import VLLMRollout

    trl_like = stand_in()
    del trl_like.get["/v1/models"]
    with pytest.raises(ValueError) as e:
        VLLMRollout._make_client(per_rank_args(trl_like.url), "/models/tiny")
    text = str(e.value)
    assert text.startswith(f"max_staleness=1 is not allowed with TRL's trl vllm-serve at {trl_like.url} on 2 "
                           "processes: 0, or vLLM's own server (grpokit vllm-serve)") and "\n" not in text
    from tiny import tiny_tokenizer

    server = stand_in()
    with pytest.raises(ValueError, match=r"^vllm_lora_sync='adapter' is not allowed with max_staleness=1 on 2 "
                                         r"processes: 'full' or 'auto'"):
        VLLMRollout("/models/tiny", tiny_tokenizer(), per_rank_args(server.url, vllm_lora_sync="adapter"))


RANK = '''
import os, sys
import torch
sys.path.insert(0, sys.argv[2])
from tiny import tiny_model, tiny_tokenizer
from types import SimpleNamespace
from grpokit.rollout.vllm_backend import VLLMRollout
torch.distributed.init_process_group("gloo")
args = SimpleNamespace(vllm_mode="server", vllm_server_base_url=sys.argv[1], vllm_server_host="127.0.0.1",
                       vllm_server_port=8000, vllm_group_port=51216, vllm_server_timeout=10, vllm_lora_sync="auto",
                       vllm_enable_sleep_mode=False, max_staleness=1, world_size=2, rollout_precision="auto")
tok = tiny_tokenizer()
rollout = VLLMRollout("/models/tiny", tok, args, process_index=int(os.environ["RANK"]))
try:
    rollout.sync_weights(tiny_model(tok), step=3)
    print("synced")
except Exception as e:
    print(f"{type(e).__name__}: {e}")
torch.distributed.destroy_process_group()
'''


def test_a_push_that_fails_on_the_main_process_is_every_ranks_error_and_none_waits(stand_in, tmp_path):
    """Two real processes (gloo): the stand-in's workers load nothing, so the main process's push fails; the other
    rank, which waits for it in a broadcast, raises the same cause instead of generating on older weights."""
    import subprocess
    from pathlib import Path

    from grpokit.rollout.vllm_launch import free_port

    server = stand_in()
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, server.url, tests], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    lines = [out.strip().splitlines()[-1] if out.strip() else err[-400:] for out, err in outs]
    assert lines[0].startswith(f"VLLMServerError: vLLM server at {server.url}: loading the weights failed at "
                               "training step 3: the workers answered []"), lines
    assert lines[1].startswith("RuntimeError: the main process could not give the vLLM server the weights of "
                               f"training step 3: VLLMServerError: vLLM server at {server.url}"), lines
    assert [path for path, _ in server.posts].count("/collective_rpc") == 1  # one push, by the main process
