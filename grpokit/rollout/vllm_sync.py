"""Weight sync to vLLM's own server through shared memory: all the weights, or a LoRA adapter alone.

* **full**: the policy's weights under the base model's names (LoRA folded in, :func:`engine_weights`) are written
  into one safetensors file in ``/dev/shm`` and every engine worker loads it
  (:class:`grpokit.rollout.vllm_worker.WeightFileLoader`);
* **adapter**: a LoRA policy's adapter alone (its ``lora_A``/``lora_B`` tensors: megabytes, where the model is
  hundreds) is saved as a PEFT adapter in ``/dev/shm`` and the server loads it as a new runtime adapter, named by
  its version; generation names that adapter from then on, and the one before is unloaded.

``vllm_lora_sync`` chooses: ``"auto"`` (the adapter alone where the policy is a LoRA model vLLM can run as an
adapter, the server has LoRA on and it is not a CPU engine, else everything), ``"full"`` or ``"adapter"`` (refused in
one line where it cannot be). On a CPU, vLLM's LoRA path generates several times slower than merged weights, which
costs more than moving the whole model at every step (benchmarks/RESULTS.md, the demo through vLLM). The files are
written whole before the engine is told about them (a temporary name, then a rename) and removed once it has read
them. The engine must run on the trainer's machine (it reads the trainer's shared memory).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..validation import refusal
from .vllm_server import SyncReport, VLLMServerClient


def shared_memory_dir() -> Path:
    """Where sync files go: ``/dev/shm`` where it exists (memory, not disk), else the temporary directory."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    return root


def adapter_problem(model: torch.nn.Module) -> str | None:
    """Why ``model``'s adapter cannot be synced alone (None: it can): vLLM runs plain LoRA adapters only."""
    config = (getattr(model, "peft_config", None) or {}).get("default")
    if config is None:
        return "the policy has no LoRA adapter"
    if getattr(config, "modules_to_save", None):
        return f"the adapter also trains whole modules (modules_to_save={config.modules_to_save!r})"
    if getattr(config, "use_dora", False):
        return "the adapter is a DoRA adapter"
    if str(getattr(config, "peft_type", "LORA")).split(".")[-1] != "LORA":
        return f"the adapter is {config.peft_type}, not LoRA"
    return None


@contextmanager
def engine_weights(model: torch.nn.Module, fold_adapters: bool = True) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """The model's weights under the names of the plain base model, read once inside the ``with`` block. A PEFT
    model's LoRA layers give ``W + ΔW`` computed one layer at a time, in the base weight's dtype, without touching
    the model: merging into a bf16/fp16 base and unmerging after would round it twice at every sync, and the
    base would drift (tests/rollout/test_transformers_backend.py measures that drift). ``fold_adapters=False``: the
    base weights alone (for an engine that runs the adapter itself)."""
    yield _engine_pairs(model, fold_adapters)


