import pytest
from launch import LOSSES, single


@pytest.fixture(scope="session")
def one_rank(tmp_path_factory):
    """The reference for every multi-process run: one process, 4 rows × gradient accumulation 2 (the same 8-row
    generation batches as two ranks × 4 rows), for dapo, grpo and vespo."""
    out = tmp_path_factory.mktemp("one-rank")
    single(out, 4, 2, LOSSES)
    return out
