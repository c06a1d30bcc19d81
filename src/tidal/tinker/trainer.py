"""The training side of tidal's Tinker server: one base model, one PEFT LoRA adapter per Tinker training client.

The base model is loaded once (`tidal.trainer.model.load.load_base_model`: float32 on CPU, bfloat16 on a GPU, tidal's
attention) and every `create_model` adds a named adapter to it (PEFT's multi-adapter model); an operation first
makes its adapter the active one, so each training client has its own LoRA weights, gradients and AdamW state.
Everything here runs on one thread (`tidal.tinker.service` queues the operations), in the order the SDK sent
them.

- LoRA (`LoraSpec`, the SDK's `LoraConfig`): rank; which layers: `train_attn` the linear modules under an
  attention block, `train_mlp` those under an MLP / feed-forward / MoE block, `train_unembed` the output layer
  (lm_head); `lora_alpha` is 32 at every rank (Tinker: the best learning rate does not depend on the rank), A is
  initialized from `seed`, B at zero (step 0 is the base model). A layer group the model lacks, or an unembedding
  the sampler cannot serve, is refused (`TrainerError`).
- `forward_backward` / `forward`: the datums of a request are packed into rows of at most `micro_batch_tokens`
  tokens (restarting position ids; tidal's attention keeps the sequences apart), the final hidden states go
  through `tidal.trainer.step.logprobs.chunked_logprobs` (the lm_head a chunk at a time, float32), giving each datum's
  logprobs of its `target_tokens` ((N,) or (N, K): K candidates per position), then `tidal.tinker.losses`.
  Gradients accumulate over requests until `optim_step`, as Tinker's do.
- `optim_step`: torch AdamW (decoupled weight decay) with the request's `AdamParams` (learning rate, betas, eps,
  weight decay) and, when `grad_clip_norm` > 0, the global gradient norm clipped first; gradients are then reset.
- Checkpoints: `save_sampler` writes a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)
  that vLLM loads; `save_state` adds the AdamW moments and step (optimizer.safetensors) and tidal's record of the
  adapter (tidal_tinker.json). Tensors only, no pickle. Each is filled in a temp directory and renamed into place,
  `STABLE` last (`tidal.paths.atomic_dir`): a crash or a full disk leaves the previous checkpoint of that name.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tidal.paths import atomic_dir
from tidal.tinker.losses import LossError, check_request, datum_loss
from tidal.tinker.wire import Datum, FwdBwdRequest
from tidal.transport.probe import ProbeRecord, probe_ids

log = logging.getLogger("tidal.tinker")

LORA_ALPHA = 32
ATTN_BLOCKS = frozenset({"self_attn", "attn", "attention", "self_attention", "cross_attn", "mixer"})
MLP_BLOCKS = frozenset({"mlp", "feed_forward", "ffn", "block_sparse_moe", "experts", "shared_expert",
                        "shared_experts", "moe"})
STATE_FILE = "tidal_tinker.json"
OPTIM_FILE = "optimizer.safetensors"


class TrainerError(ValueError):
    """A request the trainer cannot honour (what, and what would be valid, in the message)."""


@dataclass(frozen=True)
class LoraSpec:
    """The SDK's `LoraConfig`."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class AdamStep:
    """The SDK's `AdamParams` for one `optim_step`."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class Adapter:
    """One training client's adapter: its PEFT name, LoRA spec, optimizer and step count."""

    name: str
    spec: LoraSpec
    targets: list[str]
    optimizer: torch.optim.AdamW | None = None
    steps: int = 0
    params: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    """Trainable parameters by their adapter state-dict key (the PEFT name without the adapter's name)."""
    probe: tuple[int, list[float]] | None = None
    """(steps, probe logprobs) of its last saved checkpoint: the previous policy of the next one's probe."""


