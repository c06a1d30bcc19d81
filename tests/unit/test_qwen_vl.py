"""Qwen2.5-VL and Qwen3-VL in the trainer, in float64 against the Hugging Face model's own forward per sample: the
image features on the prompt placeholders, the M-RoPE positions restarting per packed sample
(`tidal.trainer.model.mrope`), Qwen3-VL's deepstack features, packed and unpacked rows, the chunked and full-logits
paths, gradients of full fine-tuning (vision tower included) and LoRA on the language model only."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.tiny_qwen_vl import ARCHS, IMAGE_TOKEN_ID, VISION_END, VISION_START, build_tiny_qwen_vl
from tidal.config.load import ConfigError
from tidal.config.orch import OrchConfig
from tidal.config.train import TrainConfig
from tidal.envs.images import png_bytes
from tidal.inference.protocol import Completion
from tidal.orchestrator.assemble import build_batch
from tidal.trainer.model.load import load_base_model, load_policy
from tidal.trainer.model.mrope import sample_positions
from tidal.trainer.model.vision import attach_images, image_processor, pixel_tensors
from tidal.trainer.step.logprobs import forward_logprobs
from tidal.trainer.step.packing import pack
from tidal.transport.batch import TrainingBatch

F64 = {"rtol": 1e-9, "atol": 1e-9}
F32_OUT = {"rtol": 1e-6, "atol": 2e-6}
"""The full-logits path (chunk size 0) returns float32 logprobs by design (`token_logprobs`): one float32 rounding."""


@pytest.fixture(scope="module", params=ARCHS)
def qwen_dir(request, tmp_path_factory) -> Path:
    return build_tiny_qwen_vl(tmp_path_factory.mktemp(request.param), request.param)


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def sample_ids(grids: list[torch.Tensor], seed: int) -> list[int]:
    """A prompt as Qwen's processor expands it: text, then per image <vision_start> <image_pad> x tokens
    <vision_end>, then text."""
    rng = np.random.default_rng(seed)
    ids = [1, *rng.integers(5, 90, 3).tolist()]
    for g in grids:
        ids += [VISION_START] + [IMAGE_TOKEN_ID] * (int(g.prod()) // 4) + [VISION_END] + [int(rng.integers(5, 90))]
    return ids + rng.integers(5, 90, 2).tolist()


def qwen_batch(model_dir: Path, images: list[list[Image.Image]], completion: int = 4,
               seed: int = 0) -> tuple[TrainingBatch, list[list[int]], list[dict[str, torch.Tensor]]]:
    """One sample per prompt (`images[i]` its images, any number), completions of random tokens: the batch, each
    sample's ids, and each sample's processor tensors (all its images concatenated; {} without images)."""
    proc = image_processor(str(model_dir))
    pngs = [[png_bytes({"type": "image", "image": im}) for im in ims] for ims in images]
    prompts, groups, seqs, pixels = [], [], [], []
    rng = np.random.default_rng(seed)
    for i, ims in enumerate(pngs):
        px = [pixel_tensors(proc, p) for p in ims]
        prompt = sample_ids([p["image_grid_thw"] for p in px], seed + i)
        done = rng.integers(5, 90, completion + 2 * i).tolist()
        prompts.append(prompt)
        groups.append([Completion(done, [-0.5] * len(done), "x", "stop")])
        seqs.append(prompt + done)
        pixels.append({k: torch.cat([p[k] for p in px]) for k in ("pixel_values", "image_grid_thw")} if px else {})
    adv = [np.ones(len(g[0].token_ids)) for g in groups]
    batch, _ = build_batch(1, prompts, groups, np.zeros(len(prompts)), adv, 0,
                           OrchConfig(rollouts_per_example=1), images=pngs)
    return batch, seqs, pixels


def reference_logprobs(ref: torch.nn.Module, ids: list[int], px: dict[str, torch.Tensor], temp: float) -> torch.Tensor:
    """The Hugging Face model's own forward on one sample (its M-RoPE positions from `mm_token_type_ids`)."""
    t = torch.tensor([ids])
    extra = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in px.items()}
    logits = ref(input_ids=t, mm_token_type_ids=(t == IMAGE_TOKEN_ID).int(), use_cache=False, **extra).logits
    lp = torch.log_softmax(logits[0, :-1].double() / temp, -1).gather(-1, t[0, 1:, None]).squeeze(-1)  # (L-1,)
    return torch.nn.functional.pad(lp, (1, 0))


