"""grpokit.forward.sharding in one process (a one-rank gloo group): detection, what it switches off, and the FSDP2
gather-for-generation context restoring FSDP's own settings. Two-rank behaviour: tests/distributed/test_sharded.py."""

import pytest
import torch
import torch.distributed as dist
from tiny import tiny_model, tiny_tokenizer

from grpokit.forward.logprobs import _shares_prompts, completion_logps, lean_head
from grpokit.forward.sharding import _reshard_setting, full_weights, sharding_kind, weights_for_generation


@pytest.fixture
def one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def fsdp2_model(one_rank_group):
    from torch.distributed.fsdp import fully_shard

    model = tiny_model(tiny_tokenizer(), seed=3)
    plain = tiny_model(tiny_tokenizer(), seed=3)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, plain


def test_plain_and_ddp_models_are_not_sharded(one_rank_group):
    model = tiny_model(tiny_tokenizer())
    assert sharding_kind(model) is None
    assert sharding_kind(torch.nn.parallel.DistributedDataParallel(model)) is None
    with weights_for_generation(model, model, gather=True) as w:
        assert w.model is model and not w.lockstep


def test_fsdp2_is_detected_and_the_shortcuts_are_off(fsdp2_model):
    model, plain = fsdp2_model
    assert sharding_kind(model) == "fsdp2"
    assert lean_head(model) is None and not _shares_prompts(model)
    assert lean_head(plain) is not None  # the same model unsharded takes the chunked head


def test_fsdp2_log_probs_equal_the_unsharded_model(fsdp2_model):
    model, plain = fsdp2_model
    tok = tiny_tokenizer()
    prompt = torch.tensor([[5, 6, 7]] * 4)
    completion = torch.randint(10, len(tok), (4, 5), generator=torch.Generator().manual_seed(0))
    masks = torch.ones_like(prompt), torch.tensor([[1] * 5, [1] * 5, [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    got, ent = completion_logps(model, prompt, masks[0], completion, masks[1])
    want, want_ent = completion_logps(plain, prompt, masks[0], completion, masks[1])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gather", [True, False])
def test_fsdp2_generation_context(fsdp2_model, gather):
    model, _ = fsdp2_model
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    before = [_reshard_setting(m) for m in units]
    with weights_for_generation(model, model, gather=gather) as w:
        assert w.lockstep is (not gather)
        if gather:  # every parameter is a whole plain tensor while generating
            assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert [_reshard_setting(m) for m in units] == before
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())  # sharded again


def test_full_weights_reads_whole_parameters(fsdp2_model):
    model, plain = fsdp2_model
    with full_weights(model):
        got = dict(model.named_parameters())
        for name, p in plain.named_parameters():
            torch.testing.assert_close(got[name].detach(), p.detach(), atol=0, rtol=0)
