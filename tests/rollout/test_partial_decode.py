"""The decode loop's pieces for partial rollouts (grpokit/rollout/decode.py, grpokit/rollout/partial_decode.py):
per-row budgets, states of any size, each token's log-prob as the loss computes it, interrupting between tokens, and
continuing a completion from its history."""

from __future__ import annotations

import torch
from tiny import tiny_model, tiny_tokenizer

from grpokit.forward.logprobs import completion_logps
from grpokit.rollout.base import SamplingParams, completion_mask_from_eos
from grpokit.rollout.decode import decode, token_chooser
from grpokit.rollout.partial_decode import continue_rows, why_not_continued
from grpokit.rollout.sampling import fast_sampler
from grpokit.rollout.transformers_backend import TransformersRollout


def setup(texts=("ab", "xyz"), g=2):
    tok = tiny_tokenizer()
    model = tiny_model(tok).eval()
    enc = tok([t for t in texts for _ in range(g)], return_tensors="pt", padding=True, add_special_tokens=False)
    return tok, model, enc["input_ids"], enc["attention_mask"]


def chooser(temperature=0.7):
    params = SamplingParams(max_new_tokens=12, temperature=temperature)
    return token_chooser(params, fast_sampler(params, torch.device("cpu")))


def test_logps_are_the_loss_log_probs_of_the_sampled_tokens():
    tok, model, ids, mask = setup()
    logps = torch.zeros(ids.shape[0], 12)
    torch.manual_seed(0)
    out = decode(model, ids, mask, max_new_tokens=12, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id,
                 choose=chooser(), group=2, logps=logps, temperature=0.7)
    cmask, _ = completion_mask_from_eos(out, [tok.eos_token_id])
    with torch.no_grad():
        want, _ = completion_logps(model, ids, mask, out, cmask, temperature=0.7, compute_entropy=False)
    m = cmask.bool()
    assert float((want - logps[:, :out.shape[1]]).abs()[m].max()) < 1e-4
    assert bool((logps[:, :out.shape[1]][~m] == 0).all())


def test_states_of_any_size_sample_as_groups_do():
    tok, model, ids, mask = setup(texts=("ab", "xyz"), g=3)
    runs = []
    for kw in ({"group": 3}, {"states": torch.tensor([0, 0, 0, 1, 1, 1])}):
        torch.manual_seed(1)
        runs.append(decode(model, ids, mask, max_new_tokens=8, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id,
                           choose=chooser(), **kw))
    assert torch.equal(runs[0], runs[1])
    # Uneven states: rows 0-1 one prompt, rows 2-5 another (each row's own draw either way)
    enc = tok(["ab"] * 2 + ["xyz"] * 4, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(2)
    shared = decode(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=8, eos_ids=[tok.eos_token_id],
                    pad_id=tok.pad_token_id, choose=chooser(), states=torch.tensor([0, 0, 1, 1, 1, 1]))
    torch.manual_seed(2)
    alone = decode(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=8, eos_ids=[tok.eos_token_id],
                   pad_id=tok.pad_token_id, choose=chooser(), share_prompt=False)
    assert torch.equal(shared, alone)


def test_budgets_and_interrupt():
    tok, model, ids, mask = setup()
    steps = []

    def interrupt(rows):
        steps.append(rows.tolist())
        return len(steps) == 5

    out = decode(model, ids, mask, max_new_tokens=12, eos_ids=[-1], pad_id=tok.pad_token_id, choose=chooser(),
                 budget=torch.tensor([2, 12, 12, 3]), interrupt=interrupt)
    assert out.shape[1] == 5  # stopped after the fifth step
    assert steps[1] == [1, 2, 3] and steps[2] == [1, 2]  # rows leave at their budgets
    assert bool((out[0, 2:] == tok.pad_token_id).all()) and bool((out[3, 3:] == tok.pad_token_id).all())


def test_continuing_from_a_history_samples_from_the_whole_history():
    """A completion cut after 4 tokens and continued with other weights: the continued tokens' log-probs are the
    new weights' own given the whole history (nothing of the old weights' cache is reused)."""
    tok, model, ids, mask = setup()
    backend = TransformersRollout(tok)
    params = SamplingParams(max_new_tokens=10, temperature=0.9)
    assert why_not_continued(backend, model, params) is None
    histories = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    steps = []
    first = continue_rows(backend, model, histories, [10] * 4, params, 0.9, torch.device("cpu"),
                          interrupt=lambda rows: steps.append(1) or len(steps) == 4)  # cut after 4 tokens
    assert all(len(t) <= 4 for t in first.tokens)
    other = tiny_model(tok, seed=3).eval()
    live = [i for i in range(4) if not first.ended[i]]
    assert live, "every row ended within 4 tokens"
    histories2 = [histories[i] + first.tokens[i] for i in live]
    second = continue_rows(backend, other, histories2, [10 - len(first.tokens[i]) for i in live], params, 0.9,
                           torch.device("cpu"))
    for n, i in enumerate(live):
        prompt = torch.tensor([histories[i]])
        done = torch.tensor([first.tokens[i] + second.tokens[n]])
        cmask = torch.ones_like(done)
        with torch.no_grad():
            old, _ = completion_logps(model, prompt, torch.ones_like(prompt), done, cmask, temperature=0.9,
                                      compute_entropy=False)
            new, _ = completion_logps(other, prompt, torch.ones_like(prompt), done, cmask, temperature=0.9,
                                      compute_entropy=False)
        k = len(first.tokens[i])
        assert torch.allclose(old[0, :k], torch.tensor(first.logps[i]), atol=1e-4)
        assert torch.allclose(new[0, k:], torch.tensor(second.logps[n]), atol=1e-4)
        assert not torch.allclose(old[0, k:], new[0, k:], atol=1e-3)  # the two versions differ there
