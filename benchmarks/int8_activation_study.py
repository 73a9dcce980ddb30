"""A study, not a feature: would int8 *activations* (W8A8) make int8 rollouts pay where int8 weight-only does not?

``rollout_precision="int8"`` multiplies bf16 activations by int8 weights with torch's ``_weight_int8pack_mm``, which
is bound by its arithmetic on the CPUs measured (benchmarks/RESULTS.md, "Rollout precision": a decode step 1.27× /
0.95× a float32 model's at 8 / 32 rows on an AMD EPYC). FBGEMM's dynamic int8 product
(``torch.ops.quantized.linear_dynamic``: the activations quantised per tensor as they come, int8 × int8 with VNNI or
AVX2's ``vpmaddubsw``, the same int8 per-channel weights) is the fast int8 kernel torch ships for x86. This measures,
at the demo's shapes, what it does to a decode step's time and to the sampler/trainer mismatch, in three forms:

- ``int8``: grpokit's weight-only copies (the reference);
- ``w8a8``: every linear layer through FBGEMM, activations quantised per tensor (8 bits; 7 with ``--reduce-range``,
  what a CPU without VNNI needs against overflow in ``vpmaddubsw``);
- ``w8a8-smooth``: the same after SmoothQuant's migration (Xiao et al., 2023): per input channel ``j``
  ``s_j = max|X_j|^α / max|W_j|^(1-α)`` (``--alpha``, 0.5 by default; ``max|X_j|`` from one forward of the
  prompts), the layer computing ``(X / s) · (W · s)ᵀ``, which moves the activations' outlier channels into the
  weights.

Only the copies' kernel changes (the study swaps grpokit's ``GenerationCopy`` for a subclass while it runs); the
decode loop, the flat Llama step, sampling and the mismatch (k3 on the sampler's top-k support, as
``bench_rollout_precision.py`` computes it) are grpokit's. Prints a table; writes nothing.

    python benchmarks/int8_activation_study.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \\
        python benchmarks/int8_activation_study.py --reduce-range      # as on a CPU with AVX2 only
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_rollout_precision import GROUP, TEMPERATURE, TOP_K, mismatch, prompts  # noqa: E402

import grpokit.rollout.packed as packed  # noqa: E402
import grpokit.rollout.transformers_backend as backend_module  # noqa: E402
from grpokit.models import load_model, load_tokenizer  # noqa: E402
from grpokit.rollout.base import SamplingParams  # noqa: E402
from grpokit.rollout.precision import GenerationCopy, quantize_int8  # noqa: E402
from grpokit.rollout.transformers_backend import TransformersRollout  # noqa: E402

STUDY = {"mode": "int8", "reduce_range": False, "alpha": 0.5, "act_max": {}}
"""The variant the copies made next take (``int8``, ``w8a8``, ``w8a8-smooth``) and the calibration."""


class StudyCopy(GenerationCopy):
    """grpokit's int8 copy, or (``STUDY["mode"]`` ``w8a8*``) the same weights through FBGEMM's dynamic product."""

    def __init__(self, weight, precision, rows_hint=32, dtype=None, packable=()):
        super().__init__(weight, precision, rows_hint, dtype, packable)
        self.fbgemm = None
        if precision != "int8" or STUDY["mode"] == "int8":
            return
        w = weight.detach().float()
        self.inv_s = None
        if STUDY["mode"] == "w8a8-smooth":
            x_max = STUDY["act_max"][weight.data_ptr()].clamp_min(1e-5)
            a = STUDY["alpha"]
            s = (x_max ** a / w.abs().amax(0).clamp_min(1e-5) ** (1 - a)).clamp_min(1e-5)
            w, self.inv_s = w * s[None, :], (1 / s)[None, :]
        q = quantize_int8(w)
        with warnings.catch_warnings():  # torch 2.13 warns that quantized tensors will go
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(q.q, q.scale.double(),
                                                          torch.zeros(w.shape[0], dtype=torch.long), 0)
            self.fbgemm = torch.ops.quantized.linear_prepack(qw, None)

    def __call__(self, rows, bias):
        if self.fbgemm is None:
            return super().__call__(rows, bias)
        x = rows.float() if self.inv_s is None else rows.float() * self.inv_s
        out = torch.ops.quantized.linear_dynamic(x, self.fbgemm, STUDY["reduce_range"]).to(self.dtype)
        return out if bias is None else out + bias


def calibrate(model, ids, mask) -> None:
    """``max|X_j|`` of every linear layer's input over one forward of the prompts (SmoothQuant's statistic)."""
    hooks = []

    def record(module, args):
        x = args[0].detach().float().flatten(0, -2).abs().amax(0)
        key = module.weight.data_ptr()
        STUDY["act_max"][key] = torch.maximum(STUDY["act_max"].get(key, x), x)

    for m in model.modules():
        if type(m) is torch.nn.Linear:
            hooks.append(m.register_forward_pre_hook(record))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for h in hooks:
        h.remove()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--questions", type=int, nargs="+", default=[2, 8], help="prompts per call (× 4 completions)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["int8", "w8a8", "w8a8-smooth"])
    ap.add_argument("--reduce-range", action="store_true", help="7-bit activations (a CPU without VNNI)")
    ap.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant's migration strength")
    args = ap.parse_args()
    STUDY["reduce_range"], STUDY["alpha"] = args.reduce_range, args.alpha
    packed.GenerationCopy = backend_module.GenerationCopy = StudyCopy
    tok = load_tokenizer("smollm2-135m-instruct")
    model = load_model("smollm2-135m-instruct", dtype=args.dtype).eval()
    params = SamplingParams(max_new_tokens=args.tokens, temperature=TEMPERATURE, top_k=TOP_K,
                            extra={"min_new_tokens": args.tokens})
    own, int8 = TransformersRollout(tok), TransformersRollout(tok, rollout_precision="int8")
    print("| rows | sampling | ms / decode step (median) | vs the model's own | mismatch k3 | max abs log r |")
    print("|---|---|---|---|---|---|")
    for questions in args.questions:
        ids, mask = prompts(tok, questions)
        calibrate(model, ids, mask)
        names = ["auto", *args.variants]
        steps, gaps = {n: [] for n in names}, {}
        for r in range(args.repeats + 1):
            for name in names if r % 2 == 0 else names[::-1]:
                STUDY["mode"] = name
                rollout = own if name == "auto" else int8
                torch.manual_seed(r)
                with rollout.generation_batch(model):
                    t0 = time.perf_counter()
                    gen = rollout.generate(model, ids, mask, params)
                    t1 = time.perf_counter()
                    free = None
                    if r == 1 and name != "auto":
                        free = rollout.generate(model, ids, mask, dataclasses.replace(params, extra={}))
                if free is not None:  # the trainer's log-probs: the model's own layers, outside the copies' block
                    gaps[name] = mismatch(model, ids, mask, free)
                if r:
                    steps[name].append(1000 * (t1 - t0) / gen.completion_ids.shape[1])
        base = statistics.median(steps["auto"])
        for name in names:
            ms = statistics.median(steps[name])
            k3, gap = gaps.get(name, (0.0, 0.0))
            print(f"| {questions * GROUP} | {name} | {ms:.1f} | {base / ms:.2f}× | {k3:.1e} | {gap:.3f} |", flush=True)


if __name__ == "__main__":
    main()
