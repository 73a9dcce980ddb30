"""The chunked log-prob / entropy path against the plain full-softmax computation: values and gradients."""

import math

import pytest
import torch
from conftest import FixedRollout
from runs import chat_dataset, make_args, params_of, varied_reward
from tiny import tiny_model, tiny_tokenizer

import grpokit.forward.logprobs as logprobs
from grpokit.forward.logprobs import completion_logps, lean_head, linear_logps_and_entropy
from grpokit.trainer import GRPOTrainer


def _plain(h, w, t, b=None, tau=1.0):
    z = h @ w.t()
    if b is not None:
        z = z + b
    logp_all = (z / tau).log_softmax(-1)
    lp = logp_all.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return lp, ent


@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("keep_logits", [False, True])
def test_chunked_matches_full_softmax_values_and_gradients(tau, entropy_grad, bias, keep_logits):
    g = torch.Generator().manual_seed(0)
    n, d, v = 37, 16, 1000
    h = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, d, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[0], t[1] = 0, v - 1  # the first and the last vocabulary entry
    # blocks that do not divide the sizes: ragged last row block and vocabulary tile
    lp, ent = linear_logps_and_entropy(h, w, t, b, temperature=tau, entropy_grad=entropy_grad,
                                       block_rows=8, block_vocab=300, keep_logits=keep_logits)
    lp_ref, ent_ref = _plain(h, w, t, b, tau)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-12)
    assert ent.requires_grad == entropy_grad

    g_lp = torch.randn(n, generator=g, dtype=torch.float64)
    g_ent = torch.randn(n, generator=g, dtype=torch.float64)
    inputs = [h, w] + ([b] if bias else [])
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if entropy_grad else 0.0)
    loss_ref = (lp_ref * g_lp).sum() + ((ent_ref * g_ent).sum() if entropy_grad else 0.0)
    for got, want in zip(torch.autograd.grad(loss, inputs), torch.autograd.grad(loss_ref, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_kept_logits_skip_the_recomputation_only_under_the_budget(monkeypatch):
    """The forward's blocks are kept for the backward (no head matmul recomputed there) when they fit
    KEEP_LOGITS_BYTES, recomputed when they do not; both give the same gradients, and a second backward through a
    retained graph the same as the first (the kept blocks are read, not overwritten)."""
    import grpokit.forward.chunked_head as chunked_head

    calls = []
    block_logits = chunked_head._block_logits
    monkeypatch.setattr(chunked_head, "_block_logits", lambda *a: (calls.append(1), block_logits(*a))[1])
    g = torch.Generator().manual_seed(3)
    n, d, v = 20, 8, 500  # 20 × 500 float32 logits: 40,000 bytes
    h0, w0 = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g)
    t = torch.randint(0, v, (n,), generator=g)
    grads = {}
    for budget in (40_000, 39_999):
        monkeypatch.setattr(chunked_head, "KEEP_LOGITS_BYTES", budget)
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        lp, ent = linear_logps_and_entropy(h, w, t, block_rows=8, block_vocab=128, entropy_grad=True)
        forward_calls = len(calls)
        assert forward_calls == 3 * 4  # 3 row blocks × 4 vocabulary tiles
        loss = (lp * torch.linspace(-1, 1, n)).sum() + 0.5 * ent.sum()
        first = torch.autograd.grad(loss, [h, w], retain_graph=True)
        assert len(calls) == forward_calls * (1 if budget == 40_000 else 2)
        second = torch.autograd.grad(loss, [h, w])
        for a, b in zip(first, second):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        grads[budget] = first
        calls.clear()
    for a, b in zip(grads[40_000], grads[39_999]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # without a gradient to compute nothing is kept
    monkeypatch.setattr(chunked_head, "KEEP_LOGITS_BYTES", 1 << 30)
    with torch.no_grad():
        linear_logps_and_entropy(h0.requires_grad_(True), w0, t)
    kept = []
    apply = chunked_head._ChunkedLogSoftmax.apply
    monkeypatch.setattr(chunked_head._ChunkedLogSoftmax, "apply", lambda *a: (kept.append(a[-1]), apply(*a))[1])
    with torch.no_grad():
        linear_logps_and_entropy(h0, w0, t)
    linear_logps_and_entropy(h0.detach(), w0, t)
    linear_logps_and_entropy(h0.detach().requires_grad_(True), w0, t)
    assert kept == [False, False, True]


def test_chunked_float32_large_logits_and_frozen_weight():
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(50, 32, generator=g) * 4).requires_grad_(True)  # logits of size ~100: online max matters
    w = torch.randn(3000, 32, generator=g)  # frozen: no grad_W computed
    t = torch.randint(0, 3000, (50,), generator=g)
    lp, ent = linear_logps_and_entropy(h, w, t, block_rows=16, block_vocab=512)
    lp_ref, ent_ref = _plain(h, w, t)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-4)
    (gh,) = torch.autograd.grad(lp.sum(), [h])
    (gh_ref,) = torch.autograd.grad(lp_ref.sum(), [h])
    torch.testing.assert_close(gh, gh_ref, rtol=1e-4, atol=1e-5)
    assert w.grad is None


