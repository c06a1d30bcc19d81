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
