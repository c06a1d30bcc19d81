"""`tidal grpo` builds the model the same way in the trainer and in vLLM: train `rope_scaling` /
`trust_remote_code` follow infer's (and infer's follow train's when only train.yaml sets one); two different
explicit values exit 2 naming both keys. Also: train `device: cuda:N` counts as a GPU placement."""

from __future__ import annotations

import pytest

from tidal.colocate.derive import Machine, derive_colocate
from tidal.colocate.wire import wire_colocate
from tidal.config import ConfigError, InferConfig, OrchConfig, TrainConfig
from tidal.config.load import validate

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def load(train: dict, infer: dict) -> tuple[TrainConfig, InferConfig, OrchConfig]:
    """Configs as `tidal grpo` loads them from files (so `model_fields_set` holds the keys the files set)."""
    return (validate(TrainConfig, {"model": "m", **train}, "train.yaml"),
            validate(InferConfig, {"model": "m", **infer}, "infer.yaml"), OrchConfig())


@pytest.mark.parametrize(("key", "value"), [("rope_scaling", YARN), ("trust_remote_code", True)])
def test_trainer_follows_infer(key, value):
    train, infer, orch = load({}, {key: value})
    t, i, _ = wire_colocate(train, infer, orch)
    assert getattr(t, key) == value and getattr(i, key) == value
    assert getattr(train, key) != value, "the user's config is left untouched"


@pytest.mark.parametrize(("key", "value"), [("rope_scaling", YARN), ("trust_remote_code", True)])
def test_infer_follows_a_value_only_train_sets(key, value):
    t, i, _ = wire_colocate(*load({key: value}, {}))
    assert getattr(t, key) == value and getattr(i, key) == value


@pytest.mark.parametrize(("key", "train_value", "infer_value"), [
    ("rope_scaling", YARN, {**YARN, "factor": 2.0}),
    ("rope_scaling", None, YARN),  # an explicit null is an explicit value too
    ("trust_remote_code", False, True),
])
def test_two_different_explicit_values_are_refused_naming_both_keys(key, train_value, infer_value):
    with pytest.raises(ConfigError, match=rf"train {key} \(.*\) and infer {key} \(.*\) differ"):
        derive_colocate(*load({key: train_value}, {key: infer_value}), Machine(cores=(0, 1)))


def test_equal_explicit_values_and_defaults_pass_unchanged():
    t, i, _ = wire_colocate(*load({"rope_scaling": YARN, "trust_remote_code": True},
                                  {"rope_scaling": YARN, "trust_remote_code": True}))
    assert (t.rope_scaling, t.trust_remote_code, i.rope_scaling, i.trust_remote_code) == (YARN, True, YARN, True)
    t, i, _ = wire_colocate(*load({}, {}))
    assert (t.rope_scaling, t.trust_remote_code, i.rope_scaling, i.trust_remote_code) == (None, False, None, False)


def test_cuda_n_trainer_device_is_a_gpu_placement():
    train, infer, orch = load({"device": "cuda:1"}, {})
    co = derive_colocate(train, infer, orch, Machine(cores=(0, 1, 2, 3)))
    assert co.placement.device == "cuda" and co.placement.vllm_cores is None and co.train.device == "cuda:1"