def test_chunked_no_rows_and_bf16():
    w = torch.randn(100, 8, requires_grad=True)
    lp, ent = linear_logps_and_entropy(torch.zeros(0, 8, requires_grad=True), w, torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and ent.shape == (0,)
    lp.sum().backward()
    assert torch.count_nonzero(w.grad) == 0
    h = torch.randn(10, 8)
    t = torch.randint(0, 100, (10,))
    lp16, _ = linear_logps_and_entropy(h.bfloat16(), w.detach().bfloat16(), t)
    assert lp16.dtype == torch.float32
    torch.testing.assert_close(lp16, _plain(h, w.detach(), t)[0], rtol=0.05, atol=0.1)


def _batch(tok, seed=0, b=4, p=6, c=7):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(10, len(tok), (b, p), generator=g)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    prompt_ids[0, :2] = tok.pad_token_id
    completion_ids = torch.randint(10, len(tok), (b, c), generator=g)
    completion_mask = torch.ones(b, c, dtype=torch.long)
    completion_mask[1, 4:] = 0  # right padding after an EOS
    completion_mask[2, :] = 0  # a fully masked row
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _both_paths(model, batch, tau, entropy_grad=False):
    out = {}
    for lean in (True, False):
        model.zero_grad(set_to_none=True)
        lp, ent = completion_logps(model, *batch, temperature=tau, entropy_grad=entropy_grad, lean=lean)
        w = torch.linspace(-1, 1, lp.numel()).reshape(lp.shape)
        loss = (lp * w).sum() + ((ent * w.flip(-1)).sum() if entropy_grad else 0.0)
        loss.backward()
        out[lean] = (lp.detach(), ent.detach(), _grads(model))
    return out


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("tau", [1.0, 0.6])
def test_completion_logps_lean_equals_plain_through_a_model(tie, tau):
    tok = tiny_tokenizer()
    model = tiny_model(tok, tie=tie).double()
    assert lean_head(model) is model.lm_head
    batch = _batch(tok)
    out = _both_paths(model, batch, tau, entropy_grad=not tie)
    (lp, ent, grads), (lp_ref, ent_ref, grads_ref) = out[True], out[False]
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-10)
    mask = batch[3].bool()
    assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all() and (lp[mask] < 0).all()
    assert grads.keys() == grads_ref.keys()
    assert ("lm_head.weight" in grads) != tie  # tied: the head's gradient lands on the embedding
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-8, atol=1e-10, msg=name)


