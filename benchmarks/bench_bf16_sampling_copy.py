"""Would a bf16 copy of a float32 model's linear weights make its decode faster? One decode step of SmolLM2-135M
in float32 (one new token per row after a 52-token prompt), its linear layers on oneDNN-packed weights as grpokit
generates (grpokit/rollout/packed.py), against the same step with every linear layer computing on a packed bf16 copy
of its weight (the input cast to bf16, the output back to float32; the rest of the model in float32), alternating.

That copy is the candidate for sampling a float32 policy faster (it halves the bytes a decode step reads); it would
sample from slightly other logits, so it would need an importance-sampling correction in the loss. This measures only
whether it is faster; grpokit does not sample that way.

    python benchmarks/bench_bf16_sampling_copy.py
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python benchmarks/bench_bf16_sampling_copy.py --no-write
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
from _common import decode_step_ms, write_section


@contextlib.contextmanager
def bf16_copy(model: torch.nn.Module, rows: int):
    """Every float32 ``nn.Linear`` of ``model`` computes on a packed bf16 copy of its weight inside the block."""
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32]
    for layer in layers:
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach().bfloat16(), rows)
        bias = None if layer.bias is None else layer.bias.detach().bfloat16()

        def forward(x, packed=packed, bias=bias):
            flat = x.reshape(-1, x.shape[-1]).contiguous().bfloat16()
            out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
            return out.float().reshape(*x.shape[:-1], out.shape[-1])

        layer.forward = forward
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-write", action="store_true", help="print only; RESULTS.md unchanged")
    args = ap.parse_args()
    from grpokit.models import load_model
    from grpokit.rollout.packed import packable_dtypes, packed_linears

    if torch.bfloat16 not in packable_dtypes():
        raise SystemExit("oneDNN computes no bf16 on this CPU: nothing to compare")
    model = load_model("smollm2-135m-instruct", dtype="float32").eval()
    table = ["| rows | float32 packed ms (median) | bf16 copy ms (median) | float32 / bf16 copy |", "|---|---|---|---|"]
    for rows in args.rows:
        ms = decode_step_ms(model, rows, {"float32": lambda rows=rows: packed_linears(model, rows),
                                          "bf16": lambda rows=rows: bf16_copy(model, rows)}, args.repeats)
        f32, b16 = ms["float32"], ms["bf16"]
        table.append(f"| {rows} | {f32:.1f} | {b16:.1f} | {f32 / b16:.2f}× |")
        print(table[-1], flush=True)
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    body = "\n".join(table) + (
        f"\n\noneDNN {'capped: ONEDNN_MAX_CPU_ISA=' + cap if cap else 'not capped'}. The one-token forward only (its "
        f"prefill and the packing not counted); median of {args.repeats} alternated repeats after a warm-up round.")
    if not args.no_write:
        write_section("A bf16 copy of a float32 model for decoding (SmolLM2-135M)",
                      "python benchmarks/bench_bf16_sampling_copy.py", body)


if __name__ == "__main__":
    main()
