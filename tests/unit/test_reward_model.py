"""Reward models (`tidal.rewards.model`): a random-init tiny sequence classifier (the bundled model's architecture
and tokenizer, one label) scores completions as TRL does: prompt + completion, the chat template for
conversational samples, plain text for standard ones, its own tokenizer without added special tokens, batched
with right padding (the same scores as one at a time), first logit; loaded once; usable from GRPOTrainer and
from YAML (`tidal.rewards.model:reward_model`) through the scorer."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from tidal.config import OrchConfig
from tidal.envs import make_env
from tidal.inference.protocol import Completion
from tidal.models.sources import bundled
from tidal.orchestrator.scoring import Scorer
from tidal.rewards.model import RewardModel

CHAT = [{"role": "user", "content": "reverse: abc"}]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    src = Path(bundled("tidal:tiny-reverse"))
    out = tmp_path_factory.mktemp("tiny-rm")
    config = AutoConfig.from_pretrained(src, num_labels=1)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return str(out)


def direct_score(path: str, text: str) -> float:
    """One text alone, no padding: the reference."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        return float(model(**ids).logits[0, 0])


def test_scores_match_one_at_a_time_and_the_model_loads_once(classifier):
    rm = RewardModel(classifier, batch_size=2)
    prompts = ["Reverse: abc. Answer:"] * 3
    completions = [" cba", " a much longer completion than the others", " x"]
    scores = rm(prompts=prompts, completions=completions, completion_ids=[[1]] * 3, answer=["cba"] * 3)
    assert len(scores) == 3 and len(set(scores)) == 3
    for p, c, s in zip(prompts, completions, scores, strict=True):
        assert s == pytest.approx(direct_score(classifier, p + c), abs=1e-5)
    rm(prompts=prompts[:1], completions=completions[:1])
    assert rm.loads == 1 and rm.__name__ == Path(classifier).name


def test_conversational_samples_use_the_reward_models_chat_template(classifier):
    rm = RewardModel(classifier)
    completion = [{"role": "assistant", "content": "cba"}]
    tok, _ = rm.load()
    text = tok.apply_chat_template(CHAT + completion, tokenize=False)
    assert rm.texts([CHAT], [completion]) == [text] and "cba" in text and "reverse: abc" in text
    assert rm([CHAT], [completion])[0] == pytest.approx(direct_score(classifier, text), abs=1e-5)


def test_grpo_trainer_takes_a_model_directory_as_a_reward_function(classifier):
    from tidal.api.trainer import reward_functions

    (name, fn, weight), = reward_functions([classifier], None)
    assert isinstance(fn, RewardModel) and name == Path(classifier).name and weight == 1.0


def test_yaml_reward_funcs_reach_a_reward_model_through_the_scorer(classifier, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "Reverse: abc. Answer:"}) + "\n")
    env = make_env("dataset", {"path": str(data)})
    cfg = OrchConfig.model_validate({"reward_funcs": [{"import_path": "tidal.rewards.model:reward_model",
                                                       "kwargs": {"model": classifier, "batch_size": 1}}]})
    scorer = Scorer({"data": env}, cfg)
    comps = [Completion([1], [0.0], " cba", "stop"), Completion([2], [0.0], " x", "stop")]
    out = scorer.score(env.sample(random.Random(0)), comps, 1)
    assert scorer.names == ["reward_model"] and out.shape == (2, 1)
    assert out[0, 0] == pytest.approx(direct_score(classifier, "Reverse: abc. Answer: cba"), abs=1e-5)