def models(model_dir: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """tidal's float64 model (its packed attention) and the float64 reference, same weights (transformers' SDPA
    attention: its eager attention takes the softmax in float32)."""
    from transformers import AutoModelForImageTextToText

    mine = load_base_model(str(model_dir), torch.device("cpu"), torch.float64).eval()
    ref = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float64,
                                                      attn_implementation="sdpa").eval()
    return mine, ref


def three_samples(model_dir: Path, seed: int = 0):
    """A sample with one image, one with two (different shapes), one without."""
    ims = [[picture(seed, (40, 32))], [picture(seed + 1, (48, 32)), picture(seed + 2, (32, 48))], []]
    return qwen_batch(model_dir, ims, seed=seed)


def per_sample_check(mb, got: torch.Tensor, want: list[torch.Tensor], tol: dict[str, float] = F64) -> int:
    """Compare the micro-batch's logprobs of each sample's loss tokens with the reference; returns samples seen."""
    seen = 0
    for r in range(mb.input_ids.shape[0]):
        for i in {int(x) for x in mb.seq_ids[r].tolist() if x >= 0}:
            cols = (mb.seq_ids[r] == i) & mb.loss_mask[r]
            n = int(cols.sum())
            torch.testing.assert_close(got[r, cols], want[i][-n:].to(got.dtype), **tol)
            seen += 1
    return seen


@pytest.mark.parametrize(("chunk", "packed"), [(0, True), (4, True), (4, False)])
def test_logprobs_equal_the_models_own_forward_per_sample(qwen_dir, chunk, packed):
    """Samples with one, two and no images, packed in one row (or one per row, padded): the trainer's float64
    logprobs of the completion tokens equal the Hugging Face model's own forward on each sample alone."""
    mine, ref = models(qwen_dir)
    batch, seqs, pixels = three_samples(qwen_dir)
    longest = max(len(s) for s in seqs)
    micro = pack(batch, sequence_len=256 if packed else longest, rows_per_micro_batch=3)
    assert len(micro) == 1 and micro[0].input_ids.shape[0] == (1 if packed else 3)
    attach_images(mine, batch, micro, str(qwen_dir), "tiny-qwen-vl")
    (mb,) = micro
    with torch.no_grad():
        got = forward_logprobs(mine, mb.input_ids, mb.position_ids, 0.7, chunk_size=chunk, loss_mask=mb.loss_mask,
                               images=mb.images)
        want = [reference_logprobs(ref, ids, px, 0.7) for ids, px in zip(seqs, pixels, strict=True)]
        assert got.dtype == (torch.float32 if chunk == 0 else torch.float64)
        assert per_sample_check(mb, got, want, F32_OUT if chunk == 0 else F64) == 3
        # M-RoPE matters here: plain positions (the text rule everywhere) give other logprobs
        mb.images.mrope = None
        plain = forward_logprobs(mine, mb.input_ids, mb.position_ids, 0.7, chunk_size=chunk,
                                 loss_mask=mb.loss_mask, images=mb.images)
    assert (plain - got).abs().max() > 1e-4


