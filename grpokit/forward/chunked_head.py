"""Per-token log-probs and entropies through the LM head without a (tokens × vocabulary) logits tensor.

``linear_logps_and_entropy(h, W, targets)`` projects the hidden states to the vocabulary one (rows × vocabulary
tile) block at a time, with an online log-sum-exp, in the forward and again (recomputed) in the backward, unless all
the blocks together are small (:data:`KEEP_LOGITS_BYTES`): then the forward keeps them for the backward:

- the matmuls run in the *compute dtype* — the autocast dtype when autocast is on (bf16/fp16 on tensor cores),
  else the head's own dtype — while the log-sum-exp, the entropy and every gradient are accumulated in float32
  (float64 stays float64);
- the block shape is chosen per device (:func:`choose_blocks`): on CPU small blocks that stay in cache; on CUDA
  wide vocabulary tiles (the whole vocabulary when it fits) and many rows per block, under a memory budget, so a
  step is a few large GEMMs rather than thousands of small launches.
"""

from __future__ import annotations

import torch

CPU_BLOCKS = (512, 4096)
"""(rows, vocabulary entries) per block on CPU: a float32 block of 8 MiB (measured fastest on the 2-core CPU)."""
CUDA_BLOCK_BUDGET = 1 << 30
"""Bytes a block may take on CUDA (its logits in the compute dtype and their float32 working copies)."""
BYTES_PER_BLOCK_ELEMENT = 12
"""Peak bytes per logit of a block: the compute-dtype product, a float32 copy and float32 exponentials."""
MIN_CUDA_ROWS = 256
"""Below this many rows per block a GEMM wastes the GPU: the vocabulary is tiled instead."""
MAX_CUDA_ROWS = 8192
KEEP_LOGITS_BYTES = 128 << 20
"""The forward keeps its blocks of logits for the backward when all of them together take at most this many bytes,
and the backward reads them instead of recomputing them: one head matmul (2·N·V·D FLOPs) less per step, for at most
this much memory held from the forward to the head's backward. A GRPO step of SmolLM2-135M with 8 completions of 48
tokens keeps 384 × 49,152 float32 logits (75 MiB) and skips ~22 GFLOPs."""


def choose_blocks(n_rows: int, vocab: int, device_type: str, budget_bytes: int | None = None) -> tuple[int, int]:
    """``(block_rows, block_vocab)`` for projecting ``n_rows`` hidden states onto a vocabulary of ``vocab``.

    CPU (and anything but CUDA): :data:`CPU_BLOCKS`. CUDA: the whole vocabulary in one tile when at least
    :data:`MIN_CUDA_ROWS` rows fit the budget with it, with as many rows as fit (up to :data:`MAX_CUDA_ROWS`);
    otherwise :data:`MIN_CUDA_ROWS` rows and the widest vocabulary tile that fits (a multiple of 128). Never more
    rows than there are."""
    if n_rows < 1 or vocab < 1:
        raise ValueError(f"n_rows={n_rows} and vocab={vocab} must be positive")
    if device_type != "cuda":
        rows, tile = CPU_BLOCKS
        return min(rows, n_rows), min(tile, vocab)
    budget = CUDA_BLOCK_BUDGET if budget_bytes is None else budget_bytes
    rows_at_full_vocab = budget // (vocab * BYTES_PER_BLOCK_ELEMENT)
    if rows_at_full_vocab >= min(MIN_CUDA_ROWS, n_rows):
        return max(1, min(n_rows, rows_at_full_vocab, MAX_CUDA_ROWS)), vocab
    rows = min(n_rows, MIN_CUDA_ROWS)
    tile = budget // (rows * BYTES_PER_BLOCK_ELEMENT) // 128 * 128
    return rows, max(128, min(vocab, tile))


