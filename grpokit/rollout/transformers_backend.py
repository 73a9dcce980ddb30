"""Rollouts with transformers' ``generate``: batched, KV cache, left-padded prompts, the trainer's own weights
(so no sampler/trainer mismatch and no weight sync)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from transformers import GenerationConfig, LogitsProcessorList

from ..forward.prefix import accepts_cache, cache_argument, encode_once_per_group, group_size, inner_causal_lm
from ..moe.recording import GenerationRoutes
from ..moe.routers import find_routers
from .base import Generation, SamplingParams, completion_mask_from_eos, stop_token_ids
from .decode import decode, decodes, token_chooser
from .llama_decode import OWN_HOOK
from .packed import foldable_lora, lora_folded, packed_linears, packed_weight
from .precision import ROLLOUT_PRECISIONS, GenerationCopy, copy_precision
from .sampling import InverseCDFSampler, fast_sampler

__all__ = ["InverseCDFSampler", "TransformersRollout", "fast_sampler", "lora_merged"]


@contextlib.contextmanager
def lora_merged(model: torch.nn.Module) -> Iterator[bool]:
    """LoRA adapters folded into the base weights while generating: one matmul per layer instead of three (less
    rollout time for SmolLM2 with r=16 on all linear layers in float32: benchmarks/RESULTS.md, 'Measurements behind
    design choices'), and the base weights given back exactly
    after. Yields whether it merged.

    A float32/float64 base is merged and unmerged (back to ~1e-8). A bf16/fp16 base would be rounded twice by that
    and drift, generation after generation (by ~0.005 after five generations of a tiny model), so on a CPU its
    LoRA-wrapped weights are copied first and copied back after: exact, for one copy of those weights in memory.
    That merge is what lets a bf16 model generate in bf16 on a CPU: left unmerged, every LoRA layer casts its input
    to the adapter's float32 and back, and that costs as much as bf16 saves. Where oneDNN computes bf16 the adapters
    are folded into packed weights instead (:func:`decoding_weights`), and this merge is not used. On an accelerator
    a bf16/fp16 base is not merged (the copy would take accelerator memory; generating with the adapter on the side
    is what TRL does), nor is a quantised base (QLoRA, 4-/8-bit)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    tuner_layers = [m for m in base.modules() if hasattr(m, "merged_adapters")]  # PEFT's record of what is merged
    if (not hasattr(model, "merge_adapter") or not getattr(model, "peft_config", None)
            or any(m.merged_adapters for m in tuner_layers)  # merged by the user: left as it is
            or getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False)):
        yield False
        return
    wrapped = [p for n, p in base.named_parameters() if "base_layer" in n]
    rounded = [p for p in wrapped if p.dtype not in (torch.float32, torch.float64)]
    if any(not p.dtype.is_floating_point or p.device.type != "cpu" for p in rounded):
        yield False
        return
    backup = [(p, p.detach().clone()) for p in rounded]
    model.merge_adapter()
    try:
        yield True
    finally:
        if len(rounded) < len(wrapped):
            model.unmerge_adapter()  # the float32 weights among them come back by unmerging
        with torch.no_grad():
            for p, saved in backup:
                p.copy_(saved)
        if len(rounded) == len(wrapped):  # all restored from the copy: only PEFT's record of the merge is left
            for layer in tuner_layers:  # (unmerging would recompute every ΔW: time spent to no use)
                layer.merged_adapters = []


@contextlib.contextmanager
def decoding_weights(model: torch.nn.Module, pack: bool, rows_hint: int = 32,
                     precision: str | None = None) -> Iterator[None]:
    """The weights generation computes with: on a CPU in float32, or bf16 where oneDNN computes it (``pack``;
    :func:`grpokit.rollout.packed.packable_dtypes`), packed, with every LoRA adapter folded
    into its layer's packed weight where all of them can be (:func:`grpokit.rollout.packed.foldable_lora`: the
    model's own weights are not written); else the adapters merged (:func:`lora_merged`) and then packed. With a
    ``precision`` (:func:`grpokit.rollout.precision.copy_precision`), copies of the linear layers in it, made from the
    weights as they are on entry, the adapters folded in the same way."""
    copying = precision is not None
    with contextlib.ExitStack() as stack:
        if not ((pack or copying) and (foldable_lora(model, precision) or lora_folded(model))):  # (folded by an
            stack.enter_context(lora_merged(model))  # enclosing block: left so)
        if pack or copying:
            stack.enter_context(packed_linears(model, rows_hint, precision))
        yield


