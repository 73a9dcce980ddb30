"""The hand-checked vectors in tests/reference/algorithm_vectors.json (expected values from the plain-Python
reading of docs/algorithms.md, cross-checked against TRL 1.16 where TRL computes the same thing). They need neither
TRL nor hypothesis, so they guard the math in any environment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpokit.algorithms import LossContext, vespo_weights

from ._common import assert_close, assert_grid_close, run_ours

DATA = json.loads((Path(__file__).resolve().parents[1] / "reference" / "algorithm_vectors.json").read_text())
F64 = torch.float64


def _t(x):
    return None if x is None else torch.tensor(x, dtype=F64)


@pytest.mark.parametrize("vec", DATA["vectors"], ids=lambda v: v["name"])
def test_policy_loss_reference_vector(vec):
    kw = {k: (_t(v) if isinstance(v, list) else v) for k, v in vec["kwargs"].items()}
    inp = vec["inputs"]
    loss, grad, _ = run_ours(_t(inp["lp"]), _t(inp["old"]), _t(inp["A"]), _t(inp["m"]), loss_type=vec["loss_type"],
                             importance_sampling_level=vec["level"], **kw)
    assert_close(loss, vec["expected_loss"], rel=1e-10, abs_=1e-12, what="loss")
    assert_grid_close(grad, vec["expected_grad"], rel=1e-6, abs_=1e-8, what="grad")


def test_every_loss_type_and_level_has_a_vector():
    from ._common import LEVELS, REFERENCE_LOSSES

    seen = {(v["loss_type"], v["level"]) for v in DATA["vectors"]}
    assert seen == {(lt, lv) for lt in REFERENCE_LOSSES for lv in LEVELS}
    assert sum("trl-1.16.0" in v["checked_against"] for v in DATA["vectors"]) >= 20


def test_vespo_reference_phi():
    ref = DATA["vespo_reference"]
    d, m = _t(ref["d"]), _t(ref["mask"])
    ctx = LossContext(lp=d, d=d, log_w=d, A=_t(ref["A"]).unsqueeze(-1), mask=m, eps_lo=0.2, eps_hi=0.2)
    phi, _ = vespo_weights(ctx)
    assert phi.squeeze(-1).tolist() == pytest.approx(ref["phi"], abs=1e-6)
