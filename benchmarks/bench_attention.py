"""One layer's attention on a CPU, SDPA against transformers' eager computation, forward and backward: the study
behind benchmarks/RESULTS.md, 'Eager attention for short bf16 forwards: measured, not adopted'.

SmolLM2-135M's heads (9 query heads over 3 key/value heads of 64); rows × queries × keys as the trainer's forwards
run them (a completion forward after its prompt's cache, a prompt forward, longer sequences), in bf16 and float32.
Eager: ``softmax(q·kᵀ·scale + mask)`` in float32, cast back, times ``v`` (transformers' ``eager_attention_forward``
with the key/value heads repeated). Medians of alternated repeats; nothing written (the numbers go to RESULTS.md by
hand, with this command).

    python benchmarks/bench_attention.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, DIM = 9, 3, 64
SHAPES = [(17, 7, 60), (8, 26, 53), (32, 25, 52), (8, 64, 128), (8, 200, 200), (8, 256, 512), (4, 1024, 1024)]


def _inputs(rows: int, queries: int, keys: int, dtype: torch.dtype):
    q = torch.randn(rows, HEADS, queries, DIM, dtype=dtype, requires_grad=True)
    k = torch.randn(rows, KV_HEADS, keys, DIM, dtype=dtype, requires_grad=True)
    v = torch.randn(rows, KV_HEADS, keys, DIM, dtype=dtype, requires_grad=True)
    return q, k, v, torch.zeros(rows, 1, queries, keys, dtype=dtype)


def _repeat(x: torch.Tensor) -> torch.Tensor:
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, HEADS // h, n, d).reshape(b, HEADS, n, d)


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, _repeat(k), _repeat(v), attn_mask=mask, scale=DIM ** -0.5)


def eager(q, k, v, mask):
    weights = torch.matmul(q, _repeat(k).transpose(2, 3)) * DIM ** -0.5 + mask
    return torch.matmul(torch.softmax(weights, -1, dtype=torch.float32).to(q.dtype), _repeat(v))


def _time(fn, inputs, repeats: int) -> float:
    def once():
        fn(*inputs).sum().backward()

    once()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    print("| dtype | rows × queries × keys | eager weights MB | SDPA ms | eager ms | eager vs SDPA |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for rows, queries, keys in SHAPES:
            inputs = _inputs(rows, queries, keys, dtype)
            repeats = max(3, min(30, int(2e7 // (rows * queries * keys))))
            a, b = _time(sdpa, inputs, repeats), _time(eager, inputs, repeats)
            a, b = min(a, _time(sdpa, inputs, repeats)), min(b, _time(eager, inputs, repeats))
            mb = rows * HEADS * queries * keys * 4 / 2**20
            print(f"| {str(dtype).split('.')[-1]} | {rows} × {queries} × {keys} | {mb:.1f} | {a:.2f} | {b:.2f} | "
                  f"{a / b:.2f}× |", flush=True)
    print(f"\nforward and backward of one layer, {torch.get_num_threads()} threads, torch {torch.__version__}")


if __name__ == "__main__":
    main()