@contextlib.contextmanager
def contiguous_head_input(model: torch.nn.Module) -> Iterator[None]:
    """transformers' causal LMs hand their LM head the prefill's last position as a strided view,
    ``hidden[:, -1:, :]``; on a CPU torch's matmul then expands the head's weight to (B, D, V) and copies it
    (for 32 rows of SmolLM2 hundreds of times slower than a contiguous input in bf16, several times in float32:
    benchmarks/RESULTS.md, 'Measurements behind design choices'). A
    pre-hook on the head makes its input contiguous while generating."""
    inner = inner_causal_lm(model) or model
    try:
        head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    except (AttributeError, NotImplementedError):
        head = None
    if not isinstance(head, torch.nn.Module):
        yield
        return

    def make_contiguous(module, args):
        if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
            return (args[0].contiguous(), *args[1:])
        return None

    setattr(make_contiguous, OWN_HOOK, True)

    handle = head.register_forward_pre_hook(make_contiguous)
    try:
        yield
    finally:
        handle.remove()


def _can_share(model: torch.nn.Module, config: GenerationConfig, prompt_len: int) -> bool:
    """Whether each prompt can be prefilled once for its group. Not with sharded weights (FSDP / ZeRO-3): the
    prefill runs a forward of the causal LM inside the wrappers, which FSDP2 refuses outside its root module's
    forward (as the training forward's sharing, ``grpokit.forward.logprobs``, is never used there either)."""
    from ..forward.sharding import sharding_kind

    if sharding_kind(model) is not None:
        return False
    if prompt_len < 2 or getattr(config, "cache_implementation", None) not in (None, "dynamic"):
        return False
    if (getattr(config, "num_beams", None) or 1) != 1 or (getattr(config, "num_return_sequences", None) or 1) != 1:
        return False  # unset fields are None in transformers 5
    inner = inner_causal_lm(model)  # PEFT's LoRA layers are inside it: a forward of it applies them
    cfg = getattr(inner, "config", None)
    if cfg is None or getattr(cfg, "is_encoder_decoder", False):
        return False
    return accepts_cache(inner, "logits_to_keep")