def test_mrope_positions_are_each_samples_own(qwen_dir):
    """The packed row's M-RoPE positions are, per sample, the model's `get_rope_index` of that sample alone
    (restarting at 0, text after an image continuing from its grid), and padding keeps its plain run."""
    mine, _ = models(qwen_dir)
    batch, seqs, pixels = three_samples(qwen_dir, seed=3)
    micro = pack(batch, sequence_len=max(len(s) for s in seqs), rows_per_micro_batch=3)
    attach_images(mine, batch, micro, str(qwen_dir), "tiny-qwen-vl")
    (mb,) = micro
    pos = mb.images.mrope
    for i, (ids, px) in enumerate(zip(seqs, pixels, strict=True)):
        t = torch.tensor([ids])
        want, _ = mine.model.get_rope_index(t, mm_token_type_ids=(t == IMAGE_TOKEN_ID).int(),
                                            image_grid_thw=px.get("image_grid_thw"))
        r = int((mb.seq_ids == i).any(1).nonzero()[0])
        assert torch.equal(pos[:, r, mb.seq_ids[r] == i], want[:, 0])
        if px:
            assert not torch.equal(want[0, 0], want[1, 0]), "images give 3-D positions"
    pad = mb.seq_ids < 0
    assert pad.any() and torch.equal(pos[:, pad], mb.position_ids[pad].expand(3, -1))


def test_positions_refuse_images_that_do_not_match_the_placeholders(qwen_dir):
    mine, _ = models(qwen_dir)
    ids = torch.tensor([1, VISION_START, *[IMAGE_TOKEN_ID] * 4, VISION_END, 5])
    with pytest.raises(ValueError, match=r"placeholder runs have \[4\] tokens but its 1 image\(s\) give \[6\]"):
        sample_positions(mine, ids, ids == IMAGE_TOKEN_ID, [torch.tensor([[1, 4, 6]])])


def test_full_fine_tuning_gradients_equal_the_models_own(qwen_dir):
    """Every weight, the vision tower's included: the gradient of the packed row's summed completion logprobs
    equals the sum over samples of the Hugging Face forward's, in float64."""
    mine, ref = models(qwen_dir)
    batch, seqs, pixels = three_samples(qwen_dir, seed=5)
    micro = pack(batch, sequence_len=256, rows_per_micro_batch=1)
    attach_images(mine, batch, micro, str(qwen_dir), "tiny-qwen-vl")
    (mb,) = micro
    lp = forward_logprobs(mine, mb.input_ids, mb.position_ids, 1.0, chunk_size=4, loss_mask=mb.loss_mask,
                          images=mb.images)
    (lp * mb.loss_mask).sum().backward()
    for i, (ids, px) in enumerate(zip(seqs, pixels, strict=True)):
        n = int((mb.loss_mask & (mb.seq_ids == i)).sum())
        reference_logprobs(ref, ids, px, 1.0)[-n:].sum().backward()
    theirs = dict(ref.named_parameters())
    vision = 0
    for name, p in mine.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-8, atol=1e-10, msg=name)
        vision += ".visual." in name and bool(p.grad.abs().sum() > 0)
    assert vision > 10, "the vision tower is trained too"


def test_lora_goes_on_the_language_model_only(qwen_dir):
    """LoRA (train defaults, all-linear): adapters on the language model, none in the vision tower; with random
    adapter weights the trainer's logprobs equal the PEFT model's own forward per sample (float64)."""
    model, _ = load_policy(TrainConfig(model=str(qwen_dir), device="cpu"))
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n and ".language_model." in n for n in lora), lora[:5]
    assert any("q_proj" in n for n in lora) and any("down_proj" in n for n in lora)
    assert not any("visual" in n for n, _ in model.named_modules() if n.endswith(".lora_A"))
    model = model.double().eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    batch, seqs, pixels = three_samples(qwen_dir, seed=7)
    micro = pack(batch, sequence_len=256, rows_per_micro_batch=1)
    attach_images(model, batch, micro, str(qwen_dir), "tiny-qwen-vl")
    (mb,) = micro
    with torch.no_grad():
        got = forward_logprobs(model, mb.input_ids, mb.position_ids, 1.0, chunk_size=4, loss_mask=mb.loss_mask,
                               images=mb.images)
        want = [reference_logprobs(model, ids, px, 1.0) for ids, px in zip(seqs, pixels, strict=True)]
    assert per_sample_check(mb, got, want) == 3