@pytest.mark.parametrize("tie", [True, False])
def test_held_stop_tokens_on_the_lean_path_equal_the_whole_rows(tie, monkeypatch):
    """``min_tokens`` alone: the lean path corrects the full-vocabulary log-probs from the stop tokens' logits
    (held_stop_logps) instead of a second pass over the vocabulary; the plain path replays it on whole rows. They
    agree at every position: before ``min_tokens`` (a drawn stop token kept in the set), after it, and where the
    stops hold most of the mass (that position takes the whole row)."""
    from grpokit.algorithms.sampling_support import SamplingSupport

    tok = tiny_tokenizer()
    model = tiny_model(tok, tie=tie)
    with torch.no_grad():
        model.model.norm.weight.mul_(20)  # logits with a spread of ~2 (0.1 as built): peaked distributions
    batch = _batch(tok, seed=5)
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt_ids, completion_ids], 1),
                       attention_mask=torch.cat([prompt_mask, completion_mask], 1)).logits
    at = logits[3, prompt_ids.shape[1] - 1] / 0.7  # what predicts row 3's first completion token
    likely = torch.topk(at, 12).indices.tolist()
    drawn_stop = int(completion_ids[0, 1])
    stops = tuple(sorted({*likely, drawn_stop} - {int(completion_ids[3, 0])}))
    support = SamplingSupport(min_tokens=4, stop_ids=stops)
    assert support.only_holds_stops
    blocked = []  # rows the lean path sent through the whole-row pass
    real = logprobs._blocked_support_logps
    monkeypatch.setattr(logprobs, "_blocked_support_logps", lambda *a, **k: blocked.append(a[1]) or real(*a, **k))
    got = []
    lp, _ = completion_logps(model, *batch, temperature=0.7, support=support, on_support=got)
    assert blocked and sum(blocked) < int((completion_mask[:, :4] == 1).sum())  # only the mass-held positions
    lean_calls = len(blocked)
    ref = []
    lp_ref, _ = completion_logps(model, *batch, temperature=0.7, support=support, on_support=ref, lean=False)
    assert len(blocked) > lean_calls
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=2e-5)
    valid = completion_mask.bool()
    early = valid & (torch.arange(completion_ids.shape[1]) < 4)
    assert (got[0][valid & ~early] == lp[valid & ~early]).all()  # past min_tokens: the full softmax's
    lifted = got[0][early] - lp.detach()[early]  # before it: the held-back mass renormalised away
    assert (lifted >= 0).all() and (lifted > 1e-3).sum() >= 3
    assert got[0][3, 0] - lp[3, 0] > math.log(2)  # the stops held more than half there


def test_completion_logps_lean_with_lora_and_batches():
    peft = pytest.importorskip("peft")
    tok = tiny_tokenizer()
    model = peft.get_peft_model(
        tiny_model(tok).double(),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                        init_lora_weights=False),
    )
    assert lean_head(model) is not None
    batch = _batch(tok, seed=3)
    out = _both_paths(model, batch, 0.9)
    (lp, _, grads), (lp_ref, _, grads_ref) = out[True], out[False]
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-10)
    assert grads.keys() == grads_ref.keys() and all("lora_" in n for n in grads)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-8, atol=1e-10, msg=name)
    with model.disable_adapter():  # the reference policy
        ref = completion_logps(model, *batch, compute_entropy=False, batch_size=3)[0]
        ref_plain = completion_logps(model, *batch, compute_entropy=False, lean=False)[0]
    torch.testing.assert_close(ref, ref_plain, rtol=0, atol=1e-10)
    assert not torch.allclose(ref, lp)


def test_lean_head_falls_back_for_unknown_heads():
    tok = tiny_tokenizer()
    model = tiny_model(tok)
    model.config.final_logit_softcapping = 30.0
    assert lean_head(model) is None
    model.config.final_logit_softcapping = None
    assert lean_head(model) is model.lm_head
    assert lean_head(torch.nn.Linear(2, 2)) is None
    batch = _batch(tok)
    model.lm_head = torch.nn.Sequential(torch.nn.Linear(32, len(tok)))
    assert lean_head(model) is None
    lp, ent = completion_logps(model, *batch)  # the plain path still works
    assert lp.shape == batch[2].shape and (lp[batch[3].bool()] < 0).all()


