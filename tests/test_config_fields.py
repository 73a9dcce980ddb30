"""The written-out list of GRPOConfig fields (used to check job keys without importing transformers) matches
GRPOConfig."""

import dataclasses

import transformers

from grpokit import config_fields
from grpokit.algorithms.losses._registry import config_params
from grpokit.config import GRPOConfig
from grpokit.job_spec import config_field_names


def test_the_written_list_matches_grpoconfig():
    actual = {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
    if config_fields.TRANSFORMERS_VERSION != transformers.__version__:
        # Another transformers: the list is not used, GRPOConfig is read instead.
        assert config_field_names() == actual
        return
    written = config_fields.FIELDS | config_fields.loss_param_fields()
    missing, extra = actual - written, written - actual
    assert not missing and not extra, (
        f"grpokit/config_fields.py is out of date (missing {sorted(missing)}, extra {sorted(extra)}): "
        "run python -m grpokit.config_fields")
    assert config_field_names() == actual


def test_regenerating_gives_the_same_text():
    if config_fields.TRANSFORMERS_VERSION == transformers.__version__:
        assert config_fields._source() == open(config_fields.__file__).read()


def test_loss_fields_are_read_from_the_loss_modules_not_written_here():
    # a new loss is one module: its fields come from its source, and the written list holds none of them
    assert config_fields.loss_param_fields() == set(config_params())
    assert not config_fields.FIELDS & config_fields.loss_param_fields()