def test_a_text_batch_keeps_samples_apart(qwen_dir):
    """A batch without images on a Qwen-VL model: packed rows still restart per sample (the text positions row
    is what the model's mask is built from), equal to each sample's own forward."""
    mine, ref = models(qwen_dir)
    batch, seqs, _ = qwen_batch(qwen_dir, [[], [], []], seed=9)
    assert not batch.has_images
    (mb,) = pack(batch, sequence_len=256, rows_per_micro_batch=1)
    with torch.no_grad():
        got = forward_logprobs(mine, mb.input_ids, mb.position_ids, 1.0, chunk_size=4, loss_mask=mb.loss_mask)
        want = [reference_logprobs(ref, ids, {}, 1.0) for ids in seqs]
    assert per_sample_check(mb, got, want) == 3


# --- the inference side: vLLM's Qwen-VL code imports torchvision ----------------------------------------------------

def test_tidal_grpo_exits_2_where_torchvision_does_not_import(qwen_dir, monkeypatch, capsys):
    """Where torchvision does not import (this CPU machine: not installed; a CUDA wheel next to a CPU torch: its
    import fails), `tidal grpo --dry-run` on a Qwen-VL model exits 2 before anything starts, saying why and what to
    install; where it imports, the run's checks pass (the trainer takes the model)."""
    from tidal.cli import main
    from tidal.inference.backends.vllm import support

    monkeypatch.setattr(support, "torchvision_problem", lambda: "torchvision is not installed")
    run = ["grpo", "--dry-run", "--model", str(qwen_dir), "--output-dir", str(qwen_dir.parent / "run")]
    assert main(run) == 2
    out, err = capsys.readouterr()
    assert re.search(r"infer model '.*' is a Qwen(2_5_VL|3VL)ForConditionalGeneration: vLLM .*'s model code for it "
                     r"imports torchvision, and here torchvision is not installed.*pip install torchvision", err), err
    assert "# --- train ---" not in out and not (qwen_dir.parent / "run").exists()
    # `tidal grpo-infer` alone refuses the same way before it execs vLLM (which must not happen here)
    from tidal.inference.backends.vllm import server

    monkeypatch.setattr(server, "exec_server", lambda cfg: pytest.fail("grpo-infer went on to start vLLM"))
    assert main(["grpo-infer", "--model", str(qwen_dir)]) == 2
    assert "imports torchvision, and here torchvision is not installed" in capsys.readouterr().err
    monkeypatch.setattr(support, "torchvision_problem", lambda: None)
    assert main(run) == 0, capsys.readouterr().err[-2000:]
    assert "# --- train ---" in capsys.readouterr().out


def test_the_torchvision_probe_names_what_goes_wrong(monkeypatch):
    """The real probe on this machine, and the refusal's words for a CPU torch; other architectures are not
    probed."""
    from tidal.inference.backends.vllm import support

    problem = support.torchvision_problem()
    assert problem is None or "torchvision" in problem
    monkeypatch.setattr(support, "torchvision_problem", lambda: "`import torchvision` fails: RuntimeError: operator "
                                                                "torchvision::nms does not exist")
    monkeypatch.setattr(support.importlib.metadata, "version", lambda dist: "2.13.0+cpu")
    with pytest.raises(ConfigError, match=r"torchvision::nms does not exist.*matches torch 2\.13\.0\+cpu: pip "
                                          r"install torchvision --index-url https://download.pytorch.org/whl/cpu"):
        support.check_vision_imports("Qwen3VLForConditionalGeneration", "m")
    support.check_vision_imports("Idefics3ForConditionalGeneration", "m")  # vLLM's Idefics3 code needs none


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_sft_loss_keeps_packed_samples_apart(qwen_dir, smoothing):
    """`tidal sft` of text on a Qwen-VL model: the packed loss equals the sum of each sample's own (float64)."""
    from tidal.trainer.sft import sft_loss

    mine, ref = models(qwen_dir)
    batch, seqs, _ = qwen_batch(qwen_dir, [[], [], []], seed=11)
    (mb,) = pack(batch, sequence_len=256, rows_per_micro_batch=1)
    with torch.no_grad():
        got = sft_loss(mine, mb, smoothing, chunk_size=4)
        want = 0.0
        for i, ids in enumerate(seqs):
            t = torch.tensor([ids])
            logp = torch.log_softmax(ref(input_ids=t, use_cache=False).logits[0, :-1], -1)  # (L-1, V)
            per = (1 - smoothing) * -logp.gather(-1, t[0, 1:, None])[:, 0] + smoothing * -logp.mean(-1)
            n = int((mb.loss_mask & (mb.seq_ids == i)).sum())
            want += float(per[-n:].sum())
    assert abs(float(got) - want) < 1e-8 * abs(want)


