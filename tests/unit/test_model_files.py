"""What a local model directory holds (`tidal.models.files`): the one model-directory test and the weights check."""

from __future__ import annotations

import json

import pytest

from tidal.config import ConfigError
from tidal.models.files import check_weights, is_model_dir, missing_weights
from tidal.models.sources import bundled, check_local_model


def test_a_model_directory_holds_a_config_json(tmp_path):
    assert is_model_dir(bundled("tidal:tiny-reverse"))
    assert not is_model_dir(tmp_path) and not is_model_dir(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match=r"no bundled model 'tidal:__pycache__' \(bundled: tidal:tiny-rev"):
        bundled("tidal:__pycache__")  # a package folder is no bundled model


def test_weights_single_file_pytorch_bin_and_sharded(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert missing_weights(tmp_path) == ("no weight files (*.safetensors, *.bin, *.pt, model.safetensors.index.json, "
                                         "pytorch_model.bin.index.json)")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    assert missing_weights(tmp_path) is None
    (tmp_path / "pytorch_model.bin").unlink()
    shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    (tmp_path / shards["a"]).write_bytes(b"x")
    assert missing_weights(tmp_path) == ("1 of the 2 shards its model.safetensors.index.json names are missing "
                                         "(model-00002-of-00002.safetensors)")
    (tmp_path / shards["b"]).write_bytes(b"x")
    assert missing_weights(tmp_path) is None
    assert missing_weights(bundled("tidal:tiny-reverse")) is None


def test_only_local_directories_are_checked(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=rf"train.yaml: key 'model': model directory {tmp_path} holds a config.json "
                                          r"but no weight files"):
        check_weights(str(tmp_path), tmp_path, "train.yaml: key 'model'")
    check_weights("org/name", tmp_path, "train.yaml: key 'model'")  # a Hub id: models.sources.hub checks it
    check_local_model("org/not-downloaded", "reward")  # nothing resolved, nothing downloaded
    check_local_model("tidal:tiny-reverse", "reward")
    (tmp_path / "sub").mkdir()
    with pytest.raises(ConfigError, match=r"reward: '.*sub' is not a model directory \(no config.json in"):
        check_local_model(str(tmp_path / "sub"), "reward")