def test_lean_path_takes_what_the_model_hands_its_head():
    # a model that transforms the hidden states between its decoder and its head (here: scales them) is still
    # exact, because the head's own input is used; and the head projects nothing during that forward
    tok = tiny_tokenizer()
    model = tiny_model(tok, tie=False).double()
    batch = _batch(tok)
    ref = completion_logps(model, *batch, lean=False)[0]
    forward = type(model.model).forward

    def scaled(self, *a, **k):
        out = forward(self, *a, **k)
        out.last_hidden_state = out.last_hidden_state * 0.5
        return out

    model.model.forward = scaled.__get__(model.model)
    shapes = []
    model.lm_head.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    lp = completion_logps(model, *batch)[0]
    assert shapes == [(batch[0].shape[0], 0, len(tok))]  # no logits were computed
    plain = completion_logps(model, *batch, lean=False)[0]
    torch.testing.assert_close(lp, plain, rtol=0, atol=1e-10)
    assert not torch.allclose(lp, ref)


def test_lean_path_under_autocast():
    # accelerate's mixed precision patches the model's forward with autocast: the lean path runs that forward, so the
    # decoder runs in bf16 like the plain path's, and the head projects in its own float32
    tok = tiny_tokenizer()
    model = tiny_model(tok)
    batch = _batch(tok)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = completion_logps(model, *batch)[0]
        plain = completion_logps(model, *batch, lean=False)[0]
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, plain, rtol=0.02, atol=0.05)


def _grouped_batch(tok, g=3, seed=0):
    prompt_ids, prompt_mask, completion_ids, _ = _batch(tok, seed=seed, b=3)
    prompt_ids, prompt_mask = prompt_ids[:2], prompt_mask[:2]  # row 0 is left-padded
    gen = torch.Generator().manual_seed(seed + 1)
    completion_ids = torch.randint(10, len(tok), (2 * g, completion_ids.shape[1]), generator=gen)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 3:] = 0
    completion_mask[4, :] = 0
    # the G completions of each prompt come consecutively
    return prompt_ids.repeat_interleave(g, 0), prompt_mask.repeat_interleave(g, 0), completion_ids, completion_mask


