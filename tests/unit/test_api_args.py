"""GRPOTrainer's `processing_class`, `optimizers` and `use_cpu` as TRL 1.16 scripts pass them (issue 53): the ones
tidal can honour reach the run's configs, the others are refused with the reason."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tidal import GRPOConfig, GRPOTrainer
from tidal.api.args import optimizer_keys
from tidal.models.sources import resolve_model

MODEL = "tidal:tiny-reverse"
ROWS = [{"prompt": "abc"}, {"prompt": "de"}]


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def make(**kw):
    args = kw.pop("args", GRPOConfig(num_generations=2, per_device_train_batch_size=4))
    return GRPOTrainer(**{"model": MODEL, "reward_funcs": length, "args": args, "train_dataset": ROWS, **kw})


def test_an_optimizer_class_and_kwargs_reach_the_trainer_config():
    lr, b1, b2, wd = (round(random.uniform(lo, hi), 6) for lo, hi in ((1e-6, 1e-3), (0.5, 0.9), (0.9, 0.99),
                                                                        (0.0, 0.2)))
    eps = 10 ** random.uniform(-9, -5)  # AdamW's `eps` is GRPOConfig adam_epsilon (train `adam_epsilon`)
    t = make(optimizers=((torch.optim.AdamW, {"lr": lr, "betas": (b1, b2), "weight_decay": wd, "eps": eps}), None))
    train = t.derived.train
    assert (train.optimizer, train.learning_rate, train.adam_beta1, train.adam_beta2, train.weight_decay,
            train.adam_epsilon) == ("adamw", lr, b1, b2, wd, eps)
    assert t.args.adam_epsilon == eps
    assert t.args.optim == "adamw_torch" and t.args.learning_rate == lr
    plain = make(optimizers=(torch.optim.AdamW, None))  # the class alone: GRPOConfig's values stay
    assert plain.derived.train.learning_rate == GRPOConfig().learning_rate
    assert make().derived.train.optimizer == "adamw"  # TRL's default (None, None)


def test_optimizer_instances_other_classes_and_kwargs_are_refused():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(NotImplementedError, match="an optimizer instance holds this process's parameters"):
        optimizer_keys((opt, None))
    with pytest.raises(NotImplementedError, match="a scheduler instance"):
        optimizer_keys((None, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)))
    with pytest.raises(ValueError, match=r"tidal's trainer builds .* not torch.optim.sgd.SGD"):
        optimizer_keys((torch.optim.SGD, None))
    with pytest.raises(ValueError, match="keyword 'amsgrad' of AdamW is not supported"):
        optimizer_keys(((torch.optim.AdamW, {"amsgrad": True}), None))
    with pytest.raises(ValueError, match="adam_epsilon"):  # GRPOConfig's check (gt 0) names the key it maps to
        make(optimizers=((torch.optim.AdamW, {"eps": 0.0}), None))


def test_the_models_own_tokenizer_is_accepted_as_processing_class():
    tok = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    assert make(processing_class=tok).processing_class is tok


@pytest.mark.parametrize(("change", "match"), [
    (lambda t: t.add_tokens(["<tidal_extra>"]), "its vocabulary"),
    (lambda t: setattr(t, "chat_template", "{{ messages[0]['content'] }}"), "its chat_template differs"),
    (lambda t: None, "its eos_token differs"),
])
def test_a_processing_class_that_disagrees_with_the_model_is_refused(change, match):
    tok = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    if change(tok) is None and match.startswith("its eos"):
        tok.eos_token = tok.convert_ids_to_tokens(5)
    with pytest.raises(ValueError, match=rf"processing_class=...\) disagrees with model '{MODEL}': {match}"):
        make(processing_class=tok)


def test_use_cpu_is_accepted_where_the_run_is_on_the_cpu():
    t = make(args=GRPOConfig(num_generations=2, per_device_train_batch_size=4, use_cpu=True))
    assert t.colocated.placement.device == "cpu" and t.args.use_cpu


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> str:
    """A random-init one-label sequence classifier with the bundled model's config and tokenizer."""
    import shutil

    from transformers import AutoConfig, AutoModelForSequenceClassification

    src = Path(resolve_model(MODEL))
    out = tmp_path_factory.mktemp("tiny-rm")
    AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(src, num_labels=1)).save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return str(out)


def test_reward_processing_classes_one_per_function_as_in_trl(classifier):
    tok = AutoTokenizer.from_pretrained(classifier)
    t = make(reward_funcs=[length, classifier], reward_processing_classes=[None, tok])
    assert [n for n, _, _ in t.reward_funcs] == ["length", Path(classifier).name]
    with pytest.raises(ValueError, match="1 for 2 reward functions; TRL needs one per reward function"):
        make(reward_funcs=[length, classifier], reward_processing_classes=tok)
    with pytest.raises(ValueError, match=r"\[0\]=...\): reward function 'length' is not a reward model"):
        make(reward_funcs=[length, classifier], reward_processing_classes=[tok, None])
    tok.add_tokens(["<tidal_rm_extra>"])
    with pytest.raises(ValueError, match=rf"\[1\]=...\) disagrees with reward model '{classifier}': its vocabulary"):
        make(reward_funcs=[length, classifier], reward_processing_classes=[None, tok])