class TransformersRollout:
    holds_weights = False
    """The default backend. ``generate`` runs in eval mode under ``no_grad`` and restores the training mode.

    ``share_prompt_prefill``: when the rows come as groups of ``G`` identical prompts, each prompt is encoded
    once and its KV cache repeated ``G`` times instead of being prefilled ``G`` times, and in the decode loop the
    tokens all prompts begin with (a chat template's system turn) are encoded once for the call and a group's rows run
    as one while they draw the same tokens (sampling is unchanged: the same tokens come out up to float rounding).

    ``decode_loop``: on a CPU, sample with :func:`grpokit.rollout.decode.decode` — the same model forward and
    distribution, finished rows dropped from the batch — wherever it applies (else ``generate``).

    ``pack_weights``: on a CPU, the float32 (and, where oneDNN computes bf16, the bf16) linear layers compute with
    weights packed for oneDNN while generating
    (:mod:`grpokit.rollout.packed`), once per call or once for a whole generation batch (:meth:`generation_batch`).

    ``rollout_precision`` (:mod:`grpokit.rollout.precision`): ``"float32"``, ``"bf16"`` or ``"int8"`` sample on a
    CPU with copies of the linear layers in that precision, made when a generation batch (or a call outside one)
    starts, so from the weights of the latest optimizer step; the completions then carry the sampler's own log-probs
    (:attr:`grpokit.rollout.base.Generation.sampler_logps`) for the trainer's mismatch correction. ``"auto"``: the
    policy's own weights.
    """

    def __init__(self, tokenizer, max_batch_size: int | None = None, share_prompt_prefill: bool = True,
                 decode_loop: bool = True, pack_weights: bool = True, rollout_precision: str = "auto"):
        if rollout_precision not in ROLLOUT_PRECISIONS:
            from ..validation import refusal

            raise refusal("rollout_precision", rollout_precision, f"expected one of {', '.join(ROLLOUT_PRECISIONS)}")
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.share_prompt_prefill = share_prompt_prefill
        self.decode_loop = decode_loop
        self.pack_weights = pack_weights
        self.rollout_precision = rollout_precision

    def copy_precision(self, model: torch.nn.Module) -> str | None:
        """The precision ``model``'s linear layers are copied into for sampling (None: its own weights sample)."""
        return copy_precision(self.rollout_precision, model)

    def generation_config(self, model: torch.nn.Module, params: SamplingParams) -> GenerationConfig:
        """``params`` as transformers' generation config; a vision-language model never samples its image
        placeholder tokens (as in TRL: one would not match any image features)."""
        from ..vision.detection import image_token_ids

        eos = stop_token_ids(model, self.tokenizer)
        kwargs = dict(
            max_new_tokens=params.max_new_tokens,
            do_sample=params.do_sample,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=eos,
            use_cache=True,
        )
        if params.do_sample:
            kwargs.update(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,  # 0 turns top-k off; None would let transformers fill in its default, 50
                min_p=params.min_p,
                repetition_penalty=params.repetition_penalty,
            )
        elif params.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = params.repetition_penalty
        kwargs.update(params.extra)
        if image_ids := image_token_ids(model):
            kwargs["suppress_tokens"] = sorted(set(kwargs.get("suppress_tokens") or []) | set(image_ids))
        return GenerationConfig(**kwargs)

    @torch.no_grad()
    def generate(
        self, model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
        vision=None, images: list | None = None,
    ) -> Generation:
        """Sample one completion per row. ``vision``: the rows' image tensors (:class:`grpokit.vision.VisionInputs`)
        for a vision-language model, passed to ``generate`` (``images``, the PIL images, are for engines that
        process images themselves: not used here)."""
        sampler = fast_sampler(params, prompt_ids.device)  # when set: generate's greedy mode, the last processor samples
        config = self.generation_config(model, dataclasses.replace(params, do_sample=False) if sampler else params)
        precision = None if params.lockstep else self.copy_precision(model)
        was_training = model.training
        model.eval()
        try:
            with contextlib.ExitStack() as stack:
                if not params.lockstep:  # a shard cannot take the merge
                    stack.enter_context(decoding_weights(model, self.pack_weights, prompt_ids.shape[0], precision))
                stack.enter_context(contiguous_head_input(model))
                record = sampler is not None and _copies_sample(model)  # the sampler is not the trainer's weights
                chunks = self._generate_chunks(model, prompt_ids, prompt_mask, params, config, sampler, vision, record)
        finally:
            model.train(was_training)
        routes = [(r, unrecorded) for _, r, unrecorded, _ in chunks if r is not None]
        logps = [lp for _, _, _, lp in chunks]
        chunks = [c for c, _, _, _ in chunks]
        width = max(c.shape[1] for c in chunks)
        pad = self.tokenizer.pad_token_id
        completion_ids = torch.cat(
            [torch.nn.functional.pad(c, (0, width - c.shape[1]), value=pad) for c in chunks], 0
        )
        mask, truncated = completion_mask_from_eos(completion_ids, config.eos_token_id)
        completion_ids = completion_ids.masked_fill(mask == 0, pad)
        gen = Generation(completion_ids=completion_ids, completion_mask=mask, is_truncated=truncated)
        if record:
            sampled = torch.cat([torch.nn.functional.pad(lp[:, :width], (0, width - min(lp.shape[1], width)))
                                 for lp in logps], 0)
            gen.sampler_logps = sampled.masked_fill(mask == 0, 0.0)
        if len(routes) == len(chunks):  # (rows, P + C_chunk, L, k) a chunk: the completions' part padded to C
            p = prompt_ids.shape[1]
            gen.prompt_routes = torch.cat([r[:, :p] for r, _ in routes])
            gen.completion_routes = torch.cat([_pad_positions(r[:, p:], width, u) for r, u in routes])
        return gen

    def _generate_chunks(self, model, prompt_ids, prompt_mask, params: SamplingParams, config, sampler,
                         vision=None, record: bool = False) -> list:
        """Generation in chunks of ``max_batch_size`` rows: per chunk ``(completion ids, routes, unrecorded,
        the sampler's log-probs)``, the last two None unless recorded (``record``: the sampled tokens' log-probs, as
        (rows, ≥ the completion's width)). Rows with images are not prefilled once per group (the prefill would have
        to carry each family's image positions into ``generate``): each row is prefilled."""
        step = self.max_batch_size or prompt_ids.shape[0]
        share = self.share_prompt_prefill and not params.lockstep and _can_share(model, config, prompt_ids.shape[1])
        loop = self._decode_loop(model, params, sampler, prompt_ids.device, record) if vision is None else None
        chunks = []
        routers = _routers(model) if params.record_routes and not params.lockstep else None
        for start in range(0, prompt_ids.shape[0], step):
            ids, mask = prompt_ids[start:start + step], prompt_mask[start:start + step]
            logps = torch.zeros(ids.shape[0], params.max_new_tokens) if record else None
            with _recording(model, routers, ids.shape[0]) as recorder:
                if loop is not None:  # the fast path: finished rows leave the batch (grpokit/rollout/decode.py)
                    out = loop(ids, mask, group_size(ids, mask) if share else 1, share, recorder, logps)
                else:
                    if record:
                        sampler.recorded = []
                    try:
                        out = self._generate_chunk(model, ids, mask, start, params, config, sampler, share, vision)
                    finally:
                        steps = sampler.recorded if record else None
                        if record:
                            sampler.recorded = None
                    if record:
                        logps = torch.stack(steps, 1) if steps else logps[:, :0]
            routes = recorder.routes(ids.shape[1] + out.shape[1]) if recorder is not None else None
            chunks.append((out, routes, routers.unrecorded if routers is not None else None, logps))
        return chunks

    def _generate_chunk(self, model, ids, mask, start: int, params: SamplingParams, config, sampler, share: bool,
                        vision=None) -> torch.Tensor:
        """One chunk through ``generate``: the completion ids."""
        kwargs = {"synced_gpus": params.lockstep}  # explicit: transformers' own test misses accelerate's FSDP2
        if vision is not None:
            kwargs.update(vision.select(range(start, start + ids.shape[0])).model_kwargs(ids.shape[1]))
        g = group_size(ids, mask) if share and len(kwargs) == 1 else 1
        if g > 1:  # prefill each prompt once, all but its last token: generate then runs that one per row
            kwargs[cache_argument()], _ = encode_once_per_group(inner_causal_lm(model), ids[:, :-1], mask[:, :-1], g)
        if sampler is not None:
            kwargs["logits_processor"] = LogitsProcessorList([sampler])
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, **kwargs)
        return out[:, ids.shape[1]:]

    def _decode_loop(self, model, params: SamplingParams, sampler, device: torch.device, record: bool = False):
        """``loop(ids, mask, group, share) -> completion ids`` with :func:`grpokit.rollout.decode.decode` when it
        applies (on a CPU, sampling with the fast sampler or greedy, a causal LM whose cache can drop rows, weights not
        sharded), else None (``generate``)."""
        from ..forward.sharding import sharding_kind

        inner = inner_causal_lm(model)
        if (not self.decode_loop or device.type != "cpu" or (params.do_sample and sampler is None)
                or sharding_kind(model) is not None or not decodes(inner, params)):
            return None
        choose = token_chooser(params, sampler if params.do_sample else None, with_logps=record)
        eos, pad = stop_token_ids(model, self.tokenizer), self.tokenizer.pad_token_id
        min_new = int(params.extra.get("min_new_tokens") or 0)
        return lambda ids, mask, group, share, recorder, logps: decode(
            inner, ids, mask, max_new_tokens=params.max_new_tokens, eos_ids=eos, pad_id=pad, choose=choose,
            min_new_tokens=min_new, group=group, share_prompt=share, recorder=recorder, sampled_logps=logps)

    def sync_weights(self, model: torch.nn.Module, step: int | None = None) -> None:  # the sampler is the trainer's model itself
        return None

    @contextlib.contextmanager
    def generation_batch(self, model: torch.nn.Module):
        """The adapter merged (or folded into packed weights) once for every call of one generation batch (each
        call's own :func:`decoding_weights` then finds it done and leaves it): a fraction of a second saved a call for
        SmolLM2 in bf16 on a CPU (benchmarks/RESULTS.md, 'Measurements behind design choices'); and the weights
        packed once (``pack_weights``), or copied into ``rollout_precision`` once. Not for sharded weights (the
        trainer does not enter it there)."""
        with decoding_weights(model, self.pack_weights, precision=self.copy_precision(model)):
            yield


