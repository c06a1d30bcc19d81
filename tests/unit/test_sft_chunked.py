"""`tidal sft` with train `logprob_chunk_size` (the loss from the final hidden states a few positions at a
time, recomputed in the backward) and its atomic, snapshot-keeping saves."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tidal.config import ConfigError
from tidal.paths import STABLE
from tidal.trainer.sft import check_save_to, save, sft_loss
from tidal.trainer.step.packing import pack
from tidal.transport.batch import TrainingBatch


@pytest.fixture(scope="module")
def model():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                      tie_word_embeddings=True)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    return get_peft_model(Qwen3ForCausalLM(cfg).double(), lora)


def micro_batch():
    rng = np.random.default_rng()
    lengths = rng.integers(4, 12, size=5)
    total = int(lengths.sum())
    mask = np.concatenate([np.r_[np.zeros(2), np.ones(n - 2)] for n in lengths])
    batch = TrainingBatch(step=1, temperature=1.0, tokens=rng.integers(0, 50, total), lengths=lengths,
                          loss_mask=mask, inference_logprobs=np.zeros(total), advantages=np.zeros(total),
                          rewards=np.zeros(5), policy_steps=np.zeros(5))
    (mb,) = pack(batch, 128, 1)
    return mb


def reference_loss(model, mb, eps):
    """The label-smoothed NLL from the model's whole float64 logits (the formula of `sft.label_smoothing`)."""
    out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False)  # packed: no cache
    logp = torch.log_softmax(out.logits[:, :-1], -1)  # (B, T-1, V)
    nll = -logp.gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    return (((1 - eps) * nll - eps * logp.mean(-1)) * mb.loss_mask[:, 1:]).sum()


def loss_and_grads(model, mb, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, mb)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("eps", [0.0, 0.3])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_loss_and_gradients_equal_a_float64_reference(model, eps, chunk):
    mb = micro_batch()
    ref, g_ref = loss_and_grads(model, mb, lambda m, b: reference_loss(m, b, eps))
    got, g_got = loss_and_grads(model, mb, lambda m, b: sft_loss(m, b, eps, chunk))
    assert got == pytest.approx(ref, rel=1e-10)
    assert g_got.keys() == g_ref.keys() and any("lm_head" in n for n in g_got)  # LoRA on the (tied) head too
    for name, g in g_ref.items():
        torch.testing.assert_close(g_got[name], g, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_chunk_size_0_is_the_full_logits_path_in_float32(model, eps):
    mb = micro_batch()
    ref, g_ref = loss_and_grads(model, mb, lambda m, b: reference_loss(m, b, eps))
    got, g_got = loss_and_grads(model, mb, lambda m, b: sft_loss(m, b, eps, 0))
    assert got == pytest.approx(ref, rel=1e-6)  # log-softmax in float32 by design
    for name, g in g_ref.items():
        torch.testing.assert_close(g_got[name], g, rtol=1e-4, atol=1e-6, msg=name)


class Saver:
    """What `save` calls: `save_pretrained` writes a file holding a version number."""

    def __init__(self, version: int, fail: bool = False) -> None:
        self.version, self.fail = version, fail

    def save_pretrained(self, path: str, **_: object) -> None:
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"version": self.version}, f)
        if self.fail:
            raise OSError("disk full")


def test_save_is_atomic_and_keeps_earlier_snapshots(tmp_path):
    out = tmp_path / "sft"
    save(Saver(1), None, True, out / "step_10")
    save(Saver(2), None, True, out)
    assert json.loads((out / "adapter_config.json").read_text()) == {"version": 2} and (out / STABLE).exists()
    assert json.loads((out / "step_10" / "adapter_config.json").read_text()) == {"version": 1}
    assert (out / "step_10" / STABLE).exists()
    with pytest.raises(OSError, match="disk full"):
        save(Saver(3, fail=True), None, True, out)  # a failed save leaves the previous result as it was
    assert json.loads((out / "adapter_config.json").read_text()) == {"version": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft"]  # no temp directory left behind
    save(Saver(4), None, True, out)
    assert (out / "step_10" / "adapter_config.json").exists()


def test_save_to_that_would_destroy_other_files_is_refused_before_training(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="sft.save_to .* is the model being trained"):
        check_save_to(model_dir, model_dir)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds other files \(model, notes.txt"):
        check_save_to(tmp_path, model_dir)
    check_save_to(tmp_path / "new", model_dir)  # absent: fine
    earlier = tmp_path / "earlier"
    save(Saver(1), None, True, earlier)
    check_save_to(earlier, model_dir)  # an earlier result may be replaced


def test_a_short_run_uses_the_train_chunk_size_and_saves_atomically(tmp_path, monkeypatch):
    from tidal.config import TrainConfig
    from tidal.trainer import sft

    seen: list[int] = []

    def spy(model, mb, eps, chunk_size=-1):
        seen.append(chunk_size)
        return sft_loss(model, mb, eps, chunk_size)

    monkeypatch.setattr(sft, "sft_loss", spy)
    out = tmp_path / "sft"
    cfg = TrainConfig(model="tidal:tiny-reverse", max_steps=2, logprob_chunk_size=7, sequence_len=256,
                      sft={"examples_per_step": 2, "save_to": str(out), "save_every": 1, "label_smoothing": 0.1})
    assert sft.run(cfg) == out
    assert seen and set(seen) == {7}
    assert (out / STABLE).exists() and (out / "adapter_config.json").exists()
    assert (out / "step_1" / STABLE).exists() and not (out / "step_2").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["sft"]