def _prefixed_grouped_batch(tok, g=3, prefix=5, own=(2, 4, 3), c=6, seed=0):
    """Three prompts that begin with the same ``prefix`` tokens (a system turn), then ``own`` tokens each,
    left-padded; ``g`` completions each, consecutive."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(10, len(tok), (prefix,), generator=gen)
    p = prefix + max(own)
    prompt_ids = torch.full((len(own), p), tok.pad_token_id)
    prompt_mask = torch.zeros(len(own), p, dtype=torch.long)
    for i, n in enumerate(own):
        row = torch.cat([start, torch.randint(10, len(tok), (n,), generator=gen)])
        prompt_ids[i, p - len(row):], prompt_mask[i, p - len(row):] = row, 1
    completion_ids = torch.randint(10, len(tok), (len(own) * g, c), generator=gen)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 2:] = 0
    completion_mask[5, :] = 0
    return prompt_ids.repeat_interleave(g, 0), prompt_mask.repeat_interleave(g, 0), completion_ids, completion_mask


def _shared_and_unshared(model, batch, hooked):
    """``{share: (log-probs, entropies, gradients, forward shapes)}`` for ``share_prompts`` on and off: a loss of
    both outputs, weighted unevenly, backpropagated; ``hooked``: the module whose forward inputs are recorded."""
    forwards, out = [], {}
    handle = hooked.register_forward_pre_hook(lambda m, a, k: forwards.append(tuple(k["input_ids"].shape)),
                                              with_kwargs=True)
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        forwards.clear()
        lp, ent = completion_logps(model, *batch, temperature=0.8, entropy_grad=True, share_prompts=share)
        w = torch.linspace(-1, 1, lp.numel()).reshape(lp.shape).double()
        ((lp * w).sum() + (ent * w.flip(-1)).sum()).backward()
        out[share] = (lp.detach(), ent.detach(), _grads(model), list(forwards))
    handle.remove()
    return out


def _repeat_completions(batch, groups):
    """Completions repeated inside groups (a confident policy's replies): in each of ``groups`` groups of three rows
    the third row takes the first's completion; row 1 takes row 0's tokens under its own shorter mask (another
    completion); rows 3 and 5 take row 0's (row 3 has another prompt: not the same row, but row 5 repeats it). Returns
    the batch and how many rows are distinct: two a group."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = (t.clone() for t in batch)
    completion_ids[0, 3:] = 0  # token id 0, valid in row 0 and hidden by row 1's mask: the masks tell them apart
    for start in range(0, 3 * groups, 3):
        completion_ids[start + 2], completion_mask[start + 2] = completion_ids[start], completion_mask[start]
    completion_ids[1] = completion_ids[0]
    completion_ids[3], completion_mask[3] = completion_ids[0], completion_mask[0]
    completion_ids[5], completion_mask[5] = completion_ids[3], completion_mask[3]
    return (prompt_ids, prompt_mask, completion_ids, completion_mask), 2 * groups


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("prefixed,repeated", [(False, False), (True, False), (False, True), (True, True)])
def test_shared_prompts_equal_encoding_every_row(lora, prefixed, repeated):
    """Each prompt once for its group; with ``prefixed`` prompts (a system turn all begin with) that prefix once for
    the batch, its gradient summed by autograd; with ``repeated`` completions (the same reply twice in a group) each
    distinct (prompt, completion) once: log-probs, entropies and every gradient equal the unshared forward."""
    tok = tiny_tokenizer()
    model = tiny_model(tok, tie=False).double()
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.0, init_lora_weights=False))
    batch = _prefixed_grouped_batch(tok) if prefixed else _grouped_batch(tok)
    rows = batch[0].shape[0]
    if repeated:
        batch, rows = _repeat_completions(batch, groups=3 if prefixed else 2)
    inner = model.get_base_model() if lora else model
    out = _shared_and_unshared(model, batch, inner.model)
    (lp, ent, grads, fw), (lp_ref, ent_ref, grads_ref, fw_ref) = out[True], out[False]
    (n, p), c = batch[0].shape, batch[2].shape[1]
    if prefixed:  # the prefix once, each prompt's rest once, then only the distinct completions
        assert fw == [(1, 5), (3, p - 5), (rows, c)] and fw_ref == [(n, p + c)]
    else:  # each prompt once, then only the distinct completions
        assert fw == [(2, p), (rows, c)] and fw_ref == [(n, p + c)]
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-10)
    assert grads.keys() == grads_ref.keys() and grads
    # Llama's RMSNorm computes in float32 even in a float64 model, and the shared prompt sums its rows' gradients
    # before that norm's backward rather than after: equal up to float32 rounding
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-6, atol=1e-6, msg=name)
    # no-grad passes (old and reference policy), in micro-batches that cut a group in two
    with torch.no_grad():
        lp_nb = completion_logps(model, *batch, temperature=0.8, compute_entropy=False, batch_size=4)[0]
    torch.testing.assert_close(lp_nb, lp_ref, rtol=0, atol=1e-10)