def compute_dtype(device_type: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the head's matmuls run in: autocast's when it is on for the device (as ``nn.Linear`` would run
    there), else the head weight's."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight_dtype


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float32 and narrower dtypes (bf16/fp16 logits are upcast, as the plain path does); float64 stays."""
    return torch.promote_types(dtype, torch.float32)


def _block_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor:
    """``h·wᵀ (+ b)`` in the inputs' dtype, returned in the accumulation dtype."""
    z = h @ w.t() if b is None else torch.addmm(b, h, w.t())
    return z.to(acc)


class _ChunkedLogSoftmax(torch.autograd.Function):
    """``log softmax(h·Wᵀ + b)[target]`` and the entropy per row, one (rows × vocab-tile) block at a time.

    Forward, per row: running max ``m``, ``s = Σ e^(z-m)`` and ``a = Σ e^(z-m)·(z-m)`` over the tiles
    (rescaled by ``e^(m_old - m_new)`` when the max grows), then ``lse = m + log s``, ``H = log s - a/s``.
    Backward recomputes each block: with ``log p = z - lse``,
    ``∂L/∂z = g_lp·(onehot - p) - g_H·p·(log p + H)``, then ``∂h = ∂z·W``, ``∂W = ∂zᵀ·h``, ``∂b = Σ ∂z``.
    ``∂W`` and ``∂b`` are skipped when the weight (a frozen head: LoRA) does not need them. With ``keep`` the forward
    keeps each block's ``z - m`` (``m`` the running max it was shifted by) and the backward forms ``log p`` from it
    instead of recomputing the block. ``h`` arrives scaled
    by ``1/τ`` (the caller folds the temperature into it). Matmuls in ``dtype`` (the compute dtype), sums in
    :func:`accumulation_dtype`.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, targets, compute_entropy, entropy_grad, block_rows, block_vocab, dtype, keep):
        n = h.shape[0]
        acc = accumulation_dtype(dtype)
        hc_all, w_all = h.to(dtype), weight.to(dtype)
        b_all = bias.to(dtype) if bias is not None else None
        kw = dict(device=h.device, dtype=acc)
        m = torch.full((n,), float("-inf"), **kw)
        s = torch.zeros(n, **kw)
        a = torch.zeros(n, **kw) if compute_entropy else None
        picked = torch.zeros(n, **kw)
        kept: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = [] if keep else None
        with torch.autocast(h.device.type, enabled=False):
            for r0 in range(0, n, block_rows):
                r1 = min(n, r0 + block_rows)
                tiles = _forward_rows(hc_all[r0:r1], w_all, b_all, targets[r0:r1], m[r0:r1], s[r0:r1],
                                      a[r0:r1] if a is not None else None, picked[r0:r1], block_vocab, acc, keep)
                if kept is not None:
                    kept.append(tiles)
        log_s = s.log()
        lse = m + log_s
        logp = picked - lse
        ent = (log_s - a / s) if compute_entropy else logp.new_empty(0)
        ctx.save_for_backward(h, weight, bias, targets, lse, ent if compute_entropy else None)
        ctx.entropy_grad = bool(compute_entropy and entropy_grad)
        ctx.blocks = (block_rows, block_vocab)
        ctx.dtype = dtype
        ctx.kept = kept
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, weight, bias, targets, lse, ent = ctx.saved_tensors
        block_rows, block_vocab = ctx.blocks
        dtype = ctx.dtype
        n, v = h.shape[0], weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        use_ent = ctx.entropy_grad and g_ent is not None
        acc = accumulation_dtype(dtype)
        grad_h = torch.zeros(h.shape, dtype=acc, device=h.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(v, dtype=acc, device=weight.device) if need_b else None
        if need_h or need_w or need_b:
            g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(acc)
            g_ent = g_ent.to(acc) if use_ent else None
            hc_all, w_all = h.to(dtype), weight.to(dtype)
            b_all = bias.to(dtype) if bias is not None else None
            with torch.autocast(h.device.type, enabled=False):
                for i, r0 in enumerate(range(0, n, block_rows)):
                    rows = slice(r0, min(n, r0 + block_rows))
                    _backward_rows(hc_all[rows], w_all, b_all, targets[rows], lse[rows], g_lp[rows],
                                   ent[rows] if use_ent else None, g_ent[rows] if use_ent else None,
                                   grad_h[rows] if need_h else None, grad_w, grad_b, block_vocab, acc,
                                   ctx.kept[i] if ctx.kept is not None else None)
        return (
            grad_h.to(h.dtype) if grad_h is not None else None,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None, None, None, None, None, None, None,
        )


def _forward_rows(hc, w_all, b_all, tc, mc, sc, ac, picked, block_vocab: int, acc,
                  keep: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One block of rows over every vocabulary tile: updates the running max ``mc``, sum ``sc``, entropy term
    ``ac`` and the target's logit ``picked`` in place. Returns, with ``keep``, each tile's ``(z - m, m)``."""
    v = w_all.shape[0]
    tiles = []
    for v0 in range(0, v, block_vocab):
        v1 = min(v, v0 + block_vocab)
        z = _block_logits(hc, w_all[v0:v1], None if b_all is None else b_all[v0:v1], acc)
        local = tc - v0
        inside = (local >= 0) & (local < v1 - v0)
        at_target = z.gather(1, local.clamp(0, v1 - v0 - 1).unsqueeze(1)).squeeze(1)
        picked += torch.where(inside, at_target, 0.0)
        new_m = torch.maximum(mc, z.amax(1))
        scale = shift = None
        if v0 > 0:
            shift = mc - new_m  # ≤ 0
            scale = shift.exp()
        u = z.sub_(new_m.unsqueeze(1))  # z - m, in place (and left as it is below: kept for the backward)
        if keep:
            tiles.append((u, new_m))
        e = u.exp()
        s_blk = e.sum(1)
        if ac is not None:
            a_blk = e.mul_(u).sum(1)
            ac.copy_(a_blk if scale is None else scale * (ac + shift * sc) + a_blk)
        sc.copy_(s_blk if scale is None else sc * scale + s_blk)
        mc.copy_(new_m)
    return tiles


def _backward_rows(hc, w_all, b_all, tc, lse, g_lp, ent, g_ent, grad_h, grad_w, grad_b, block_vocab: int,
                   acc, kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
    """One block of rows: each tile's log-probs (from the forward's ``kept`` tiles, else recomputed), ``∂L/∂z`` in
    the accumulation dtype, and its products (matmuls in the compute dtype, sums in the accumulation dtype) added
    into the gradients in place."""
    v = w_all.shape[0]
    lse_c, neg_glp = lse.unsqueeze(1), -g_lp.unsqueeze(1)
    neg_gent = -g_ent.unsqueeze(1) if g_ent is not None else None
    for i, v0 in enumerate(range(0, v, block_vocab)):
        v1 = min(v, v0 + block_vocab)
        w_t = w_all[v0:v1]
        if kept is not None:  # log p = (z - m) - (lse - m), a new tensor: the kept tile stays for another backward
            u, m_t = kept[i]
            logp = u - (lse - m_t).unsqueeze(1)
        else:
            logp = _block_logits(hc, w_t, None if b_all is None else b_all[v0:v1], acc).sub_(lse_c)
        p = logp.exp()
        if neg_gent is not None:  # -(g_lp + g_H·(log p + H)) written into logp
            coef = logp.add_(ent.unsqueeze(1)).mul_(neg_gent)
            p.mul_(coef.add_(neg_glp))
        else:
            p.mul_(neg_glp)
        local = tc - v0
        inside = (local >= 0) & (local < v1 - v0)
        p.scatter_add_(1, local.clamp(0, v1 - v0 - 1).unsqueeze(1), torch.where(inside, g_lp, 0.0).unsqueeze(1))
        dz = p if p.dtype == hc.dtype else p.to(hc.dtype)
        if grad_h is not None:
            _add_product(grad_h, dz, w_t)
        if grad_w is not None:
            _add_product(grad_w[v0:v1], dz.t(), hc)
        if grad_b is not None:
            grad_b[v0:v1] += p.sum(0)


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with ``out`` in the accumulation dtype and ``a``, ``b`` in the compute dtype."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    else:
        out += (a @ b).to(out.dtype)


def linear_logps_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    entropy_grad: bool = False,
    block_rows: int | None = None,
    block_vocab: int | None = None,
    dtype: torch.dtype | None = None,
    keep_logits: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(z)[target]`` and ``H = -Σ p·log p`` for ``z = (hidden·Wᵀ + b)/τ``, never materialising
    ``z`` beyond one ``block_rows × block_vocab`` block (but with ``keep_logits``, for a small ``z``).

    ``hidden``: (N, D) or (..., D); ``weight``: (V, D); ``targets``: hidden's leading shape. The matmuls run in
    ``dtype`` (default :func:`compute_dtype`: the autocast dtype under autocast, else the weight's); the blocks
    default to :func:`choose_blocks` for the device. Returns float32 (float64 for float64 inputs) tensors of the
    leading shape. Gradients flow to ``hidden``, ``weight`` and ``bias`` where they require it; to the entropy
    only with ``entropy_grad`` (otherwise it is a detached metric). ``keep_logits`` (default: when they take at
    most :data:`KEEP_LOGITS_BYTES`) keeps the forward's blocks for the backward instead of recomputing them.
    """
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(torch.long)
    if dtype is None:
        dtype = compute_dtype(h.device.type, weight.dtype)
    if block_rows is None or block_vocab is None:
        rows, tile = choose_blocks(max(1, h.shape[0]), weight.shape[0], h.device.type)
        block_rows, block_vocab = block_rows or rows, block_vocab or tile
    if temperature != 1.0:
        h = h * (1.0 / temperature)
        bias = bias * (1.0 / temperature) if bias is not None else None
    grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad
                                         or (bias is not None and bias.requires_grad))
    if keep_logits is None:
        keep_logits = h.shape[0] * weight.shape[0] * accumulation_dtype(dtype).itemsize <= KEEP_LOGITS_BYTES
    logp, ent = _ChunkedLogSoftmax.apply(h, weight, bias, t, compute_entropy, entropy_grad, block_rows, block_vocab,
                                         dtype, bool(grads and keep_logits))
    return logp.reshape(lead), (ent.reshape(lead) if compute_entropy else None)