def module_groups(model: Any) -> dict[str, set[str]]:
    """Leaf names of the model's linear modules by the block they sit in: `attn`, `mlp`, and `unembed` (the
    output layer's module name)."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    groups: dict[str, set[str]] = {"attn": set(), "mlp": set(), "unembed": set()}
    for name, module in model.named_modules():
        if module is output and output is not None:
            groups["unembed"].add(name.rsplit(".", 1)[-1])
        elif isinstance(module, torch.nn.Linear):
            parents = set(name.split(".")[:-1])
            if parents & ATTN_BLOCKS:
                groups["attn"].add(name.rsplit(".", 1)[-1])
            elif parents & MLP_BLOCKS:
                groups["mlp"].add(name.rsplit(".", 1)[-1])
    return groups


def lora_targets(groups: dict[str, set[str]], spec: LoraSpec, unembed_ok: bool) -> list[str]:
    """The module leaf names an adapter of `spec` adapts; `TrainerError` for what cannot be honoured."""
    if not (spec.train_mlp or spec.train_attn or spec.train_unembed):
        raise TrainerError("LoRA config trains no layer: set at least one of train_mlp, train_attn, train_unembed")
    wanted = {"attn": spec.train_attn, "mlp": spec.train_mlp, "unembed": spec.train_unembed}
    for group, want in wanted.items():
        if want and not groups[group]:
            raise TrainerError(f"LoRA config train_{group}=True, but this model has no {group} linear modules tidal "
                               f"can adapt; set train_{group}=False")
    if spec.train_unembed and not unembed_ok:
        raise TrainerError("LoRA config train_unembed=True: this server's sampler cannot serve an lm_head adapter "
                           "for this model (vLLM on a GPU with a tied head smaller than the hidden size, see "
                           "docs/tinker.md); create the training client with train_unembed=False")
    chosen = set().union(*(groups[g] for g, want in wanted.items() if want))
    clash = chosen & set().union(*(groups[g] for g, want in wanted.items() if not want))
    if clash:
        raise TrainerError(f"LoRA config: module name(s) {', '.join(sorted(clash))} occur in both the layers asked "
                           "for and those left out, so tidal cannot adapt one without the other; train both groups")
    return sorted(chosen)


def _micro_batches(data: list[Datum], budget: int) -> list[list[int]]:
    """Datum indices grouped into rows of at most `budget` tokens (a longer datum gets a row of its own; budget 0:
    every datum alone, for models with linear-attention layers, `tidal.models.families.packing_rule`)."""
    rows: list[list[int]] = []
    used = budget
    for i, d in enumerate(data):
        if used + len(d.tokens) > budget:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += len(d.tokens)
    return rows


def _check_datum(i: int, d: Datum, vocab: int) -> None:
    n = len(d.tokens)
    if n == 0:
        raise TrainerError(f"datum {i}: empty model_input")
    targets = d.inputs["target_tokens"]
    if targets.ndim not in (1, 2) or targets.shape[0] != n:
        raise TrainerError(f"datum {i}: target_tokens has shape {list(targets.shape)}; it must be (N,) or (N, K) "
                           f"with N = {n}, the model_input's length")
    for name, arr in d.inputs.items():
        if name != "target_tokens" and arr.shape not in (targets.shape, targets.shape[:1]):
            raise TrainerError(f"datum {i}: loss_fn_inputs {name!r} has shape {list(arr.shape)}; it must match "
                               f"target_tokens {list(targets.shape)}")
    for what, ids in (("model_input", np.asarray(d.tokens)), ("target_tokens", targets)):
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise TrainerError(f"datum {i}: {what} holds token ids outside the vocabulary [0, {vocab})")


class TrainerHost:
    """The base model with one LoRA adapter per Tinker training client (see the module doc)."""

    def __init__(self, model_path: str, device: torch.device, *, micro_batch_tokens: int = 8192,
                 unembed_ok: bool = True) -> None:
        from tidal.trainer.model.load import load_base_model, resolve_dtype

        self.model_path = model_path
        self.device = device
        self.base = load_base_model(model_path, device, resolve_dtype("bf16", device))
        self.vocab = int(self.base.get_output_embeddings().weight.shape[0])
        self.groups = module_groups(self.base)
        self.micro_batch_tokens = micro_batch_tokens
        self.unembed_ok = unembed_ok
        self.peft: Any = None
        self._base_probe: tuple[list[int], list[float]] | None = None  # (probe ids, the base's logprobs)
        self.adapters: dict[str, Adapter] = {}
        self._next = 0

    # --- adapters ------------------------------------------------------------------------------------------------

    def create(self, model_id: str, spec: LoraSpec) -> Adapter:
        """Add an adapter for `model_id` (A from `spec.seed`, B zero)."""
        from peft import LoraConfig, get_peft_model

        targets = lora_targets(self.groups, spec, self.unembed_ok)
        name = f"t{self._next}"
        self._next += 1
        config = LoraConfig(r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets,
                            bias="none", task_type="CAUSAL_LM")
        with (torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []),
              warnings.catch_warnings()):
            # PEFT warns that an lm_head adapter leaves the tied embedding alone: so does vLLM's lm_head LoRA
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            if spec.seed is not None:
                torch.manual_seed(spec.seed)
            if self.peft is None:
                self.peft = get_peft_model(self.base, config, adapter_name=name)
            else:
                self.peft.add_adapter(name, config)
        marker = f".{name}."
        params = {n.replace(marker, "."): p for n, p in self.peft.named_parameters() if marker in n}
        adapter = Adapter(name, spec, targets, params=params)
        self.adapters[model_id] = adapter
        log.info("model %s: LoRA rank %d on %s (%.2f M parameters)", model_id, spec.rank, ", ".join(targets),
                 sum(p.numel() for p in params.values()) / 1e6)
        return adapter

    def remove(self, model_id: str) -> None:
        adapter = self.adapters.pop(model_id, None)
        if adapter is not None and self.peft is not None:
            if self.adapters:
                self.peft.set_adapter(next(iter(self.adapters.values())).name)
            self.peft.delete_adapter(adapter.name)

    def _activate(self, model_id: str) -> Adapter:
        adapter = self.adapters.get(model_id)
        if adapter is None:
            held = ", ".join(self.adapters) or "none"
            raise TrainerError(f"unknown model_id {model_id!r} (this server holds {held})")
        if self.peft.active_adapter != adapter.name:
            self.peft.set_adapter(adapter.name)
        return adapter

    # --- forward / backward --------------------------------------------------------------------------------------

    def forward_backward(self, req: FwdBwdRequest) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Run `req` on its model's adapter: per-datum `logprobs` outputs and `loss:sum`; gradients accumulated
        unless `forward_only`."""
        self._activate(req.model_id)
        if not req.data:
            raise TrainerError("forward_backward with no data")
        try:
            for i, d in enumerate(req.data):
                check_request(req.loss_fn, set(d.inputs), req.config)
                _check_datum(i, d, self.vocab)
        except LossError as exc:
            raise TrainerError(str(exc)) from None
        outputs: list[dict[str, np.ndarray]] = [{} for _ in req.data]
        total = 0.0
        self.peft.train()
        from tidal.models.families import ONE_PER_ROW, packing_rule

        one_per_row = packing_rule(self.peft.config) == ONE_PER_ROW  # linear attention: no state crosses data
        for row in _micro_batches(req.data, 0 if one_per_row else self.micro_batch_tokens):
            with torch.set_grad_enabled(not req.forward_only):
                lps = self._row_logprobs([req.data[i] for i in row])
                loss = torch.zeros((), device=self.device)
                for i, lp in zip(row, lps, strict=True):
                    inputs = {k: torch.from_numpy(np.asarray(v)).to(self.device) for k, v in req.data[i].inputs.items()}
                    loss = loss + datum_loss(req.loss_fn, lp, inputs, req.config)
                    outputs[i]["logprobs"] = lp.detach().float().cpu().numpy()
            if not req.forward_only and loss.requires_grad:
                loss.backward()
            total += float(loss.detach())
        if not math.isfinite(total):
            log.warning("model %s: loss:sum is %s", req.model_id, total)
        return outputs, {"loss:sum": total}

    def _row_logprobs(self, data: list[Datum]) -> list[torch.Tensor]:
        """The target logprobs ((N,) or (N, K)) of each datum of one packed row."""
        from tidal.trainer.step.logprobs import chunked_logprobs, final_hidden, split_head

        ids = torch.tensor([t for d in data for t in d.tokens], device=self.device)[None]  # (1, T)
        pos = torch.cat([torch.arange(len(d.tokens), device=self.device) for d in data])[None]  # (1, T)
        head = split_head(self.peft)
        if head is None:  # an architecture whose logits tidal does not compute in chunks: full logits
            logits = self.peft(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()  # (T, V)
            all_lp = torch.log_softmax(logits, dim=-1)
        else:
            hidden = final_hidden(self.peft, head, ids, pos)[0]  # (T, H)
        out, flat_h, flat_t, shapes, start = [], [], [], [], 0
        for d in data:
            n = len(d.tokens)
            targets = torch.from_numpy(np.asarray(d.inputs["target_tokens"], dtype=np.int64)).to(self.device)
            k = 1 if targets.ndim == 1 else targets.shape[1]
            if head is None:
                out.append(all_lp[start:start + n].gather(-1, targets.view(n, k)).view(targets.shape))
            else:
                flat_h.append(hidden[start:start + n].repeat_interleave(k, dim=0))  # (N*K, H)
                flat_t.append(targets.reshape(-1))
                shapes.append(targets.shape)
            start += n
        if head is None:
            return out
        lp, _ = chunked_logprobs(torch.cat(flat_h), torch.cat(flat_t), head)  # (sum N*K,)
        sizes = [int(np.prod(s)) for s in shapes]
        return [part.view(s) for part, s in zip(lp.split(sizes), shapes, strict=True)]

    # --- optimizer -----------------------------------------------------------------------------------------------

    def optim_step(self, model_id: str, step: AdamStep) -> dict[str, float]:
        """One AdamW step of `model_id`'s adapter with `step`'s hyperparameters; gradients are reset after."""
        adapter = self._activate(model_id)
        params = list(adapter.params.values())
        if adapter.optimizer is None:
            adapter.optimizer = torch.optim.AdamW(params, lr=step.learning_rate)
        for group in adapter.optimizer.param_groups:
            group.update(lr=step.learning_rate, betas=(step.beta1, step.beta2), eps=step.eps,
                         weight_decay=step.weight_decay)
        grads = [p for p in params if p.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(grads, step.grad_clip_norm if step.grad_clip_norm > 0
                                                    else math.inf)) if grads else 0.0
        adapter.optimizer.step()
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.steps += 1
        return {"grad_norm:mean": norm, "learning_rate:mean": step.learning_rate}

    # --- checkpoints ---------------------------------------------------------------------------------------------

    def _state_dict(self, adapter: Adapter) -> dict[str, torch.Tensor]:
        return {k: p.detach().cpu().contiguous() for k, p in adapter.params.items()}

    def _write_adapter(self, adapter: Adapter, directory: Path) -> None:
        """adapter_config.json, adapter_model.safetensors and the policy identity probe (`probe.json`,
        `tidal.transport.probe`: this adapter's, its previous checkpoint's and the base's logprobs of the probe)
        of the active `adapter` into `directory`."""
        from safetensors.torch import save_file

        self.peft.peft_config[adapter.name].save_pretrained(str(directory))
        save_file(self._state_dict(adapter), str(directory / "adapter_model.safetensors"))
        self._probe(adapter).write(directory)

    def _probe(self, adapter: Adapter) -> ProbeRecord:
        from tidal.trainer.model.load import load_tokenizer
        from tidal.trainer.publish.probe import compute_dtype, score, vocab_limit

        if self._base_probe is None:
            ids = probe_ids(vocab_limit(self.base, load_tokenizer(self.model_path)))
            with self.peft.disable_adapter():
                self._base_probe = (ids, score(self.peft, ids))
        ids, base = self._base_probe
        new = score(self.peft, ids)
        prev = adapter.probe
        adapter.probe = (adapter.steps, new)
        return ProbeRecord(step=adapter.steps, ids=ids, new=new, dtype=compute_dtype(self.base),
                           previous=None if prev is None else prev[1], previous_step=None if prev is None else prev[0],
                           base=base)

    def save_sampler(self, model_id: str, path: Path) -> None:
        """A PEFT adapter directory vLLM loads: adapter_config.json and adapter_model.safetensors, written
        atomically (`tidal.paths.atomic_dir`: a temp directory renamed to `path`, `STABLE` last)."""
        adapter = self._activate(model_id)
        with atomic_dir(path) as tmp:
            self._write_adapter(adapter, tmp)

    def save_state(self, model_id: str, path: Path, base_model: str) -> None:
        """`save_sampler` plus the AdamW state (optimizer.safetensors) and tidal's record (tidal_tinker.json), in one
        atomic directory (`STABLE` last)."""
        from safetensors.torch import save_file

        adapter = self._activate(model_id)
        moments: dict[str, torch.Tensor] = {}
        if adapter.optimizer is not None:
            by_param = {id(p): k for k, p in adapter.params.items()}
            for p, st in adapter.optimizer.state.items():
                key = by_param[id(p)]
                for slot in ("exp_avg", "exp_avg_sq", "step"):
                    if slot in st:
                        t = torch.as_tensor(st[slot]).detach().cpu()
                        moments[f"{key}::{slot}"] = t.reshape(1) if slot == "step" else t.contiguous()
        record = {"base_model": base_model, "lora": asdict(adapter.spec), "steps": adapter.steps}
        with atomic_dir(path) as tmp:
            self._write_adapter(adapter, tmp)
            save_file(moments, str(tmp / OPTIM_FILE))
            (tmp / STATE_FILE).write_text(json.dumps(record, indent=1))

    @staticmethod
    def read_record(path: Path) -> dict[str, Any]:
        """tidal's record of a `save_state` checkpoint; `TrainerError` when `path` holds none."""
        file = path / STATE_FILE
        if not file.is_file():
            raise TrainerError(f"{path} is not a training-state checkpoint of this server (no {STATE_FILE}); "
                               "load_weights takes the path save_weights (save_state) returned")
        record: dict[str, Any] = json.loads(file.read_text())
        return record

    def load_state(self, model_id: str, path: Path, optimizer: bool) -> None:
        """Load `path` (a `save_state` checkpoint) into `model_id`'s adapter, and its AdamW state when
        `optimizer` (else the optimizer starts afresh)."""
        from safetensors.torch import load_file

        adapter = self._activate(model_id)
        record = self.read_record(path)
        if LoraSpec(**record["lora"]).rank != adapter.spec.rank:
            raise TrainerError(f"checkpoint {path} has LoRA rank {record['lora']['rank']}, model {model_id} "
                               f"rank {adapter.spec.rank}")
        weights = load_file(str(path / "adapter_model.safetensors"))
        if set(weights) != set(adapter.params):
            raise TrainerError(f"checkpoint {path} adapts other modules than model {model_id} "
                               f"({sorted(set(weights) ^ set(adapter.params))[:4]} ...)")
        with torch.no_grad():
            for k, p in adapter.params.items():
                p.copy_(weights[k].to(p.dtype))
                p.grad = None
        adapter.optimizer, adapter.steps = None, int(record.get("steps", 0))
        if not optimizer:
            return
        moments = load_file(str(path / OPTIM_FILE))
        adapter.optimizer = torch.optim.AdamW(list(adapter.params.values()))
        for k, p in adapter.params.items():
            if f"{k}::exp_avg" in moments:
                adapter.optimizer.state[p] = {
                    "step": moments[f"{k}::step"].reshape(()).to(torch.float32),
                    "exp_avg": moments[f"{k}::exp_avg"].to(p.device, p.dtype),
                    "exp_avg_sq": moments[f"{k}::exp_avg_sq"].to(p.device, p.dtype)}