def test_a_prefix_too_small_a_share_of_the_positions_is_not_encoded_apart():
    """Long completions: the prefix saves under PREFIX_MIN_SAVED of the positions, each prompt is encoded whole."""
    tok = tiny_tokenizer()
    model = tiny_model(tok).eval()
    forwards = []
    model.model.register_forward_pre_hook(lambda m, a, k: forwards.append(k["input_ids"].shape), with_kwargs=True)
    long = _prefixed_grouped_batch(tok, c=40)
    with torch.no_grad():
        completion_logps(model, *long)
    # each prompt whole, then the completions in two buckets: the rows of 2 and 0 tokens, the seven of 40
    assert forwards == [(3, long[0].shape[1]), (2, 2), (7, 40)]


def test_prompts_are_not_shared_with_dropout_or_checkpointing():
    tok = tiny_tokenizer()
    model = tiny_model(tok)
    batch = _grouped_batch(tok)
    forwards = []
    model.model.register_forward_pre_hook(lambda m, a, k: forwards.append(k["input_ids"].shape), with_kwargs=True)
    model.config.attention_dropout = 0.1
    model.train()
    completion_logps(model, *batch)
    assert len(forwards) == 1
    with torch.no_grad():
        forwards.clear()
        completion_logps(model, *batch)  # train mode: dropout is drawn without gradient too
        assert len(forwards) == 1
        model.eval()
        completion_logps(model, *batch)
        assert len(forwards) == 3  # eval mode: shared
    model.train()
    model.config.attention_dropout = 0.0
    model.gradient_checkpointing_enable()
    forwards.clear()
    completion_logps(model, *batch)
    assert len(forwards) == 1


@pytest.mark.parametrize("overhead", [0, 10_000])
def test_completions_run_in_buckets_of_similar_length(monkeypatch, overhead):
    """Replies of 1 to 12 tokens in groups of three: with no cost for another forward every distinct length is a
    bucket of its own, each run only as long as its longest row; with a prohibitive one, one bucket as long as the
    longest reply. Log-probs, entropies and every gradient equal the unshared forward either way."""
    monkeypatch.setattr(logprobs, "BUCKET_OVERHEAD", overhead)
    tok = tiny_tokenizer()
    model = tiny_model(tok, tie=False).double()
    prompt_ids, prompt_mask, _, _ = _prefixed_grouped_batch(tok)
    gen = torch.Generator().manual_seed(3)
    completion_ids = torch.randint(10, len(tok), (9, 14), generator=gen)
    lengths = torch.tensor([12, 2, 2, 5, 12, 1, 5, 2, 0])  # the padded width (14) is longer than any reply
    completion_mask = (torch.arange(14) < lengths.unsqueeze(1)).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, tok.pad_token_id)
    batch = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    out = _shared_and_unshared(model, batch, model.model)
    (lp, ent, grads, fw), (lp_ref, ent_ref, grads_ref, _) = out[True], out[False]
    assert fw[0] == (3, prompt_ids.shape[1])  # each prompt once (the system turn saves too little here)
    completion_forwards = sorted(fw[1:], key=lambda shape: shape[1])
    if overhead == 0:  # lengths 1 (rows 5 and 8: an empty reply runs one position), 2, 5, 12
        assert completion_forwards == [(2, 1), (3, 2), (2, 5), (2, 12)]
    else:
        assert completion_forwards == [(9, 12)]
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-10)
    assert grads.keys() == grads_ref.keys() and grads
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-6, atol=1e-6, msg=name)


class _RepeatingRollout:
    """:class:`FixedRollout`'s completions with rows 1 and 2 of every group of four repeating row 0 (a confident
    policy's group), of several lengths (EOS at random places)."""

    def __init__(self, tokenizer):
        self.inner = FixedRollout(tokenizer, seed=3)

    def generate(self, model, prompt_ids, prompt_mask, params):
        out = self.inner.generate(model, prompt_ids, prompt_mask, params)
        for t in (out.completion_ids, out.completion_mask, out.is_truncated):
            for copy in (1, 2):
                t[copy::4] = t[0::4]
        return out

    def sync_weights(self, model, step=None):
        return None


