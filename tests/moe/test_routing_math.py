"""The routing formulas (grpokit/algorithms/routing.py) against hand-computed values, and the routers of every family
transformers ships that routing replay covers, recognised with their gate rule."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_moe import FAMILIES, tiny_moe_model

from grpokit.algorithms.routing import expert_load, load_imbalance, ratio_std, replayed_gate_weights, rerouted
from grpokit.moe import find_routers

LOGITS = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))  # softmax = the probabilities themselves


def test_gate_weights_of_forced_experts_by_hand():
    experts = torch.tensor([[3, 1]])
    plain = replayed_gate_weights(LOGITS, experts, "softmax")
    torch.testing.assert_close(plain, torch.tensor([[0.4, 0.2]]))
    renormalised = replayed_gate_weights(LOGITS, experts, "softmax_renormalised")
    torch.testing.assert_close(renormalised, torch.tensor([[2 / 3, 1 / 3]]))
    # GPT-OSS's softmax over the top-k logits gives the same numbers
    torch.testing.assert_close(renormalised, torch.softmax(LOGITS[:, [3, 1]], -1))
    with pytest.raises(ValueError, match="rule='topk' is not allowed"):
        replayed_gate_weights(LOGITS, experts, "topk")


def test_gate_weights_carry_the_router_gradient():
    """Forced experts still train the router: d w_3 / d z = w_3 (onehot_3 - p) for the plain softmax rule."""
    z = LOGITS.clone().requires_grad_(True)
    replayed_gate_weights(z, torch.tensor([[3, 1]]), "softmax")[0, 0].backward()
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    torch.testing.assert_close(z.grad[0], 0.4 * (torch.nn.functional.one_hot(torch.tensor(3), 4) - p))


def test_rerouted_compares_sets_not_orders():
    chosen = torch.tensor([[0, 1], [2, 3], [0, 2]])
    recorded = torch.tensor([[1, 0], [2, 3], [0, 3]])
    assert rerouted(chosen, recorded).tolist() == [False, False, True]


def test_expert_load_and_imbalance_by_hand():
    skewed = torch.tensor([[0, 1], [0, 1]])
    torch.testing.assert_close(expert_load(skewed, 4), torch.tensor([0.5, 0.5, 0.0, 0.0]))
    assert load_imbalance(skewed, 4).item() == pytest.approx(2.0)
    assert load_imbalance(torch.tensor([[0, 1], [2, 3]]), 4).item() == pytest.approx(1.0)
    assert load_imbalance(torch.tensor([[2, 2]]), 4).item() == pytest.approx(4.0)


def test_ratio_std_by_hand():
    log_ratio = torch.log(torch.tensor([1.0, 3.0, 2.0, 9.0]))
    mask = torch.tensor([True, True, False, False])
    assert ratio_std(log_ratio, mask).item() == pytest.approx(1.0)  # ratios 1 and 3: mean 2, std 1
    assert math.isnan(ratio_std(log_ratio, torch.zeros(4, dtype=torch.bool)).item())


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_recognised_with_its_rule(family):
    routers = find_routers(tiny_moe_model(family))
    assert routers is not None and routers.layers == 2 and (routers.top_k, routers.num_experts) == (2, 4)
    normalises = family not in ("qwen2_moe", "olmoe")  # (both leave norm_topk_prob False by default)
    assert {r.rule for r in routers.routers} == {"softmax_renormalised" if normalises else "softmax"}
    assert routers.dtype == torch.uint8 and routers.bytes_per_token == 2 * 2


def test_a_30b_a3b_shaped_recording_costs_384_bytes_a_token():
    """Qwen3-30B-A3B: 48 layers, 128 experts, 8 a token: one byte an index."""
    from grpokit.moe.routers import Router, RouterSet

    shaped = RouterSet(tuple(Router(torch.nn.Identity(), i, "softmax_renormalised") for i in range(48)), 8, 128)
    assert shaped.bytes_per_token == 384
    assert RouterSet(shaped.routers, 8, 512).bytes_per_token == 768  # over 254 experts: two bytes an index


def test_a_router_with_an_unknown_gate_is_refused_by_name():
    model = tiny_moe_model("qwen3_moe")
    router = model.model.layers[1].mlp.gate
    original = router.forward
    router.forward = lambda h: tuple(x * 2 if i == 1 else x for i, x in enumerate(original(h)))  # weights ×2
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate \(Qwen3MoeTopKRouter\) is a Mixture-of-Experts "
                                         "router whose gate grpokit does not recognise"):
        find_routers(model)


# -- recording while generating ------------------------------------------------------------------------------------
@pytest.mark.parametrize("decode_loop", [True, False], ids=["decode_loop", "generate"])
@pytest.mark.parametrize("family", FAMILIES)
def test_generation_records_the_experts_a_whole_row_forward_chooses(family, decode_loop):
    """grpokit's decode loop (rows of a group running as one state until they part, finished rows dropped) and
    transformers' ``generate`` (a group's prompt prefilled once) record, at every position they route, the experts a
    forward over the whole row chooses (same weights, float32); every position but each row's last token (never fed
    back while generating, unless ``generate`` ran on past it: rows that end early keep going there) is recorded."""
    from tiny import tiny_tokenizer

    from grpokit.forward.logprobs import completion_logps
    from grpokit.moe import recorded_forward
    from grpokit.rollout.base import SamplingParams
    from grpokit.rollout.transformers_backend import TransformersRollout

    tok = tiny_tokenizer()
    model = tiny_moe_model(family, tok).eval()
    enc = tok([p for p in ("What is 1+1?", "Hi", "Count to 3 please") for _ in range(4)], return_tensors="pt",
              padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    torch.manual_seed(1)
    gen = TransformersRollout(tok, decode_loop=decode_loop).generate(
        model, ids, mask, SamplingParams(max_new_tokens=10, record_routes=True))
    routes = torch.cat([gen.prompt_routes, gen.completion_routes], 1)
    whole: list = []
    with torch.no_grad():
        recorded_forward(find_routers(model), ids.shape[0], routes.shape[1],
                         lambda: completion_logps(model, ids, mask, gen.completion_ids, gen.completion_mask)[0],
                         record=whole)
    valid = torch.cat([mask, gen.completion_mask], 1).bool()
    recorded = (routes != 255).all(-1).all(-1)
    last = valid.shape[1] - 1 - valid.flip(1).long().argmax(1)  # each row's last token
    expected = valid.clone()
    expected[torch.arange(valid.shape[0]), last] = False
    assert bool(recorded[expected].all())
    same = (routes.long().sort(-1).values == whole[0].long().sort(-1).values).all(-1).all(-1)
    assert bool(same[recorded & valid].all())
