"""Generation in another precision than training (``rollout_precision``): the weights a decode step reads, copied.

(For vLLM the same field sets the engine's dtype and quantisation: :data:`VLLM_ENGINE_ARGS`.)

``"auto"`` samples with the policy's own weights (packed for oneDNN on a CPU: :mod:`grpokit.rollout.packed`), so
sampler and trainer are one distribution — except where bf16 copies of a float32 policy are measured faster and the
correction applies (:mod:`grpokit.rollout.auto_precision`: a CPU with AMX), which the trainer says in one line.
``"float32"``, ``"bf16"`` and ``"int8"`` sample with *copies* of the policy's linear layers in that precision, made
from the current weights (every LoRA adapter folded in) each time a generation batch starts — so after every optimizer
step — while training keeps its own. The embedding lookup, norms, rotary embedding and attention stay in the model's
dtype.

``int8`` is per-output-channel symmetric weight-only quantisation, what vLLM's ``int8`` weight-only and the FP8
rollouts of verl and NeMo-RL do for a GPU: row ``i`` of ``W`` becomes ``q_i · s_i`` with ``q_i`` int8 in
[-127, 127] and ``s_i`` a bf16 scale not below ``max|W_i| / 127`` (so no weight is clipped). A layer computes
``(x in bf16) · (q·s)ᵀ`` with float32 accumulation (torch's ``_weight_int8pack_mm``), its output rounded to bf16 and
cast back to the model's dtype, plus the bias. A decode step then reads a quarter of float32's bytes, half of bf16's.

A copy samples from a slightly different distribution than the policy the loss differentiates: the sampler's own
log-probs of the tokens it drew travel with the batch (:attr:`grpokit.rollout.base.Generation.sampler_logps`), and
the sampler correction of docs/algorithms.md §5 (``vllm_importance_sampling_*``) applies to them as to a vLLM
engine's, with its mismatch metrics logged. What a refresh costs and how fast each precision decodes on the CPUs
measured: benchmarks/RESULTS.md, "Rollout precision".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROLLOUT_PRECISIONS = ("auto", "float32", "bf16", "int8")
"""``rollout_precision``'s values; ``"auto"``: the policy's own weights (no copy), or what
:mod:`grpokit.rollout.auto_precision` chooses for the trainer."""

_DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}

VLLM_ENGINE_ARGS: dict[str, dict[str, str]] = {
    "auto": {},
    "float32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"quantization": "fp8_per_channel", "dtype": "bfloat16"},
}
"""``rollout_precision`` as vLLM's engine arguments (``use_vllm=True``): the engine's dtype, and for ``"int8"`` its
8-bit weights, quantised per output channel when it loads them (vLLM 0.32's ``fp8_per_channel``, which takes bf16 or
fp16: FP8 weights with per-token FP8 activations, on a GPU and in vLLM's CPU build; vLLM's own int8 weight-only
quantises only the experts of a Mixture-of-Experts model, not its linear layers). ``"auto"``: the engine's defaults."""


def copy_precision(precision: str, model: torch.nn.Module) -> str | None:
    """The precision generation copies ``model``'s linear layers into for ``rollout_precision=precision``: None for
    ``"auto"`` and for the dtype the model's linear layers already have (its own weights are then what samples)."""
    if precision == "auto":
        return None
    if precision == "int8":
        return "int8"
    dtypes = {m.weight.dtype for m in model.modules() if type(m) is torch.nn.Linear and m.weight.is_floating_point()}
    return None if dtypes == {_DTYPES[precision]} else precision


@dataclass
class Int8Weight:
    """A weight ``(out, in)`` quantised per output channel: ``q`` int8, ``scale`` (out,) bf16; ``q·scale`` is the
    weight the copy computes with (:meth:`dequantized`)."""

    q: torch.Tensor
    scale: torch.Tensor

    def dequantized(self) -> torch.Tensor:
        """``q · scale`` in float32 (exact: an int8 times a bf16 is representable in float32)."""
        return self.q.float() * self.scale.float()[:, None]


@torch.no_grad()
def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """``weight`` (out, in) as :class:`Int8Weight`: per row the bf16 scale ``s`` nearest ``max|w| / 127`` from above
    (a row of zeros: 1), then ``q = round(w / s)``, which lies in [-127, 127]."""
    w = weight.detach().float()
    amax = w.abs().amax(1)
    scale = (amax / 127).to(torch.bfloat16)
    low = scale.float() * 127 < amax
    scale = torch.where(low, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


class GenerationCopy:
    """What a layer computes with while generating in another precision: ``copy(rows, bias)`` for ``rows`` (N, in)
    of the model's dtype :attr:`dtype` (default ``weight``'s), returning that dtype. ``weight``: the layer's current
    weight (a LoRA layer's with its adapter folded in, in float32). A float32 or bf16 copy is packed for oneDNN where
    its dtype is in ``packable`` (:func:`grpokit.rollout.packed.packable_dtypes`)."""

    def __init__(self, weight: torch.Tensor, precision: str, rows_hint: int = 32, dtype: torch.dtype | None = None,
                 packable: tuple[torch.dtype, ...] = ()):
        self.dtype = dtype or weight.dtype
        self.precision = precision
        if precision == "int8":
            self.int8 = quantize_int8(weight)
            self.weight = None
            # torch's kernel reads past the end of a row whose length is not a multiple of 16 (it crashed for
            # 4+ rows of 40 inputs): such a layer gets zero columns, and its input as many zeros
            self.pad = -weight.shape[1] % 16
            self.q = torch.nn.functional.pad(self.int8.q, (0, self.pad)) if self.pad else self.int8.q
            return
        self.int8 = None
        target = _DTYPES[precision]
        w = weight.detach().to(target)
        self.packed = target in packable
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows_hint) if self.packed else w

    def __call__(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.int8 is not None:
            x = rows.to(torch.bfloat16)
            x = torch.nn.functional.pad(x, (0, self.pad)) if self.pad else x.contiguous()
            out = torch.ops.aten._weight_int8pack_mm(x, self.q, self.int8.scale).to(self.dtype)
            return out if bias is None else out + bias
        x = rows.to(self.weight.dtype).contiguous()
        if self.packed:
            out = torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        else:
            out = torch.nn.functional.linear(x, self.weight)
        out = out.to(self.dtype)
        return out if bias is None else out + bias

    def reference_weight(self) -> torch.Tensor:
        """The weight this copy multiplies by, in float32 (tests and benchmarks): ``q·s`` for int8, else the cast."""
        if self.int8 is not None:
            return self.int8.dequantized()
        if self.packed:
            raise ValueError("a packed copy does not give its weight back")
        return self.weight.float()


def bytes_per_decode_step(model: torch.nn.Module, precision: str | None) -> int:
    """The bytes of linear-layer weights one decode step reads with ``precision``'s copies (None: the model's own):
    every ``nn.Linear`` weight once (a tied head counts: the step multiplies by it)."""
    total = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            n = m.weight.numel()
            if precision is None:
                total += n * m.weight.element_size()
            elif precision == "int8":
                total += n + 2 * m.weight.shape[0]
            else:
                total += n * _DTYPES[precision].itemsize
    return total

