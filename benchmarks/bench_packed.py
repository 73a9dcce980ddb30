"""One decode step of SmolLM2-135M (float32, or bf16 with ``--dtype bfloat16`` where oneDNN computes bf16; one new
token per row after a 52-token prompt) with the linear layers on oneDNN-packed weights (grpokit/rollout/packed.py) and
without, alternating, for a few batch sizes.

    python benchmarks/bench_packed.py
    python benchmarks/bench_packed.py --dtype bfloat16 --rows 8 32 128
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from _common import decode_step_ms, write_section


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the weights' dtype")
    ap.add_argument("--no-write", action="store_true", help="print only; RESULTS.md unchanged")
    args = ap.parse_args()
    from grpokit.models import load_model
    from grpokit.rollout.packed import packable_dtypes, packed_linears

    if getattr(torch, args.dtype) not in packable_dtypes():
        raise SystemExit(f"--dtype {args.dtype}: oneDNN packs no {args.dtype} weights on this CPU")
    model = load_model("smollm2-135m-instruct", dtype=args.dtype).eval()
    table = ["| rows | plain ms (median) | packed ms (median) | plain / packed |", "|---|---|---|---|"]
    for rows in args.rows:
        ms = decode_step_ms(model, rows, {"plain": contextlib.nullcontext,
                                          "packed": lambda rows=rows: packed_linears(model, rows)}, args.repeats)
        plain, packed = ms["plain"], ms["packed"]
        table.append(f"| {rows} | {plain:.1f} | {packed:.1f} | {plain / packed:.2f}× |")
        print(table[-1], flush=True)
    body = "\n".join(table) + (
        f"\n\nThe time of the one-token forward only (its prefill and the packing, ~0.2 s once per generation batch, "
        f"not counted); median of {args.repeats} alternated repeats after a warm-up round.")
    if not args.no_write:
        command = "python benchmarks/bench_packed.py" + ("" if args.dtype == "float32" else f" --dtype {args.dtype}")
        write_section(f"A decode step on packed weights (SmolLM2-135M, {args.dtype})", command, body)


if __name__ == "__main__":
    main()
