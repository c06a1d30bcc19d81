"""The one vLLM server `tidal eval` samples from, and how each row's weights reach it.

- Started by tidal eval (no `address`): like `tidal grpo-infer` (`vllm_argv` / `vllm_env`: processed logprobs, the
  model's generation config ignored, on CPU the worker in the engine process and every core), as a `tidal.procs.Child`
  in its own process group, stopped at the end; a reaper (`tidal.procs.reaper`) kills it should tidal eval be killed.
- `lora` (`Served.lora`): vLLM starts with LoRA layers for the adapters' targets and rank, each adapter is loaded
  under its row's name, and every row is sampled at once (one start for N adapters).
- `merged`: vLLM starts without LoRA (on CPU it then compiles the model: its LoRA path is ~5x slower) and able to
  reload weights; each adapter is folded into the base weights (W + scale B A, `merged_state_dict`, the trainer's
  own merge) into a temporary safetensors file that vLLM reloads in place, one row after another; the base row
  goes first, on the weights vLLM loaded.
- `address`: a running server the user started; adapters are loaded into it by name (LoRA).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tidal.config.evaluate import EvalConfig
from tidal.config.infer import InferConfig, round_lora_rank
from tidal.config.load import ConfigError
from tidal.evaluate.targets import Target
from tidal.inference.protocol import InferenceClient
from tidal.procs import Child, NotHealthy, free_port, wait_healthy
from tidal.transport.probe import ProbeRecord, probe_ids, probe_length


def serve_mode(cfg: EvalConfig, cpu: bool) -> str:
    """`lora` or `merged` (EvalConfig `serve`; `auto`: merged where tidal eval starts vLLM on a CPU)."""
    if cfg.serve != "auto":
        return cfg.serve
    return "merged" if cpu and cfg.address is None else "lora"


def infer_config(cfg: EvalConfig, targets: list[Target], mode: str, port: int, seq_len: int) -> InferConfig:
    """The InferConfig of the server tidal eval starts for `targets`."""
    adapters = [t for t in targets if t.adapter is not None]
    lora = mode == "lora" and bool(adapters)
    extra: dict[str, Any] = {}
    if lora:
        rank = max(t.rank for t in adapters)
        extra = {"max_lora_rank": round_lora_rank(rank), "max_loras": len(adapters),
                 "lora_target_modules": sorted({m for t in adapters for m in t.modules})}
    return InferConfig(model=cfg.model, port=port, max_model_len=seq_len, dtype=cfg.dtype,
                       chat_template=cfg.chat_template, enable_lora=lora,
                       weight_reload=mode == "merged" and bool(adapters), log_stats=False, **extra)


class Server:
    """The vLLM server of one evaluation (started here, or the user's at `address`)."""

    def __init__(self, cfg: EvalConfig, targets: list[Target], cpu: bool, seq_len: int, log_path: Path) -> None:
        self.mode, self.cpu = serve_mode(cfg, cpu), cpu
        self.seq_len = seq_len  # vLLM's max_model_len: bounds the identity probe (`probe_length`)
        self.child: Child | None = None
        self.log_path = log_path
        self.merge_dir: Path | None = None
        self._base: Any = None  # the base model in this process, for merged rows (loaded on first use)
        self.cfg = cfg
        if cfg.address is not None:
            self.url = cfg.address.rstrip("/").removesuffix("/v1")
            self.infer = None
        else:
            self.infer = infer_config(cfg, targets, self.mode, cfg.port or free_port(), seq_len)
            self.url = f"http://127.0.0.1:{self.infer.port}"

    def start(self, timeout_s: float = 900.0) -> float:
        """Start vLLM (unless at `address`) and wait for /health; returns the seconds waited."""
        if self.infer is not None:
            from tidal.inference.backends.vllm.server import vllm_argv, vllm_env
            from tidal.procs import check_port_free

            check_port_free("127.0.0.1", self.infer.port)
            self.child = Child("vllm", vllm_argv(self.infer), log_path=self.log_path,
                               env=vllm_env(self.infer, every_core(self.cpu)))
        try:
            return wait_healthy(f"{self.url}/health", self.child, timeout_s, poll_s=0.5)
        except NotHealthy as exc:
            if self.child is not None and exc.code is not None:
                raise RuntimeError(f"vLLM exited with {exc.code} while starting:\n{self.child.tail(40)[-3000:]}"
                                   ) from None
            raise RuntimeError(f"vLLM at {self.url} not ready after {timeout_s:.0f} s (log: {self.log_path})"
                               ) from None

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop(20.0)
        if self.merge_dir is not None:
            shutil.rmtree(self.merge_dir, ignore_errors=True)

    def served_name(self, target: Target, index: int) -> str:
        """The model name a row's requests use: the served model, or its adapter's (`lora`) name."""
        if target.adapter is None or self.mode == "merged":
            return self.cfg.model
        return f"eval-{index}"

    async def load_lora(self, client: InferenceClient, targets: list[Target]) -> None:
        """`lora`: every adapter loaded under its row's name."""
        for i, t in enumerate(targets):
            if t.adapter is not None:
                await client.load_adapter(self.served_name(t, i), str(t.adapter))

    async def load_merged(self, client: InferenceClient, target: Target) -> None:
        """`merged`: `target`'s weights (the base model's for the base row) reloaded into vLLM in place."""
        from tidal.trainer.publish.broadcast import checkpoint_keys, merged_state_dict

        if self._base is None and target.adapter is None:
            return  # vLLM serves the weights it loaded: the base model
        from safetensors.torch import save_file

        from tidal.models.sources import resolve_model

        model_dir = resolve_model(self.cfg.model)
        model = self._model(model_dir)
        if target.adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(target.adapter))
        if self.merge_dir is None:
            self.merge_dir = Path(tempfile.mkdtemp(prefix="tidal-eval-merged-"))
        weights = merged_state_dict(model, checkpoint_keys(model_dir))
        save_file(weights, str(self.merge_dir / "model.safetensors"), metadata={"format": "pt"})
        if target.adapter is not None:
            self._base = model.unload()  # the base model again, for the next row
        await client.reload_weights(str(self.merge_dir))

    def probe(self, target: Target) -> ProbeRecord:
        """The identity probe of `target`'s adapter: the `probe.json` a tidal trainer published beside it, else its
        logprobs (and the base's) computed here from the base model (`_model`, on the CPU) and the adapter."""
        assert target.adapter is not None
        record = ProbeRecord.read(Path(target.adapter))
        if record is not None:
            return record
        from peft import PeftModel

        from tidal.models.sources import resolve_model
        from tidal.trainer.model.load import load_tokenizer
        from tidal.trainer.publish.probe import compute_dtype, score, vocab_limit

        model_dir = resolve_model(self.cfg.model)
        base = self._model(model_dir)
        ids = probe_ids(vocab_limit(base, load_tokenizer(model_dir)), probe_length(self.seq_len, compute_dtype(base)))
        base_lps = score(base, ids)
        model = PeftModel.from_pretrained(base, str(target.adapter))
        try:
            return ProbeRecord(step=0, ids=ids, new=score(model, ids), dtype=compute_dtype(base), base=base_lps)
        finally:
            self._base = model.unload()

    def _model(self, model_dir: str) -> Any:
        if self._base is None:
            import torch

            from tidal.inference.precision import trainer_dtype
            from tidal.trainer.model.load import load_base_model

            dtype = self.cfg.dtype if self.cfg.dtype != "auto" else trainer_dtype("auto", "cpu" if self.cpu else "cuda")
            self._base = load_base_model(model_dir, torch.device("cpu"), getattr(torch, dtype)).eval()
        return self._base


def every_core(cpu: bool) -> dict[str, str]:
    """This process's environment, on CPU with vLLM's OpenMP threads on every core of its affinity (unless the
    user set VLLM_CPU_OMP_THREADS_BIND): tidal eval and vLLM take turns (merging vs sampling), as `tidal grpo`'s
    on-policy phases do; vLLM's own `auto` would keep a core free for a scheduler that has nothing to do here."""
    env = dict(os.environ)
    if cpu and OMP_BIND not in env and hasattr(os, "sched_getaffinity"):
        env[OMP_BIND] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return env


OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def check_address(cfg: EvalConfig) -> None:
    """`address` must look like a URL (the server is asked for /health before anything is sampled)."""
    if cfg.address is not None and not cfg.address.startswith(("http://", "https://")):
        raise ConfigError(f"address {cfg.address!r}: give the server's URL, e.g. http://127.0.0.1:8000")
