"""Held-out evaluation: how many prompts generate together changes nothing but speed, and a LoRA adapter is merged
into the weights once for the whole evaluation."""

import torch
from tiny import tiny_model, tiny_tokenizer

from grpokit.evaluation import evaluate
from grpokit.rewards import correctness, format_reward
from grpokit.tasks import get_task


def _lora_model():
    from peft import LoraConfig, get_peft_model

    tok = tiny_tokenizer()
    return get_peft_model(tiny_model(tok), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                      init_lora_weights=False)), tok


def test_batch_size_changes_nothing_but_speed_and_the_adapter_is_merged_once(monkeypatch):
    """Once for the whole evaluation: on a CPU with oneDNN the adapter folded into each layer's packed weight (no
    merge), elsewhere merged."""
    from grpokit.rollout import packed

    model, tok = _lora_model()
    held_out = get_task("arithmetic").eval_dataset
    merges, folds = [], []
    merge, pack = model.merge_adapter, packed._pack
    monkeypatch.setattr(model, "merge_adapter", lambda *a, **k: (merges.append(1), merge(*a, **k))[1])
    monkeypatch.setattr(packed, "_pack", lambda layer, *a: (folds.append(1) if hasattr(layer, "lora_A") else None,
                                                            pack(layer, *a))[1])
    n_lora = sum(hasattr(m, "lora_A") and hasattr(m, "base_layer") for m in model.modules())
    results = {}
    for batch_size in (3, 7, 10):
        merges.clear()
        folds.clear()
        summary, samples = evaluate(model, tok, held_out, [correctness, format_reward], accuracy_reward="correctness",
                                    n=10, max_new_tokens=6, batch_size=batch_size, num_samples=10)
        results[batch_size] = [s["completion"] for s in samples]
        assert summary["n"] == 10  # 4, 2 and 1 batches: folded or merged once for all of them
        assert (len(merges), len(folds)) == ((0, n_lora) if packed.packing_available() else (1, 0))
    assert results[3] == results[7] == results[10]
    base = [p for n, p in model.named_parameters() if "base_layer" in n]
    assert base and not any(m.merged_adapters for m in model.modules() if hasattr(m, "merged_adapters"))
    assert all(torch.isfinite(p).all() for p in base)


def test_the_format_free_accuracy_is_the_last_number_against_the_answer():
    from grpokit.evaluation import last_number_accuracy
    from grpokit.rewards.answers import last_number

    assert last_number("4 + 6 = 10") == 10 and last_number("so -3.5, then 1,200.") == 1200
    assert last_number("no digits") is None and last_number("3/4") == 0.75
    rows = [{"answer": "10"}, {"answer": "31"}, {"answer": "7"}, {"answer": 2}]
    texts = ["4 + 6 = 10", "11 + 20 = 31\nAnswer: 31", "Answer: 8", "two"]  # right, right, wrong, no number
    out = last_number_accuracy(rows, texts)
    assert out["last_number_accuracy"] == 0.5 and out["last_number_correct"] == 2
    lo, hi = out["last_number_ci95"]
    assert lo < 0.5 < hi
    assert last_number_accuracy([{"answer": "ten"}], ["10"]) == {}  # answers that are not numbers: none


def test_sampled_evaluation_takes_top_k_and_top_p():
    """``greedy=False`` samples as training does, with its ``top_k`` and ``top_p``: at temperature 5 the tiny model's
    replies scatter, and among its single likeliest token (``top_k=1``) or the smallest mass (``top_p`` near 0) they
    are the greedy ones."""
    model, tok = _lora_model()
    held_out = get_task("arithmetic").eval_dataset

    def replies(**kw):
        torch.manual_seed(0)
        _, samples = evaluate(model, tok, held_out, [correctness], accuracy_reward="correctness", n=8,
                              max_new_tokens=6, batch_size=8, num_samples=8, **kw)
        return [s["completion"] for s in samples]

    greedy = replies()
    assert replies(greedy=False, temperature=5.0) != greedy
    assert replies(greedy=False, temperature=5.0, top_k=1) == greedy
    assert replies(greedy=False, temperature=5.0, top_p=1e-6) == greedy