def _engine_pairs(model: torch.nn.Module, fold_adapters: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    if not (hasattr(model, "merge_adapter") and getattr(model, "peft_config", None)):
        for name, tensor in model.state_dict().items():
            yield name, tensor.detach()
        return
    prefix = "base_model.model."
    layers = {name: m for name, m in model.named_modules() if hasattr(m, "get_delta_weight") and hasattr(m, "base_layer")}
    for name, tensor in model.state_dict().items():
        if "lora_" in name or ".original_module." in name:
            continue  # adapters are folded in below; the trained copy of a modules_to_save layer is used
        layer = layers.get(name.removesuffix(".base_layer.weight")) if name.endswith(".base_layer.weight") else None
        tensor = tensor.detach()
        if fold_adapters and layer is not None and not layer.merged:
            adapters = [a for a in layer.active_adapters if a in layer.lora_A or a in getattr(layer, "lora_embedding_A", {})]
            if adapters:
                delta = sum(layer.get_delta_weight(a).float() for a in adapters)
                tensor = (tensor.float() + delta).to(tensor.dtype)
        yield name.removeprefix(prefix).replace(".base_layer", "").replace(".modules_to_save.default", ""), tensor


def remove_dead_runs_files(root: Path) -> None:
    """Sync directories of processes that no longer exist (killed before they could remove them): shared memory is
    the machine's memory until removed."""
    for stale in root.glob("grpokit-vllm-*-*"):
        pid = stale.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists() and Path("/proc").is_dir():
            shutil.rmtree(stale, ignore_errors=True)


class WeightSync:
    """Pushes a policy's weights to one vLLM server (see the module docstring); ``last`` is the latest sync's
    :class:`SyncReport`."""

    def __init__(self, mode: str = "auto"):
        self.mode = mode
        self.version = 0
        self.last: SyncReport | None = None
        remove_dead_runs_files(shared_memory_dir())
        self._dir = Path(tempfile.mkdtemp(prefix=f"grpokit-vllm-{os.getpid()}-", dir=shared_memory_dir()))
        self._adapter_dir: Path | None = None
        self._base_pushed = False
        self.close = weakref.finalize(self, shutil.rmtree, self._dir, True)
        """Remove the sync files (at the latest when this object goes, or at exit)."""

    def kind(self, model: torch.nn.Module, client: VLLMServerClient) -> str:
        problem = adapter_problem(model)
        rank = getattr((getattr(model, "peft_config", None) or {}).get("default"), "r", 0)
        fits = client.lora_enabled and rank <= client.max_lora_rank and client.device_type != "cpu"
        if self.mode == "full" or (self.mode == "auto" and (problem or not fits)):
            return "full"
        if problem:
            raise refusal("vllm_lora_sync", self.mode, f"{problem}; use 'full' or 'auto'", when="here")
        client.check_adapter(getattr(model.peft_config["default"], "r", 0))
        return "adapter"

    def push(self, model: torch.nn.Module, client: VLLMServerClient) -> SyncReport:
        """Give the server ``model``'s weights. The adapter alone goes after the base weights went once (the server
        may hold another run's, or a full sync's)."""
        start = time.perf_counter()
        self.version += 1
        if self.kind(model, client) == "adapter":
            size, kind = 0, "adapter"
            if not self._base_pushed:
                size, kind = self._push_full(model, client, fold_adapters=False), "base+adapter"
                self._base_pushed = True
            size += self._push_adapter(model, client)
        else:
            size, kind = self._push_full(model, client), "full"
            self._base_pushed = False  # the server's base now has the adapter folded in
            client.drop_adapter()  # so no adapter runs on top of it
        self.last = SyncReport(kind, size, time.perf_counter() - start)
        return self.last

    def _push_full(self, model: torch.nn.Module, client: VLLMServerClient, fold_adapters: bool = True) -> int:
        from safetensors.torch import save_file

        tensors, seen = {}, set()
        with engine_weights(model, fold_adapters) as pairs:
            for name, t in pairs:  # a tied weight (lm_head = embed_tokens) goes under both names, as a copy
                tensors[name] = t.detach().clone() if t.data_ptr() in seen else t.detach().contiguous()
                seen.add(t.data_ptr())
        path = self._dir / f"weights-{self.version}.safetensors"
        tmp = path.with_suffix(".tmp")
        try:
            save_file(tensors, str(tmp))
            os.replace(tmp, path)
            size = path.stat().st_size
            client.load_weight_file(str(path), len(tensors))
        finally:
            tmp.unlink(missing_ok=True)
            path.unlink(missing_ok=True)
        return size

    def _push_adapter(self, model: torch.nn.Module, client: VLLMServerClient) -> int:
        target = self._dir / f"adapter-{self.version}"
        tmp = self._dir / f".adapter-{self.version}.tmp"
        model.save_pretrained(str(tmp), safe_serialization=True)
        os.replace(tmp, target)
        size = sum(f.stat().st_size for f in target.iterdir() if f.suffix == ".safetensors")
        try:
            client.load_adapter(f"grpokit-v{self.version}", str(target))
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        if self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
        self._adapter_dir = target
        return size
