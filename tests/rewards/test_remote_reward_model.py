"""RemoteRewardModel: a real tiny sequence-classification model served over TEI's /predict and vLLM's /classify by a
test server gives the scores the model gives in the trainer; faults follow the shared service rules."""

import pytest
import torch
from service_servers import FaultServer, closed_port
from tiny import tiny_tokenizer
from transformers import LlamaConfig, LlamaForSequenceClassification

from grpokit.rewards import RemoteRewardModel, RewardServiceError, score_completions
from grpokit.rewards.scoring import _reward_model_scores


@pytest.fixture
def server():
    with FaultServer() as s:
        yield s


@pytest.fixture(scope="module")
def classifier():
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=2, pad_token_id=tok.pad_token_id)
    model = LlamaForSequenceClassification(cfg).eval()

    @torch.no_grad()
    def logits(texts):
        enc = tok(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        return model(**enc).logits.tolist()

    return model, tok, logits


PROMPTS = ["2 + 2 =", "The capital of France is", "Hello"]
COMPLETIONS = [" 4", " Paris.", " there, how are you?"]


def test_tei_scores_are_the_models_first_logit(server, classifier):
    model, tok, logits = classifier
    server.reward_model = logits
    rm = RemoteRewardModel(server.url, batch_size=2)
    out = rm(prompts=PROMPTS, completions=COMPLETIONS)
    expected = _reward_model_scores(model, tok, PROMPTS, COMPLETIONS)
    assert out == pytest.approx(expected, abs=1e-5)
    assert server.paths() == ["/predict", "/predict"]  # 3 texts in requests of 2
    bodies = sorted((r["body"] for r in server.requests), key=lambda b: len(b["inputs"]))  # sent concurrently
    assert bodies == [{"inputs": [PROMPTS[2] + COMPLETIONS[2]], "raw_scores": True, "truncate": True},
                      {"inputs": [PROMPTS[0] + COMPLETIONS[0], PROMPTS[1] + COMPLETIONS[1]], "raw_scores": True,
                       "truncate": True}]
    second = RemoteRewardModel(server.url, label="LABEL_1")(prompts=PROMPTS, completions=COMPLETIONS)
    assert second == pytest.approx([row[1] for row in logits([p + c for p, c in zip(PROMPTS, COMPLETIONS)])],
                                   abs=1e-5)


def test_vllm_classify_probabilities_by_index(server, classifier):
    _, _, logits = classifier
    server.reward_model = lambda texts: torch.tensor(logits(texts)).softmax(-1).tolist()
    rm = RemoteRewardModel(server.url, api="vllm", model="rm", label=1, batch_size=8)
    out = rm(prompts=PROMPTS, completions=COMPLETIONS)
    probs = torch.tensor(logits([p + c for p, c in zip(PROMPTS, COMPLETIONS)])).softmax(-1)[:, 1].tolist()
    assert out == pytest.approx(probs, abs=1e-6)  # the server answered out of order: sorted by index
    assert server.paths() == ["/classify"] and server.requests[0]["body"]["model"] == "rm"


def test_chat_prompts_through_the_tokenizers_template(server, classifier, tiny_dir):
    model, tok, logits = classifier
    server.reward_model = logits
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    out = RemoteRewardModel(server.url, tokenizer=str(tiny_dir))(prompts=prompts, completions=completions)
    assert out == pytest.approx(_reward_model_scores(model, tok, prompts, completions), abs=1e-5)
    with pytest.raises(ValueError, match="chat prompts need RemoteRewardModel\\(tokenizer=...\\)"):
        RemoteRewardModel(server.url)(prompts=prompts, completions=completions)


def test_per_text_cache_and_batches(server):
    rm = RemoteRewardModel(server.url, batch_size=2)
    log = {}
    out = rm(prompts=["", "", ""], completions=["ab", "ab", "abc"], log_metric=lambda k, v: log.setdefault(k, []).append(v))
    assert out == [2.0, 2.0, 3.0] and len(server.requests) == 1  # the duplicate was not sent
    assert rm(prompts=["", ""], completions=["abc", "abcd"]) == [3.0, 4.0]
    assert server.requests[-1]["body"]["inputs"] == ["abcd"]
    assert rm.stats["cache_hits"] == 2 and log["rewards/remote_reward_model/cache_hits"] == [1.0]


def test_faults_retry_then_fail_a_batch(server):
    server.script.extend([("status", 429, {"Retry-After": "0"}), ("slow", 2.0), ("status", 502, {})])
    rm = RemoteRewardModel(server.url, batch_size=2, max_concurrency=1, max_retries=1, timeout_s=0.3, backoff_s=0.01)
    out = rm(prompts=[""] * 4, completions=["a", "bb", "ccc", "dddd"])
    # the first request of two texts: 429, then a timeout, out of retries; the second: 502, then answered
    assert out == [None, None, 3.0, 4.0]
    assert rm.stats["failures"] == 2 and rm.stats["retries"] == 2 and rm.stats["requests"] == 4


def test_malformed_answers_and_connection_refused(server):
    server.reward_model = lambda texts: [[] for _ in texts]  # no LABEL_0 in the answer
    rm = RemoteRewardModel(server.url, max_retries=0)
    assert rm(prompts=[""], completions=["x"]) == [None] and rm.stats["failures"] == 1
    down = RemoteRewardModel(f"http://127.0.0.1:{closed_port()}", max_retries=1, backoff_s=0.01)
    assert down(prompts=["", ""], completions=["x", "y"]) == [None, None]
    assert down.stats["requests"] == 2  # one request of two texts, tried twice


def test_stop_and_configuration_errors(server, monkeypatch):
    monkeypatch.setenv("RM_TOKEN", "tok-secret-123")
    server.script.append(("status", 403, {}))
    rm = RemoteRewardModel(server.url, api_key_env="RM_TOKEN")
    with pytest.raises(RewardServiceError, match="HTTP 403") as info:
        rm(prompts=[""], completions=["x"])
    assert "tok-secret-123" not in str(info.value)
    assert server.requests[0]["headers"]["authorization"] == "Bearer tok-secret-123"
    server.script.extend([("status", 500, {})] * 2)
    stop = RemoteRewardModel(server.url, on_failure="stop", max_retries=1, backoff_s=0.01)
    with pytest.raises(Exception, match="failed: HTTP 500.*on_failure='stop'"):
        score_completions([stop], [None], prompts=[""], completions=["x"], completion_ids=[[1]], rows=[{}])


@pytest.mark.parametrize("change,message", [
    (dict(api="openai"), "RemoteRewardModel.api='openai' is not allowed"),
    (dict(api="vllm"), "api 'vllm' needs the served model's name"),
    (dict(api="vllm", model="m", label="LABEL_0"), "returns probabilities by index"),
    (dict(label=-1), "RemoteRewardModel.label=-1 is not allowed"),
    (dict(batch_size=0), "RemoteRewardModel.batch_size=0 is not allowed"),
    (dict(max_concurrency=0), "RemoteRewardModel.max_concurrency=0 is not allowed"),
])
def test_bad_options(change, message):
    with pytest.raises(ValueError, match=message):
        RemoteRewardModel("http://127.0.0.1:1", **change)
