"""`tidal serve-tinker` refuses what it cannot serve before it loads anything (exit 2, the reason in the message)."""

from __future__ import annotations

import pytest

from tidal.cli import main
from tidal.tinker.config import TinkerServeConfig


@pytest.mark.parametrize("argv, message", [
    (["--api-key", "secret"], "must start with 'tml-'"),
    (["--host", "0.0.0.0"], "without an explicit --api-key"),
    (["--port", "0"], "port"),
])
def test_refusals_exit_2(argv, message, capsys):
    assert main(["serve-tinker", *argv]) == 2
    assert message in capsys.readouterr().err


def test_config_defaults_are_local():
    cfg = TinkerServeConfig()
    assert (cfg.host, cfg.port, cfg.api_key, cfg.model) == ("127.0.0.1", 8900, None, "tidal:tiny-reverse")
    cfg.check_bind()  # loopback needs no explicit key (a random one is made)


def test_without_the_extra_it_says_how_to_install_it(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "tinker", None)  # as if `tinker` were not installed
    assert main(["serve-tinker", "--port", "1"]) == 2
    assert "pip install 'tidal[tinker]'" in capsys.readouterr().err


def test_enforce_eager_reaches_vllms_argv():
    """`--enforce-eager` -> the config -> infer `enforce_eager` -> vLLM's `--enforce-eager` (off by default)."""
    import argparse

    from tidal.cli import build_parser
    from tidal.inference.backends.vllm.server import vllm_argv
    from tidal.tinker.serve import infer_config

    def argv_of(cli: list[str]) -> list[str]:
        args: argparse.Namespace = build_parser().parse_args(["serve-tinker", *cli])
        cfg = TinkerServeConfig(**{k: v for k, v in vars(args).items() if k in TinkerServeConfig.model_fields
                                   and v is not None})
        return vllm_argv(infer_config(cfg, 8123))

    assert "--enforce-eager" in argv_of(["--enforce-eager"])
    assert "--enforce-eager" not in argv_of([])


def test_the_served_context_length_applies_the_models_rope_factor(tmp_path):
    """The context length the server reports is the positions the model holds, as vLLM counts them
    (`tidal.models.limits`): `max_position_embeddings` x a linear RoPE factor, read from a VLM's text config; an
    explicit `--max-model-len` wins; a model directory without config.json is refused."""
    import json

    from tidal.tinker.serve import ServeError, served_model

    text = {"vocab_size": 128, "hidden_size": 64, "max_position_embeddings": 1024,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Idefics3ForConditionalGeneration"],
                                                      "text_config": text, "vision_config": {}}))
    model = served_model(TinkerServeConfig(model=str(tmp_path)), sampler_on_cpu=True)
    assert model.max_context == 4096 and model.architecture == "Idefics3ForConditionalGeneration"
    assert served_model(TinkerServeConfig(model=str(tmp_path), max_model_len=2000), True).max_context == 2000
    (tmp_path / "empty").mkdir()
    with pytest.raises(ServeError, match="no config.json"):
        served_model(TinkerServeConfig(model=str(tmp_path / "empty")), True)
