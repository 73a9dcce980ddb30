"""Regenerate ``algorithm_vectors.json``: reference values of ``policy_loss`` for every loss type and level.

Each vector's expected loss and gradient come from the plain-Python reading of docs/algorithms.md in
``tests/algorithms/_pyref.py`` (value; gradient by central differences on the non-detached path). Where TRL 1.16
computes the same thing (not gmpo, not sequence_token, not the bias-corrected KL at sequence level, CISPO with
an explicit cap) the vector is also checked against ``GRPOTrainer._compute_loss`` to 1e-6 before it is written,
and its ``checked_against`` says so. grpokit itself is never called here.

    python tests/reference/make_algorithm_vectors.py
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import torch  # noqa: E402

from tests.algorithms import _pyref  # noqa: E402
from tests.algorithms._common import LEVELS, LOSS_TYPES, make_case  # noqa: E402

OPTION_SETS = {
    "default": {},
    "clip_delta_kl": dict(epsilon=0.1, epsilon_high=0.3, delta=1.25, beta=0.05, ref_logps="ref",
                          use_bias_correction_kl=True),
    "masks_ratio_aggregation": dict(sampler_ratio="rho_tok", entropies="ent", top_entropy_quantile=0.6,
                                    off_policy_mask_threshold=0.0, sampler_logps="sampler_lp",
                                    max_completion_length=6, num_items_in_batch=20, gradient_accumulation_steps=2,
                                    steps_per_generation=2, num_processes=2),
}


def _round(x: torch.Tensor, nd: int = 6) -> list:
    return [[round(v, nd) for v in row] for row in x.tolist()] if x.dim() == 2 else [round(v, nd) for v in x.tolist()]


def _trl_check(vec) -> bool:
    try:
        from tests.algorithms._trl_harness import trl_loss
    except ImportError:
        return False
    kw = dict(vec["kwargs"])
    lt, level = vec["loss_type"], vec["level"]
    if lt == "gmpo" or level == "sequence_token" or (level == "sequence" and kw.get("use_bias_correction_kl")):
        return False
    if lt == "cispo" and kw.get("epsilon_high") is None:
        return False
    if lt == "sapo":
        return False  # TRL evaluates the temperatures in float32 (see test_trl_conformance.py)
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in vec["inputs"].items() if v is not None}
    for key in ("ref_logps", "sampler_ratio", "entropies", "sampler_logps"):
        if key in kw:
            kw[key] = torch.tensor(kw[key], dtype=torch.float64)
    kw["importance_sampling_ratio"] = kw.pop("sampler_ratio", None)
    loss, x, _ = trl_loss(t["lp"], t.get("old"), t["A"], t["m"], loss_type=lt, importance_sampling_level=level,
                          entropies=kw.pop("entropies", None), **kw)
    assert abs(loss.item() - vec["expected_loss"]) <= 1e-6 * abs(vec["expected_loss"]) + 1e-12, (lt, level)
    for ga, ge in zip(x.grad.tolist(), vec["expected_grad"]):
        for a, e in zip(ga, ge):
            assert abs(a - e) <= 1e-6 * max(abs(e), 1e-3), (lt, level, a, e)
    return True


def main() -> None:
    vectors = []
    for loss_type in LOSS_TYPES:
        for level in LEVELS:
            for name, opts in OPTION_SETS.items():
                seed = len(vectors) + 1
                case = make_case(seed=seed, B=3, T=4, sigma=0.3)
                inputs = dict(lp=_round(case["lp"]), old=_round(case["old"]), A=_round(case["A"]),
                              m=_round(case["m"]))
                kwargs = {}
                for k, v in opts.items():
                    # entropies stay float32-exact: the entropy mask compares in float32
                    kwargs[k] = (case[v].tolist() if v == "ent" else _round(case[v])) if isinstance(v, str) else v
                if loss_type == "cispo" and name != "default":
                    kwargs.setdefault("epsilon_high", 3.0)
                ref_kw = dict(kwargs)
                if "ref_logps" in ref_kw:
                    ref_kw["ref"] = ref_kw.pop("ref_logps")
                args = (inputs["lp"], inputs["old"], inputs["A"], inputs["m"])
                loss = _pyref.ref_policy_loss(*args, loss_type=loss_type, level=level, **ref_kw)
                grad = _pyref.fd_grad(*args, loss_type=loss_type, level=level, **ref_kw)
                assert math.isfinite(loss)
                vec = dict(name=f"{loss_type}/{level}/{name}", loss_type=loss_type, level=level, inputs=inputs,
                           kwargs=kwargs, expected_loss=loss, expected_grad=grad, checked_against=["pyref"])
                if _trl_check(vec):
                    vec["checked_against"].append("trl-1.16.0")
                vectors.append(vec)
    out = dict(
        description="policy_loss reference vectors (docs/algorithms.md §1-§6); regenerate with make_algorithm_vectors.py",
        vespo_reference=dict(
            A=[1, 1, -1, -1, 0],
            d=[[0, 0, 0, 0], [.1, .1, .1, 0], [.1, .1, .1, 0], [-.5, -.5, 0, 0], [.2, .2, .2, .2]],
            mask=[[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]],
            phi=[1.000000, 0.637898, 1.221748, 0.176266, 0.125353],
            source="docs/algorithms.md §2 (VESPO) (TRL 1.16 get_gamma_weights)",
        ),
        vectors=vectors,
    )
    (HERE / "algorithm_vectors.json").write_text(json.dumps(out, indent=1) + "\n")
    n_trl = sum("trl-1.16.0" in v["checked_against"] for v in vectors)
    print(f"wrote {len(vectors)} vectors ({n_trl} also checked against TRL)")


if __name__ == "__main__":
    main()
