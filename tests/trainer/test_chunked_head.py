"""The chunked LM head's dtype path and block choice: under autocast its matmuls run in the autocast dtype (forward
and the recomputed backward) while sums stay float32, matching the plain path within bf16 tolerance, values and
gradients; the block shape is a pure function of the sizes and the device."""

from __future__ import annotations

import pytest
import torch

from grpokit.forward import chunked_head
from grpokit.forward.chunked_head import (
    BYTES_PER_BLOCK_ELEMENT,
    CPU_BLOCKS,
    MIN_CUDA_ROWS,
    choose_blocks,
    compute_dtype,
    linear_logps_and_entropy,
)


def _plain(h, w, t, temperature=1.0):
    """The reference: full logits through F.linear (autocast applies as in a model), log-softmax in float32."""
    z = torch.nn.functional.linear(h, w).float() / temperature
    logp = torch.log_softmax(z, -1)
    return logp.gather(1, t.unsqueeze(1)).squeeze(1), -(logp.exp() * logp).sum(-1)


def _inputs(n=37, d=24, v=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) * 0.5
    t = torch.randint(0, v, (n,), generator=g)
    return h, w, t


def test_matmuls_run_in_the_autocast_dtype(monkeypatch):
    seen = []
    block_logits, add_product = chunked_head._block_logits, chunked_head._add_product
    monkeypatch.setattr(chunked_head, "_block_logits", lambda h, w, b, acc: (seen.append(("fwd", h.dtype, w.dtype)),
                                                                              block_logits(h, w, b, acc))[1])
    monkeypatch.setattr(chunked_head, "_add_product", lambda out, a, b: (seen.append(("bwd", a.dtype, b.dtype,
                                                                                     out.dtype)),
                                                                          add_product(out, a, b))[1])
    h, w, t = _inputs()
    h.requires_grad_(True)
    w.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = linear_logps_and_entropy(h, w, t, block_rows=16, block_vocab=128)
    assert lp.dtype == ent.dtype == torch.float32
    lp.sum().backward()  # backward runs outside autocast, as in training: it keeps the forward's compute dtype
    fwd = [s for s in seen if s[0] == "fwd"]
    bwd = [s for s in seen if s[0] == "bwd"]
    assert fwd and all(s[1:] == (torch.bfloat16, torch.bfloat16) for s in fwd)
    assert bwd and all(s[1:] == (torch.bfloat16, torch.bfloat16, torch.float32) for s in bwd)
    assert h.grad.dtype == w.grad.dtype == torch.float32


def test_without_autocast_the_head_keeps_its_dtype():
    assert compute_dtype("cpu", torch.float32) == torch.float32
    assert compute_dtype("cpu", torch.bfloat16) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype("cpu", torch.float32) == torch.bfloat16


@pytest.mark.parametrize("blocks", [(16, 128), (64, 300), (5, 77)])
def test_autocast_values_and_gradients_match_the_plain_path(blocks):
    h, w, t = _inputs()
    results = []
    for fn in (lambda h, w: linear_logps_and_entropy(h, w, t, temperature=0.7, entropy_grad=True,
                                                     block_rows=blocks[0], block_vocab=blocks[1]),
               lambda h, w: _plain(h, w, t, temperature=0.7)):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, ent = fn(hh, ww)
        (lp.sum() + 0.3 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), hh.grad, ww.grad))
    (lp, ent, gh, gw), (lp0, ent0, gh0, gw0) = results
    # both round inputs and logits to bf16 (8 bits of mantissa: ~0.4% of a logit), in places that differ by the
    # temperature's scaling; the log-sum-exp and the sums are float32 in both
    torch.testing.assert_close(lp, lp0, rtol=1e-2, atol=0.1)
    torch.testing.assert_close(ent, ent0, rtol=1e-2, atol=0.1)
    torch.testing.assert_close(gh, gh0, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(gw, gw0, rtol=5e-2, atol=5e-2)
    # and bf16 is really used: the float32 result differs by more than float32 rounding
    lp32, _ = linear_logps_and_entropy(h, w, t, temperature=0.7)
    assert (lp32 - lp).abs().max() > 1e-4


def test_choose_blocks_on_cpu_keeps_the_measured_blocks():
    assert choose_blocks(10_000, 49_152, "cpu") == CPU_BLOCKS
    assert choose_blocks(100, 49_152, "cpu") == (100, CPU_BLOCKS[1])
    assert choose_blocks(100, 1000, "cpu") == (100, 1000)


def test_choose_blocks_on_cuda_takes_the_whole_vocabulary_when_it_fits():
    budget = 1 << 30
    rows, tile = choose_blocks(32_768, 49_152, "cuda", budget)
    assert tile == 49_152 and rows == budget // (49_152 * BYTES_PER_BLOCK_ELEMENT)
    assert rows * tile * BYTES_PER_BLOCK_ELEMENT <= budget
    assert choose_blocks(100, 151_936, "cuda", budget) == (100, 151_936)  # fewer rows than would fit


def test_choose_blocks_on_cuda_tiles_the_vocabulary_under_a_small_budget():
    budget = 64 << 20
    rows, tile = choose_blocks(32_768, 151_936, "cuda", budget)
    assert rows == MIN_CUDA_ROWS and tile % 128 == 0 and tile < 151_936
    assert rows * tile * BYTES_PER_BLOCK_ELEMENT <= budget
    assert choose_blocks(32_768, 151_936, "cuda", 1) == (MIN_CUDA_ROWS, 128)  # never below one 128-wide tile
    with pytest.raises(ValueError, match="n_rows=0"):
        choose_blocks(0, 10, "cuda")
