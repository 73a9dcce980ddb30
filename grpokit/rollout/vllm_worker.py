"""The piece of grpokit that runs inside vLLM's workers: a worker extension (vLLM's ``worker_extension_cls``) that
loads the trainer's weights from a safetensors file.

Where NCCL does not exist (a CPU), the trainer writes its weights into one file in shared memory (``/dev/shm``)
and asks every worker, through vLLM's ``collective_rpc`` (the server's ``POST /collective_rpc``, or
``LLM.collective_rpc`` in colocate mode), to load it: :meth:`WeightFileLoader.grpokit_load_weights`. The file's
tensors carry the plain base model's names (:func:`grpokit.rollout.vllm_backend.engine_weights`); vLLM's
``reload_weights`` maps them onto its fused layers (``qkv_proj``, ``gate_up_proj``) and repacks each layer into its
kernel's format (a CPU's engine repacks after loading: a plain ``load_weights`` there writes into emptied tensors).

This module imports nothing from grpokit and only torch and safetensors, because vLLM imports it in its worker
processes (``--worker-extension-cls grpokit.rollout.vllm_worker.WeightFileLoader``).
"""

from __future__ import annotations

import hashlib
import os


class WeightFileLoader:
    """Mixed into vLLM's worker class; ``self.model_runner`` is the worker's."""

    def grpokit_load_weights(self, path: str, expected_tensors: str = "") -> dict:
        """Load every tensor of the safetensors file ``path`` into the engine's model. Returns what was loaded:
        ``{"tensors": n, "bytes": b, "digest": d}`` (``d``: a hash of the names and byte sizes, so the trainer can
        tell the file it wrote was the one read). ``expected_tensors`` (a decimal string: ``collective_rpc`` over
        HTTP passes strings only): refuse a file holding another number of tensors (a torn or foreign file)."""
        from safetensors.torch import load_file

        if not os.path.isfile(path):
            raise FileNotFoundError(f"grpokit weight file {path!r} does not exist in the engine's worker (the engine "
                                    "must run on the trainer's machine to read its shared memory)")
        tensors = load_file(path)
        if expected_tensors and len(tensors) != int(expected_tensors):
            raise ValueError(f"grpokit weight file {path!r} holds {len(tensors)} tensors, expected {expected_tensors}")
        digest = hashlib.sha256()
        for name in sorted(tensors):
            digest.update(f"{name}:{tensors[name].numel() * tensors[name].element_size()};".encode())
        read = {"tensors": len(tensors), "bytes": int(sum(t.numel() * t.element_size() for t in tensors.values())),
                "digest": digest.hexdigest()[:16]}
        dtype = getattr(getattr(self, "model_config", None), "dtype", None)
        if dtype is not None and dtype.is_floating_point:  # a float32 trainer's weights for a bf16 engine: cast here
            tensors = {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
        runner = self.model_runner
        if hasattr(runner, "reload_weights"):  # vLLM's in-place reload: repacks each layer into its kernel's format
            runner.reload_weights(weights_iterator=iter(tensors.items()))
        else:  # an engine that keeps the checkpoint's layout (CUDA without repacking)
            runner.model.load_weights(weights=iter(tensors.items()))
        return read