def _copies_sample(model: torch.nn.Module) -> bool:
    """Whether ``model``'s linear layers compute with :class:`grpokit.rollout.precision.GenerationCopy` copies."""
    return any(isinstance(packed_weight(m), GenerationCopy) for m in model.modules())


def _pad_positions(routes: torch.Tensor, width: int, unrecorded: int) -> torch.Tensor:
    """(N, W, L, k) routes padded with ``unrecorded`` to ``width`` positions."""
    return torch.nn.functional.pad(routes, (0, 0, 0, 0, 0, width - routes.shape[1]), value=unrecorded)


def _routers(model: torch.nn.Module):
    """The Mixture-of-Experts policy's routers to record while generating; None where they cannot be read (a router
    whose weights are not whole here)."""
    try:
        return find_routers(inner_causal_lm(model) or model)
    except ValueError:
        return None


@contextlib.contextmanager
def _recording(model: torch.nn.Module, routers, rows: int) -> Iterator[GenerationRoutes | None]:
    """A Mixture-of-Experts policy's experts recorded while a chunk of ``rows`` rows generates (``routers``: its
    :class:`grpokit.moe.RouterSet`; None: nothing recorded)."""
    if routers is None:
        yield None
        return
    with GenerationRoutes(inner_causal_lm(model) or model, routers, rows) as recorder:
        yield recorder