def test_repeated_completions_train_as_every_row_through_the_trainer(tmp_path, monkeypatch):
    """GRPOTrainer, two SGD steps on groups holding the same reply three times: with the CPU's sharing (each prompt
    once, each distinct reply once, replies in buckets by length: no cost counted for another forward, so every
    length is a bucket) every parameter moves as with one forward per row."""
    monkeypatch.setattr(logprobs, "BUCKET_OVERHEAD", 0)
    buckets = []
    real_buckets = logprobs.length_buckets
    monkeypatch.setattr(logprobs, "length_buckets", lambda *a: buckets.append(b := real_buckets(*a)) or b)
    kept = []
    real = logprobs.distinct_rows
    monkeypatch.setattr(logprobs, "distinct_rows", lambda *a: kept.append(r := real(*a)) or r)
    updates, losses = {}, {}
    for share in (True, False):
        monkeypatch.setattr(logprobs, "SHARE_PROMPTS_ON", ("cpu",) if share else ())
        tok = tiny_tokenizer()
        model = tiny_model(tok, seed=1)
        before = params_of(model)
        args = make_args(tmp_path / str(share), per_device_train_batch_size=8, optim="sgd", learning_rate=0.5,
                         max_grad_norm=0.0, shuffle_dataset=False)
        trainer = GRPOTrainer(model, varied_reward, args=args, train_dataset=chat_dataset(), processing_class=tok,
                              rollout_backend=_RepeatingRollout(tok))
        trainer.train()
        updates[share] = {n: p - before[n] for n, p in params_of(model).items()}
        losses[share] = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    assert kept and all(k is not None and len(k[0]) <= 4 for k in kept)  # 8 rows, at most 2 distinct a group
    assert any(len(b) > 1 for b in buckets)
    scale = max(u.abs().max().item() for u in updates[False].values())
    assert scale > 1e-3
    for n, u in updates[False].items():
        assert (updates[True][n] - u).abs().max().item() <= 1e-5 * scale, n
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-4, atol=1e-7)


def test_shared_prompt_backward_sums_in_a_fixed_order():
    """Rows that share a prompt send their gradients back to its one encoding (the KV cache's rows selected per row,
    the prompt's last hidden state per row; the head inputs picked by the mask take the same selection). Indexing's
    own backward sums them
    with an accumulating ``index_put_``, whose CPU kernel adds with atomics from several threads above 32k values, in
    an order that varies: on a 2-core Xeon the gradients of one batch changed in their last bits from call to call,
    and two demo runs of one seed parted at step 18. The backward now runs no accumulating ``index_put_``, and the
    gradients repeat to the bit."""
    import torch
    from peft import LoraConfig, get_peft_model
    from tiny import tiny_model, tiny_tokenizer
    from torch.utils._python_dispatch import TorchDispatchMode

    from grpokit.forward.logprobs import completion_logps

    class Accumulating(TorchDispatchMode):
        seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.__name__.startswith("index_put") and (kwargs.get("accumulate") or (len(args) > 3 and args[3])):
                self.seen += 1
            return func(*args, **kwargs)

    tok = tiny_tokenizer()
    model = get_peft_model(tiny_model(tok), LoraConfig(r=4, target_modules="all-linear"))
    torch.manual_seed(0)
    system = torch.randint(4, len(tok), (1, 10)).expand(6, 10)  # a turn every prompt begins with, then its own
    prompts = torch.cat([system, torch.randint(4, len(tok), (6, 8))], 1).repeat_interleave(3, 0)  # 6 prompts × 3
    completions = torch.randint(4, len(tok), (18, 7))
    completion_mask = torch.ones_like(completions)
    completion_mask[::4, 5:] = 0
    grads = set()
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        logps, _ = completion_logps(model, prompts, torch.ones_like(prompts), completions, completion_mask)
        with Accumulating() as mode:
            logps.sum().backward()
        assert mode.seen == 0
        grads.add(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).numpy().tobytes())
    assert len(grads) == 1
