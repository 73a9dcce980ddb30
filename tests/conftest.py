import os
import sys

# Under pytest-xdist (`make test` runs two workers) each worker gets its share of the cores, set before torch is
# imported: two workers with a thread per core each would fight over the same cores (and torch's threads spin: a
# test then runs several times slower). The controlling process loads this file first and sets OMP_NUM_THREADS below,
# which the workers inherit, so it notes whether the count was the user's.
os.environ.setdefault("GRPOKIT_TESTS_USER_THREADS", "1" if "OMP_NUM_THREADS" in os.environ else "0")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and os.environ["GRPOKIT_TESTS_USER_THREADS"] == "0":
    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))

# No test reaches the network: a hub id that is not on disk fails at once instead of after the hub client's retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A job fits torch's threads to the free cores unless OMP_NUM_THREADS is set (grpokit/machine/threads.py); tests pin the
# count (torch's default here) so that a busy machine does not change float summation order between the runs a test
# compares. Launchers of several processes set their own (1).
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

from tiny import tiny_model, tiny_tokenizer  # noqa: E402

from grpokit.rollout.base import Generation, completion_mask_from_eos  # noqa: E402


class FixedRollout:
    """A deterministic rollout backend: random tokens from a seeded generator (one draw per call), with an EOS
    at a random position in some rows. Two trainers given the same seed see identical rollouts."""

    def __init__(self, tokenizer, seed: int = 0, eos_prob: float = 0.5, sampler_noise: float | None = None):
        self.tokenizer = tokenizer
        self.gen = torch.Generator().manual_seed(seed)
        self.eos_prob = eos_prob
        self.sampler_noise = sampler_noise
        self.synced = 0

    def generate(self, model, prompt_ids, prompt_mask, params):
        n, c = prompt_ids.shape[0], params.max_new_tokens
        ids = torch.randint(10, len(self.tokenizer), (n, c), generator=self.gen)
        eos_pos = torch.randint(1, c + 1, (n,), generator=self.gen)
        has_eos = torch.rand(n, generator=self.gen) < self.eos_prob
        for i in range(n):
            if has_eos[i] and eos_pos[i] < c:
                ids[i, eos_pos[i]] = self.tokenizer.eos_token_id
        mask, truncated = completion_mask_from_eos(ids, [self.tokenizer.eos_token_id])
        ids = ids.masked_fill(mask == 0, self.tokenizer.pad_token_id)
        sampler_logps = None
        if self.sampler_noise is not None:
            sampler_logps = -torch.rand(n, c, generator=self.gen) * 3 - self.sampler_noise
        return Generation(ids, mask, truncated, sampler_logps)

    def sync_weights(self, model, step=None):
        self.synced += 1


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random model and its tokenizer saved to a directory, as a user's local model would be."""
    d = tmp_path_factory.mktemp("tiny_model")
    tok = tiny_tokenizer()
    tiny_model(tok).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def model(tokenizer):
    return tiny_model(tokenizer)


@pytest.fixture(scope="session")
def one_rank(tmp_path_factory):
    """The one-process references for the multi-process runs of tests/distributed, made by one process one after
    another: 4 rows × gradient accumulation 2 (the same 8-row generation batches as two ranks × 4 rows) for dapo,
    grpo and vespo in this folder; ``split/``: 2 rows × GA 2 with G = 4 (dapo); ``top-entropy/``: 8 rows in one
    micro-batch with ``top_entropy_quantile`` 0.3 (dapo). Here rather than in a tests/distributed/conftest.py, whose
    module name would shadow this file's for ``from conftest import``."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))
    from launch import LOSSES, single_several

    out = tmp_path_factory.mktemp("one-rank")
    single_several([(out, ["4", "2", ",".join(LOSSES)]), (out / "split", ["2", "2", "dapo"]),
                    (out / "top-entropy", ["8", "1", "dapo", "--top-entropy", "0.3"])])
    return out