def test_a_sampled_image_token_is_a_text_token(qwen_dir):
    """A completion that samples the image token: embedded as a plain token (as vLLM does) and positioned as text
    (all three M-RoPE streams equal, continuing the prompt's), only the prompt's placeholders carry image features."""
    from tidal.trainer.model.vision import embed

    mine, _ = models(qwen_dir)
    batch, seqs, _ = qwen_batch(qwen_dir, [[picture(1, (40, 32))]], seed=13)
    batch.tokens[-2] = IMAGE_TOKEN_ID  # in the completion (loss tokens), not the prompt
    (mb,) = pack(batch, sequence_len=256, rows_per_micro_batch=1)
    attach_images(mine, batch, [mb], str(qwen_dir), "tiny-qwen-vl")
    sampled = (mb.input_ids[0] == IMAGE_TOKEN_ID) & ~mb.prompt_mask[0]
    assert int(sampled.sum()) == 1 and int(mb.images.mask.sum()) == 4
    pos = mb.images.mrope[:, 0]  # (3, T)
    done = ~mb.prompt_mask[0] & (mb.seq_ids[0] >= 0)
    assert torch.equal(pos[0, done], pos[1, done]) and torch.equal(pos[0, done], pos[2, done])
    assert torch.equal(pos[0, done].diff(), torch.ones(int(done.sum()) - 1, dtype=pos.dtype))
    with torch.no_grad():
        emb = embed(mine, mb.input_ids, mb.images)
        assert torch.equal(emb[0, sampled][0], mine.get_input_embeddings().weight[IMAGE_TOKEN_ID])
        lp = forward_logprobs(mine, mb.input_ids, mb.position_ids, 1.0, loss_mask=mb.loss_mask, images=mb.images)
    assert torch.isfinite(lp).all()


def test_an_older_transformers_than_mrope_needs_exits_2_naming_the_version(qwen_dir, monkeypatch, capsys):
    """`sample_positions` calls `get_rope_index(input_ids, mm_token_type_ids=...)`, a signature transformers
    5.3.0 introduced (5.2.0 takes `(input_ids, image_grid_thw, ...)`): the installed one has it, and an older one
    stops the trainer's model loading with a config error (exit 2) naming the floor."""
    import inspect

    import transformers

    from tidal.trainer.model.hf import auto_model_class, load_model_config
    from tidal.trainer.model.mrope import TRANSFORMERS_FLOOR, check_transformers

    config = load_model_config(str(qwen_dir))
    model_cls = type(auto_model_class(config, str(qwen_dir)).from_config(config).model)
    assert "mm_token_type_ids" in inspect.signature(model_cls.get_rope_index).parameters
    check_transformers(config.model_type, TRANSFORMERS_FLOOR)
    with pytest.raises(ConfigError, match=r"needs transformers>=5\.3\.0 .*this environment has transformers 5\.2\.0"):
        check_transformers(config.model_type, "5.2.0")
    check_transformers("qwen3", "4.56.0")  # text models keep transformers' own floor
    monkeypatch.setattr(transformers, "__version__", "5.2.0")
    with pytest.raises(ConfigError, match=r"transformers>=5\.3\.0"):
        auto_model_class(config, str(qwen_dir))
    from tidal.cli import main

    run = ["grpo", "--dry-run", "--model", str(qwen_dir), "--output-dir", str(qwen_dir.parent / "run-old")]
    assert main(run) == 2
    assert "needs transformers>=5.3.0" in capsys.readouterr().err
