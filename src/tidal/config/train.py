"""Trainer config (`train.yaml`): the seed's SFT-inherited keys plus the GRPO `loss` section.

Precision (`recipe`): `auto` (the default) is bfloat16 on GPU; on CPU bf16 where the CPU has bfloat16 units
(AVX512-BF16 or AMX), else float32 (`tidal.inference.precision.resolve_recipe`; `tidal grpo` serves vLLM in the
same precision). `bf16` on CPU keeps float32 weights and multiplies in bfloat16 (autocast); `fp32` keeps both sides
in float32, where trainer and inference logprobs agree to ~1e-6.
`fp8-hybrid` keeps those weights and runs the base model's linear matmuls in FP8 (real FP8 GEMMs on SM89+ GPUs,
an emulation with the same casts and scales elsewhere, CPU included; `tidal.trainer.model.precision`). `nvfp4` and
`qlora_fp4` need Blackwell FP4 matmuls and are refused. QLoRA bases (`qlora_bnb` NF4, `qlora_fp8` FP8) are
`tidal.trainer.model.quant`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tidal.config.base import StrictModel
from tidal.config.chat_template import check_chat_template
from tidal.config.loss import LossConfig
from tidal.config.orch import check_chat_template_kwargs

DEFAULT_LOGPROB_CHUNK_SIZE = 256
NVFP4_REFUSED = ("needs NVFP4 matmuls, which only NVIDIA Blackwell GPUs (SM100+) have; tidal does not implement "
                 "it (there was no Blackwell GPU to verify it on)")


QERL_KEYS = ("sigma_start", "sigma_end", "num_stages")


class NoiseSchedulerConfig(StrictModel):
    """QeRL noisy RMSNorm weights in the inference model during rollouts (`tidal.trainer.model.noise`); the trainer
    keeps the clean weights. The noise reaches vLLM inside the merged weights of each policy (merged reloads:
    `tidal grpo` on CPU, or orch `weight_broadcast.reload: merged`) or with the NCCL push (`weight_broadcast.type:
    nccl`: every RMSNorm weight pushed beside the merged LoRA weights); the LoRA-adapter path cannot carry it."""

    enabled: bool = False
    """Add N(0, sigma^2) to every RMSNorm weight of each policy vLLM samples with (metric `qerl/sigma`)."""
    sigma_start: float = Field(5e-2, gt=0)
    """Noise standard deviation of the second interval (the first has none)."""
    sigma_end: float = Field(5e-4, gt=0)
    """Noise standard deviation of the last interval (geometric decay in between)."""
    num_stages: int = Field(10, ge=1)
    """Number of equal intervals the run is cut into."""

    @model_validator(mode="before")
    @classmethod
    def _numbers_as_numbers(cls, data: Any) -> Any:
        """YAML reads `5e-2` as a string: compare the schedule keys as numbers."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for key in QERL_KEYS:
            if isinstance(out.get(key), str):
                try:
                    out[key] = float(out[key])
                except ValueError:
                    pass  # rejected by its type
        return out

    @model_validator(mode="after")
    def _schedule_needs_enabled(self) -> NoiseSchedulerConfig:
        changed = [k for k in QERL_KEYS if getattr(self, k) != type(self).model_fields[k].default]
        if changed and not self.enabled:
            raise ValueError(f"noise_scheduler.{changed[0]} only applies with noise_scheduler.enabled: true")
        return self


class MismatchGuardConfig(StrictModel):
    """Watch trainer/inference drift: warn (or stop) when it stays high for `patience` steps in a row."""

    enabled: bool = True
    """Check the two drift metrics after every step."""
    max_mismatch_kl: float = Field(1e-2, gt=0)
    """Threshold on `mismatch_kl` (k3 estimate of KL(inference || trainer) per token)."""
    max_token_mult_prob_error: float = Field(1.05, gt=1)
    """Threshold on `token_mult_prob_error` (mean of exp|trainer - inference logprob|; 1 = identical)."""
    patience: int = Field(1, ge=1)
    """Consecutive judged steps above a threshold before acting."""
    scope: Literal["on_policy", "all"] = "on_policy"
    """Which steps are judged. `on_policy`: only steps whose rollouts came from the trainer's current policy
    (step 1 always; every step with max_async_level 0), where the gap is purely numerical. `all`: every step,
    though on off-policy steps the gap also holds the policy's own movement (raise thresholds/patience)."""
    action: Literal["warn", "stop"] = "warn"
    """`warn`: log the likely causes (once per episode); `stop`: also end the trainer with exit code 1."""


class TrainWeightBroadcast(StrictModel):
    """How the trainer hands new policies to inference (orch `weight_broadcast`; `tidal grpo` copies it)."""

    type: Literal["filesystem", "nccl"] = "filesystem"
    """`filesystem`: write `broadcasts/step_n/` for the orchestrator to load. `nccl`: also push the merged weights
    into the vLLM servers at `base_url` through vLLM's weight-transfer engine (NCCL on GPUs, gloo on CPU)
    before `broadcasts/step_n/STABLE` appears; the servers need `weight_broadcast_type: nccl`."""
    host: str = "localhost"
    """(nccl) Address the trainer opens the rendezvous on (rank 0); the inference workers connect to it."""
    port: int = Field(29501, ge=1, le=65535)
    """(nccl) Rendezvous port."""
    timeout: float = Field(1200, gt=0)
    """(nccl) Seconds a push may take (pause, transfer, reload) before it counts as failed."""
    base_url: list[str] = Field(default_factory=lambda: ["http://localhost:8000/v1"])
    """(nccl) The vLLM servers to push into (orch `client.base_url`)."""
    api_key_var: str = "VLLM_API_KEY"
    """(nccl) Environment variable holding the servers' API key (orch `client.api_key_var`)."""
    backend: Literal["vllm", "sglang"] = "vllm"
    """(nccl) The servers' engine (infer `backend`; `tidal grpo` copies it): vLLM's weight-transfer routes, or
    SGLang's `/init_weights_update_group` + `/update_weights_from_distributed` (`tidal.trainer.publish.push_sglang`)."""


class TrainCkptSection(StrictModel):
    """Trainer checkpoints (`{run_dir}/checkpoints/trainer/step_n/`): adapter, optimizer, LR scheduler, RNG
    states and step, for exact resume (docs/resume.md). Same keys as the orchestrator's `ckpt`."""

    interval: int | None = Field(None, ge=1)
    """Save a checkpoint every N steps (and after the last step); null: never."""
    resume_step: int | None = Field(None, ge=-1)
    """Step to resume from (-1: the newest complete checkpoint, or a fresh start when the run directory has
    none); null: a new run. `--resume` on the command line sets -1."""
    keep_last: int | None = Field(None, ge=1)
    """Keep at most N recent checkpoints (null: keep all)."""
    keep_interval: int | None = Field(None, ge=1)
    """Also keep every checkpoint whose step is a multiple of N, whatever `keep_last` says."""


class ExportSection(StrictModel):
    """What the trainer leaves in `{run_dir}/final/` at the end of a run (Hugging Face formats)."""

    adapter: bool = True
    """Write the final LoRA adapter (`final/adapter/`: PEFT `adapter_config.json` + `adapter_model.safetensors`,
    loadable by PEFT and by vLLM's `--lora-modules`)."""
    merged: bool = False
    """Also write the merged full model (`final/merged/`: config, safetensors weights, tokenizer), loadable by
    `AutoModelForCausalLM.from_pretrained` and servable by vLLM as a plain model."""
    gguf: Literal["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"] | None = None
    """Also write the final model (a LoRA policy merged into its base) as one GGUF file for llama.cpp, Ollama and LM
    Studio, `final/gguf/model-{type}.gguf`, written after the adapter / merged model (a failure there costs the run
    nothing else: one error line says how to export again with `tidal export`, and the run exits 3, not 0). Norms
    and biases stay float32; matrices:
    - `f32`: float32 (the trained weights exactly; 4 bytes per weight);
    - `f16`: float16 (2 bytes per weight; what llama.cpp's converter writes by default);
    - `bf16`: bfloat16 (2 bytes; float32's range, 8 bits of mantissa);
    - `q8_0`: 8-bit blocks of 32 with one float16 scale (~1.06 bytes per weight; close to f16 in quality);
    - `q5_1` / `q5_0`: 5-bit blocks of 32 with a scale and (q5_1) a minimum (~0.75 / 0.69 bytes per weight);
    - `q4_1` / `q4_0`: 4-bit blocks of 32 with a scale and (q4_1) a minimum (~0.63 / 0.56 bytes per weight; the
      smallest, at a measurable accuracy cost: docs/real-model.md).
    In the 4/5-bit types the embedding/output matrix is q8_0. null: no GGUF. Llama, Mistral, Qwen2, Qwen3, Qwen3.5
    (dense and MoE) and Gemma 1-4 text models (docs/models.md's "GGUF out" column) with a byte-level BPE tokenizer whose
    pre-tokenizer llama.cpp knows, or Gemma's SentencePiece-style one, and RoPE llama.cpp reads
    (`tidal.trainer.publish.gguf_out`); anything else, and a missing `gguf` package, exits 2 before training."""


DEFAULT_SFT_STEPS = 100
"""`tidal sft`'s steps when neither `sft.max_steps` nor a positive train `max_steps` says (the bundled train.yaml)."""


class SftSection(StrictModel):
    """`tidal sft`: supervised warm start on an environment's reference completions."""

    env: str = "reverse-text"
    """Environment id whose `reference_completion`s are the targets."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """Arguments of that environment."""
    examples_per_step: int = Field(32, ge=1)
    """Examples per optimizer step."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps of `tidal sft`. Null: train `max_steps` when it is > 0, else `DEFAULT_SFT_STEPS` (100): the
    GRPO trainer's `max_steps: -1` ("until the orchestrator is done", as in the bundled train.yaml) means nothing to
    SFT, so `tidal sft train.yaml` runs 100 steps. Set this to give one train.yaml different GRPO and SFT lengths."""
    save_to: str | None = None
    """Where to save the result (null: `{output_dir}/sft`). Full weights when `lora: false`, else the adapter."""
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    """Label smoothing of the SFT targets: loss = (1 - e) * NLL + e * mean over the vocabulary of -log p."""
    save_every: int | None = Field(None, ge=1)
    """Also save a snapshot to `{save_to}/step_{n}` every N steps (null: only the final result)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template that renders the SFT prompts (e.g. `{enable_thinking: false}` for
    Qwen3). The trainer side's twin of orch `client.chat_template_kwargs`, which renders the GRPO prompts: give
    both the same value so the model is warm-started on the prompt format it is then trained on."""

    _template_kwargs = field_validator("chat_template_kwargs")(check_chat_template_kwargs)

    def steps(self, train_max_steps: int) -> int:
        """The steps `tidal sft` runs (see `max_steps`)."""
        if self.max_steps is not None:
            return self.max_steps
        return train_max_steps if train_max_steps > 0 else DEFAULT_SFT_STEPS


class TrainConfig(StrictModel):
    """Everything `tidal grpo-train` and `tidal sft` read from `train.yaml`."""

    REFUSED = {"qlora_fp4": NVFP4_REFUSED}

    model: str
    """Local Hugging Face model directory to train, or `tidal:tiny-reverse` (the bundled model)."""
    output_dir: str = "outputs"
    """Run directory shared with the orchestrator, or a parent holding exactly one `run_*` run directory."""
    gpus: int = Field(1, ge=1)
    """Trainer ranks on this node (data parallel, torch.distributed + FSDP2; one per GPU, or CPU ranks over gloo
    on a machine without GPUs). `tidal grpo-train` starts them itself; under `torchrun` (multi-node) it must
    equal `--nproc-per-node`. The orchestrator sees one trainer either way (docs/scale-out.md)."""
    zero_level: Literal[1, 2, 3] = 1
    """How much FSDP2 shards across ranks (gpus > 1): 1 = gradients accumulate unsharded over a step's
    micro-batches and are reduce-scattered once per optimizer step (least communication); 2 = gradients are
    reduce-scattered after every micro-batch; 3 = also free the gathered parameters after each layer's forward
    and gather them again for its backward (least memory). Optimizer state and parameters at rest are sharded
    at every level."""
    device: str = "auto"
    """Where to train: `auto` (CUDA when available, else CPU), `cpu`, `cuda` (the first visible GPU) or `cuda:N`
    (GPU N among those `CUDA_VISIBLE_DEVICES` lets the process see), e.g. to keep the trainer off vLLM's GPU."""
    malloc: Literal["auto", "tcmalloc", "system"] = "auto"
    """The trainer process's memory allocator (`tidal.procs.malloc`; the process executes itself once more with it
    preloaded, before importing torch). `tcmalloc`: gperftools' libtcmalloc_minimal (exit 2 where it is not found;
    `make setup` unpacks Debian's `libtcmalloc-minimal4` into the venv), which keeps freed memory where glibc's malloc
    hands it back and faults it in again every step: the CPU step on bench-learn's batch 10.8 s against 14.1 s, the
    same loss (bench/ALLOCATOR.md). `system`: glibc's malloc. `auto`: tcmalloc on the CPU where it is found, glibc's
    on a GPU (not measured there) or where it is not (said in one line at start)."""
    per_device_train_batch_size: int = Field(2, ge=1)
    """Packed rows of `sequence_len` tokens per micro-batch (forward/backward pass)."""
    sequence_len: int = Field(1024, ge=16)
    """Length of one packed row; samples are packed into rows with no attention across samples."""
    prompt_sharing: bool | Literal["auto"] = "auto"
    """Pack the completions of one prompt (a GRPO group) with the prompt's tokens once, each completion attending
    to them and to itself: the same logprobs and gradients as packing every sample whole, for fewer tokens (on
    short completions most of a sample is prompt). `auto`: wherever it applies (text batches; a model without
    sliding-window layers shorter than `sequence_len`; SDPA or tidal's CPU attention); `true`: the same, and a
    model it cannot apply to is an error; `false`: every sample whole. See docs/performance.md."""
    trust_remote_code: bool = False
    """Allow custom model and tokenizer code from the model directory (transformers' `trust_remote_code`). Set it
    like infer `trust_remote_code`; `tidal grpo` makes an unset one follow infer's."""
    rope_scaling: dict[str, Any] | None = None
    """RoPE scaling dict (e.g. `{rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}`) applied
    onto the model's config before the model is built; keys it does not give (e.g. `rope_theta`) keep the
    model's values. Set it like infer `rope_scaling`; `tidal grpo` makes an unset one follow infer's."""
    chat_template: str | None = None
    """Chat template of the trainer's tokenizer: a file path, or the Jinja template itself inline (a value holding
    `{{` or `{%`), as TRL's `chat_template_path`; null: the model's own. It renders `tidal sft`'s conversational
    prompts and goes with the exports (`final/adapter`, `final/merged`, `final/model`: `chat_template.jinja`). Set
    it like infer `chat_template` (which renders the GRPO prompts); `tidal grpo` makes an unset one follow infer's
    and refuses two different values."""
    logprob_chunk_size: int = Field(DEFAULT_LOGPROB_CHUNK_SIZE, ge=0)
    """Positions per chunk when computing log-probabilities (and the entropy metric) from the final hidden
    states: the lm_head, the float32 softmax and their backward run on this many loss positions at a time, so
    no (tokens, vocab) logits tensor exists (a few chunk x vocab float32 buffers instead; prompt tokens are
    skipped). Smaller: less memory, more small matmuls. 0: the full-logits path (all logits at once, as
    before; much more memory at long rows). Architectures the chunked path does not know use full logits
    anyway (a warning says so). `tidal sft` computes its (label-smoothed) loss the same way."""
    skip_zero_gradient: bool = True
    """Skip the backward of a micro-batch whose loss gradient is exactly zero: every advantage 0 (a group whose
    rewards are all equal) and no KL (`loss.beta`), entropy bonus, `loss.teacher_tau` or aipo `loss.kl_tau` term
    (`tidal.trainer.step.loss.zero_gradient`). Its forward still runs, without a graph, for the metrics
    (mismatch_kl, entropy, clipping); the optimizer gets the zero gradients the backward would have given, so the
    parameters are the same either way. With one optimizer step per batch the zero-gradient samples are packed
    into micro-batches of their own, except with `loss.loss_type: bnpo` or `loss.top_entropy_quantile` < 1 (each
    normalizes or takes its entropy quantile per micro-batch, so other neighbours would change the update): then
    only micro-batches that happen to hold no gradient skip. Applies to one trainer rank on dense models without
    images (several ranks run every backward together; an unused expert or vision tower would get a zero gradient
    instead of none). Metric `micro_batches/skipped`. false: every micro-batch runs its backward."""
    router_replay: bool | Literal["auto"] = "auto"
    """MoE router replay (R3, `tidal.trainer.model.router_replay`): the trainer's mixture-of-experts blocks route each
    token to the experts vLLM routed it to (the batch's `routed_experts`), keeping the trainer's own gate weights
    over them; metric `router/agreement` (share of token-layer routes where the trainer's own top-k equals vLLM's)
    whenever a batch carries routes. `auto`: on for Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE models whose batches
    carry routes (`tidal grpo` asks vLLM for them where it can return them: on GPUs, not on vLLM-CPU); `true`:
    required (a dense model, another MoE architecture, or in `tidal grpo` an engine without routes exits 2; a batch
    without routes stops the trainer); `false`: never replay (agreement is still measured when routes arrive)."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Activation checkpointing (transformers' `gradient_checkpointing_enable`, non-reentrant): keep only each
    decoder layer's input and recompute the layer in the backward. Much less activation memory for about a
    third more compute; works with LoRA and packed rows. `auto` (the default): off on CPU; in `tidal grpo` on a
    GPU on exactly when the trainer's share of the GPU (what vLLM's need leaves) would not hold it without
    (`tidal.colocate.split`); elsewhere on CUDA on when the estimate without it exceeds the GPU's free memory."""
    attention: Literal["auto", "flex", "per_sample", "dense"] = "auto"
    """Attention kernel for packed rows (`tidal.trainer.model.attention`; all compute the same masked attention, by
    test). `auto`: `flex` on CUDA, `per_sample` on CPU (and for vision-language models). `flex`: torch's
    flex_attention with a block mask of the packed layout (shared prompts included), compiled at most twice (with
    and without autograd) per size bucket of rows x width (`flex.graph_budget`: 48 graphs up to 16k tokens per
    micro-batch; the count is `flex_graphs` in metrics.jsonl); CUDA only (no flex backward on CPU: refused
    there). `per_sample`: one causal SDPA call per sample.
    `dense`: SDPA with the (T, T) mask, every score computed (the slow reference; a notice says so)."""
    checkpoint_every: int = Field(1, ge=1)
    """(gradient_checkpointing) Checkpoint every k-th decoder layer only (layers 0, k, 2k, ...); the others keep
    their activations: less recompute for more memory. 1: every layer (`tidal.trainer.model.activations`)."""
    checkpoint_scope: Literal["layer", "mlp", "elementwise"] = "layer"
    """(gradient_checkpointing) What a checkpointed layer recomputes in the backward: `layer`, the whole decoder
    layer (only its input is kept); `mlp`, only its MLP block (the attention's activations are kept, the MLP's
    4 x intermediate-size values per token are not); `elementwise`, selective checkpointing: the outputs of the
    layer's matmuls (base and LoRA) and attention kernel are kept, only the ops between them (norms, RoPE, SwiGLU,
    LoRA scaling, adds) are recomputed: no matmul runs twice, for more memory than `layer`
    (`tidal.trainer.model.activations`; the memory estimate counts it as not checkpointed, an upper bound)."""
    offload_activations: bool = False
    """Keep the activations that decoder layers save for the backward in (pinned) CPU memory instead of on the
    device, copied back for the backward (`torch.autograd.graph.save_on_cpu`); with gradient checkpointing it
    applies to the layers not checkpointed (`checkpoint_every` > 1 or `checkpoint_scope: mlp`)."""
    compile_layers: bool = False
    """Compile every decoder layer with `torch.compile` (fused elementwise kernels: RMSNorm, SwiGLU, RoPE, LoRA
    adds), once per shape; pays on CUDA with `attention: flex` (the per-sample kernel's loop breaks the graph).
    The first steps are slower while it compiles. Graphs: at most 4 per decoder-layer class (static then dynamic
    row length, with and without autograd; `layer_graphs` in metrics.jsonl), none after the second length, with
    flex or dense attention (the per-sample kernel's loop compiles again per packing layout)."""
    liger_kernel: list[Literal["rms_norm", "swiglu", "rope"]] = []
    """Liger Kernel's fused Triton kernels for these ops of the decoder layers (`tidal.trainer.model.kernels.liger`):
    `rms_norm` (every RMSNorm), `swiglu` (the MLP's silu(gate) x up; gate/up/down stay Linear, LoRA wraps them),
    `rope` (the rotary embedding of q and k). CUDA only, needs the `liger-kernel` package (0.8.5; not a tidal
    dependency), Llama, Mistral, Qwen2 and Qwen3 text models only: anything else exits 2. Its fused linear
    cross-entropy is not used (it returns a loss, tidal needs per-token logprobs and entropies)."""
    max_steps: int = Field(-1, ge=-1)
    """Training steps; -1 runs until the orchestrator says it is done (`tidal sft`: see `sft.max_steps`)."""
    logging_steps: int = Field(1, ge=1)
    """Print a progress line every N steps (metrics.jsonl gets every step)."""
    gradient_accumulation_steps: int = Field(4, ge=1)
    """Micro-batches per optimizer step, per rank (seed 000): a rollout batch packed into M micro-batches gives
    ceil(M / (G x ranks)) optimizer steps, each loss normalized over its own micro-batches."""
    steps_per_generation: int | None = Field(None, ge=1)
    """TRL's way to say it: optimizer steps per rollout batch; the batch's micro-batches are split into this
    many equal shares (overrides `gradient_accumulation_steps`, which must then stay at its default)."""
    micro_batch_tokens: int | None = Field(None, ge=16)
    """Token budget of a micro-batch (dynamic batching): packed rows join a micro-batch while rows x longest
    row stays within it, so long and short samples make equal work; must be >= `sequence_len`. Null: a fixed
    `per_device_train_batch_size` rows per micro-batch."""
    learning_rate: float = Field(2e-4, gt=0)
    """Peak learning rate."""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warmup."""
    lr_cosine_cycles: float = Field(0.5, gt=0)
    """(cosine) Cosine waves over the decay: factor `max(0, (1 + cos(2 pi cycles progress)) / 2)`; 0.5 decays once
    to 0 (transformers' `num_cycles`, TRL's `lr_scheduler_kwargs`)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps from 0 to `learning_rate`."""
    max_grad_norm: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this (0 disables clipping)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW beta2."""
    adam_epsilon: float = Field(1e-8, gt=0)
    """AdamW epsilon (added to the root of the second moment), both optimizers."""
    optimizer: Literal["adamw", "adamw_torch", "adamw_8bit"] = "adamw"
    """Optimizer. `adamw`/`adamw_torch`: torch's AdamW (float32 moments, 8 bytes/param). `adamw_8bit`:
    bitsandbytes' blockwise 8-bit AdamW, same update with both moments stored in 8 bits plus one float32 scale per
    256 values (~2 bytes/param), on GPU and CPU; tensors under 4096 elements keep float32 moments. Checkpoints
    resume it exactly. Single rank only (`gpus: 1`). Seed 000's default is `adamw_8bit`; tidal's is `adamw`,
    which also runs sharded across ranks and matches float64 references exactly."""
    recipe: Literal["auto", "bf16", "fp32", "fp8-hybrid", "fp8_hybrid", "nvfp4"] = "auto"
    """Precision recipe. `auto`: `bf16` on GPU; on CPU `bf16` where the CPU multiplies bfloat16 natively
    (AVX512-BF16 or AMX; with a notice), else `fp32`; the environment variable `TIDAL_CPU_RECIPE` (`fp32`/`bf16`)
    decides for CPU where set. `bf16`: bfloat16 weights and matmuls on GPU; on CPU float32 weights with bfloat16
    matmuls (autocast; attention scores and lm_head in float32), 1.5-2x faster where the CPU has bfloat16 units, and
    `tidal grpo` serves vLLM in bfloat16 beside it (infer `dtype: auto`; bench/LEARN-68-1024-S83.md: the same
    greedy accuracy as float32 in 0.6x the time). `fp32`: float32 on both sides. `fp8-hybrid` (or
    `fp8_hybrid`): the weights stay in bf16 (float32 on CPU) and the base model's linear layers (not `lm_head`,
    not the LoRA A/B) multiply in FP8 (e4m3 inputs and weights, e5m2 gradients, per-tensor scales): torchao
    float8 training on SM89+ GPUs, the same casts emulated elsewhere (CPU included, with a notice). `nvfp4`:
    refused (needs Blackwell, SM100+)."""
    lora: bool = True
    """Train LoRA adapters (PEFT). `false` trains all weights (full fine-tuning): each policy is published as its
    full weights (`broadcasts/step_n/merged/`, reloaded by vLLM in place, or the NCCL push of every weight),
    checkpoints hold all weights and their optimizer state, the export is `final/model/`; with `loss.beta > 0`
    the reference is a second, frozen copy of the initial weights."""
    freeze_embeddings: bool = False
    """(lora: false) Keep the input embeddings frozen (with tied embeddings, the lm_head too); they train
    otherwise. On vLLM-CPU a tied lm_head is re-packed after every in-place update
    (`tidal.inference.backends.vllm.tied_head`)."""
    lora_rank: int = Field(16, ge=1)
    """LoRA rank r."""
    lora_alpha: int = Field(32, gt=0)
    """LoRA alpha (scale = alpha / r)."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """LoRA dropout."""
    loraplus_lr_ratio: float | None = Field(None, ge=1)
    """LoRA+ (Hayou et al. 2024; PEFT's `create_loraplus_optimizer`, LLaMA-Factory's key): the B matrices (and
    any 1-D trainable tensor) learn at `learning_rate` x this ratio, the A matrices at `learning_rate` (the rate
    the logs show); the schedule scales both. Null: one rate for all (plain LoRA). Needs `lora: true`."""
    disable_dropout: bool = False
    """Set every dropout module of the policy to p = 0 (LoRA's `lora_dropout` and the model's own; TRL's
    `disable_dropout`)."""
    lora_target_modules: Literal["all-linear"] | list[str] = "all-linear"
    """Module names that get LoRA adapters (leaf names such as `q_proj`), or `all-linear` (as in PEFT): every
    linear layer of the decoder but the output layer, whatever the architecture calls them (`qkv_proj` and
    `gate_up_proj` on Phi-3; the attention projections of a mixture-of-experts model, whose experts are no
    linear layers). A name that matches no linear module of the model is an error listing the ones it has
    (`tidal.models.lora`; docs/models.md)."""
    qlora_fp8: bool = False
    """FP8 QLoRA: the base's linear layers (not `lm_head`) stored as float8 e4m3 with one float32 scale per 128
    values (~1.03 bytes/parameter; torchao), dequantized for each matmul; LoRA trains on top. vLLM serves the
    dequantized base (policy 0 is published by the trainer, orch `weight_broadcast.policy_zero: published`).
    Needs `lora: true` and `gpus: 1`; not with `recipe: fp8-hybrid`."""
    qlora_bnb: bool = False
    """NF4 QLoRA (QLoRA's recipe: 4-bit NormalFloat, one scale per 64 values, double-quantized; ~0.52 bytes/
    parameter; bitsandbytes, on GPU and CPU): the base's linear layers (not `lm_head`) quantized while loading,
    dequantized for each matmul; LoRA trains on top; vLLM serves the dequantized base as with `qlora_fp8`. Needs
    `lora: true` and `gpus: 1`; not with `recipe: fp8-hybrid`."""
    qlora_fp4: bool = False
    """FP4 (NVFP4) QLoRA: refused, it needs Blackwell (SM100+) FP4 matmuls."""
    share_base_weights: bool | Literal["auto"] = False
    """(`tidal grpo` on one GPU) Build the trainer's frozen base from vLLM's own weight tensors (CUDA IPC handles,
    zero-copy: the base is on the GPU once; docs/colocate.md). Default false until the CUDA path has run on a GPU (its
    mapping is verified on CPU against vLLM's model classes; the IPC hand-over is not yet). `auto`: on where it applies
    (one NVIDIA GPU, LoRA on an unquantized bf16 base, adapters reaching vLLM as LoRA, tp/dp/gpus 1, an architecture
    whose vLLM layout is verified), else off with a notice; `true` where it cannot apply is an error saying why;
    `false`: the trainer loads its own copy. `grpo-train` alone: `auto` is off; `true` needs `base_weights_url` (a vLLM
    on the same GPU started with infer `export_base_weights: true`) and the trainer-side conditions."""
    base_weights_url: str | None = None
    """(set by `tidal grpo` when `share_base_weights` is on) The co-located vLLM server (`http://host:port/v1`)
    the trainer asks for the CUDA IPC handles of its base weights."""
    max_async_level: int = Field(1, ge=0)
    """Policy lag allowed to inference; the trainer keeps the newest `max_async_level + 1` broadcasts."""
    transport_type: Literal["filesystem", "zmq"] = "filesystem"
    """How batches arrive from the orchestrator: `filesystem` (`{run_dir}/rollouts`) or `zmq` (asked from the
    orchestrator at `transport_host:transport_port`, its `rollout_transport`)."""
    transport_host: str = "localhost"
    """(zmq) Host of the orchestrator's batch server (`tidal grpo` sets it from orch `rollout_transport`)."""
    transport_port: int = Field(5555, ge=1, le=65535)
    """(zmq) Port of the orchestrator's batch server."""
    weight_broadcast: TrainWeightBroadcast = Field(default_factory=TrainWeightBroadcast)
    """How new policies reach inference."""
    seed: int = 42
    """Seed for torch's RNG (LoRA init, dropout)."""
    cpu_affinity: list[int] | None = None
    """CPU cores the trainer may run on (Linux; torch uses one thread per core). Null: all cores, except that
    `tidal grpo` on a CPU-only machine gives the trainer the second half of the cores and vLLM the first."""
    broadcast_merged: bool = False
    """Also write merged full weights (`broadcasts/step_n/merged/`) for servers that reload full weights
    (orch `weight_broadcast.reload: merged`); set automatically by `tidal grpo` on CPU-only machines."""
    batch_timeout_s: float = Field(1800.0, gt=0)
    """Give up (exit 1) when the next batch has not arrived within this many seconds."""
    ckpt: TrainCkptSection = Field(default_factory=TrainCkptSection)
    """Checkpointing and resume."""
    export: ExportSection = Field(default_factory=ExportSection)
    """Final export."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """GRPO loss settings."""
    mismatch_guard: MismatchGuardConfig = Field(default_factory=MismatchGuardConfig)
    """Trainer/inference mismatch guard."""
    noise_scheduler: NoiseSchedulerConfig = Field(default_factory=NoiseSchedulerConfig)
    """QeRL noise on the inference model's RMSNorm weights (seed 000)."""
    sft: SftSection = Field(default_factory=SftSection)
    """Settings used only by `tidal sft`."""

    _chat_template = field_validator("chat_template")(check_chat_template)

    @field_validator("recipe")
    @classmethod
    def _recipe(cls, value: str) -> str:
        if value == "nvfp4":
            raise ValueError(f"recipe 'nvfp4' {NVFP4_REFUSED}; use fp8-hybrid (FP8 matmuls, emulated where the "
                             f"hardware has none), bf16 or fp32")
        return value

    @model_validator(mode="after")
    def _ref_sync(self) -> TrainConfig:
        if self.loss.sync_ref_model and self.lora:
            raise ValueError("loss.sync_ref_model needs full fine-tuning (lora: false): with LoRA the reference is "
                             "the base model with the adapters disabled, and mixing an adapter's A and B separately "
                             "does not mix their product B A, so there is no sound reference to update (TRL refuses "
                             "it with PEFT too)")
        if self.loss.sync_ref_model and self.gpus > 1:
            raise ValueError(f"loss.sync_ref_model works with gpus: 1 only (got {self.gpus}): updating and "
                             f"checkpointing a sharded reference is not built")
        return self

    @model_validator(mode="after")
    def _loraplus(self) -> TrainConfig:
        if self.loraplus_lr_ratio is not None and not self.lora:
            raise ValueError(f"loraplus_lr_ratio ({self.loraplus_lr_ratio}) sets the rate of LoRA's B matrices "
                             "against their A matrices: it needs lora: true (full fine-tuning has no A and B)")
        return self

    @model_validator(mode="after")
    def _cosine_cycles(self) -> TrainConfig:
        if self.lr_cosine_cycles != 0.5 and self.lr_scheduler_type != "cosine":
            raise ValueError(f"lr_cosine_cycles applies with lr_scheduler_type 'cosine' only (got "
                             f"'{self.lr_scheduler_type}', which has no cycles)")
        return self

    @model_validator(mode="after")
    def _optimizer_ranks(self) -> TrainConfig:
        if self.optimizer == "adamw_8bit" and self.gpus > 1:
            raise ValueError(f"optimizer 'adamw_8bit' works with gpus: 1 only (got {self.gpus}): bitsandbytes' "
                             "8-bit kernels cannot update FSDP2-sharded parameters; use optimizer 'adamw' (its "
                             "state is sharded across the ranks) or gpus: 1")
        return self

    @model_validator(mode="after")
    def _qlora(self) -> TrainConfig:
        keys = [k for k in ("qlora_bnb", "qlora_fp8") if getattr(self, k)]
        if not keys:
            return self
        if len(keys) > 1:
            raise ValueError("qlora_bnb and qlora_fp8 are two formats of the same frozen base: set one")
        if not self.lora:
            raise ValueError(f"{keys[0]} quantizes the frozen base under LoRA adapters; with lora: false every weight "
                             f"trains and stays in full precision: set lora: true or drop {keys[0]}")
        if self.gpus > 1:
            raise ValueError(f"{keys[0]} works with gpus: 1 only (got {self.gpus}): FSDP2 cannot shard the quantized "
                             f"weights (bitsandbytes / torchao tensors); use gpus: 1 or a full-precision base")
        if self.recipe in ("fp8-hybrid", "fp8_hybrid"):
            raise ValueError(f"{keys[0]} with recipe {self.recipe}: the recipe would re-quantize the dequantized "
                             f"base for FP8 matmuls, a third set of numerics; use recipe bf16 (the seed's QLoRA "
                             f"setting) or drop {keys[0]}")
        return self

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        kind, _, index = value.partition(":")
        if value in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
            return value
        raise ValueError("device must be auto, cpu, cuda or cuda:N (N: a GPU index, e.g. cuda:1)")

    @model_validator(mode="after")
    def _activations(self) -> TrainConfig:
        if self.gradient_checkpointing is not True:
            for key, default in (("checkpoint_every", 1), ("checkpoint_scope", "layer")):
                if getattr(self, key) != default:
                    raise ValueError(f"{key} says which layers gradient checkpointing recomputes; set "
                                     f"gradient_checkpointing: true (auto may turn it off) or drop {key}")
            if self.gradient_checkpointing == "auto" and self.offload_activations:
                raise ValueError("offload_activations with gradient_checkpointing auto: whether it offloads every "
                                 "layer's activations or nothing would depend on the machine; set "
                                 "gradient_checkpointing: false (offload all) or true with checkpoint_every > 1 / "
                                 "checkpoint_scope: mlp")
        elif self.offload_activations and self.checkpoint_every == 1 and self.checkpoint_scope != "mlp":
            raise ValueError(f"offload_activations with every whole layer checkpointed (checkpoint_scope: "
                             f"{self.checkpoint_scope}) offloads nothing (tidal offloads the layers no checkpoint "
                             f"covers); set checkpoint_every > 1, checkpoint_scope: mlp, or gradient_checkpointing: "
                             f"false")
        if self.compile_layers and self.checkpoint_scope == "elementwise":
            raise ValueError("compile_layers with checkpoint_scope: elementwise: selective checkpointing's dispatch "
                             "mode around compiled layers is untested in tidal; set one of them")
        if len(set(self.liger_kernel)) != len(self.liger_kernel):
            raise ValueError(f"liger_kernel {self.liger_kernel} names an op twice; list each of rms_norm, swiglu, "
                             f"rope once")
        if self.compile_layers and self.offload_activations:
            raise ValueError("compile_layers with offload_activations: the offload's saved-tensor hooks inside a "
                             "compiled layer are not supported by tidal (untested); set one of them")
        return self

    @model_validator(mode="after")
    def _batching(self) -> TrainConfig:
        if self.freeze_embeddings and self.lora:
            raise ValueError("freeze_embeddings applies to full fine-tuning (lora: false); with LoRA the embeddings "
                             "are frozen anyway")
        if self.steps_per_generation is not None and self.gradient_accumulation_steps != 4:
            raise ValueError("set either steps_per_generation (optimizer steps per rollout batch, TRL) or "
                             "gradient_accumulation_steps (micro-batches per optimizer step, seed 000), not both")
        if self.micro_batch_tokens is not None:
            if self.micro_batch_tokens < self.sequence_len:
                raise ValueError(f"micro_batch_tokens ({self.micro_batch_tokens}) must be >= sequence_len "
                                 f"({self.sequence_len}): a packed row of sequence_len tokens must fit a micro-batch")
            if self.per_device_train_batch_size != 2:
                raise ValueError("set either micro_batch_tokens (a token budget per micro-batch) or "
                                 "per_device_train_batch_size (rows per micro-batch), not both")
        return self


BASE_MODEL_KEYS = ("model", "device", "recipe", "trust_remote_code", "rope_scaling", "attention", "qlora_bnb",
                   "qlora_fp8", "share_base_weights")
"""The train keys that decide the frozen base model the trainer builds before any adapter or recipe touches it
(`tidal.trainer.model.load.load_base`): a base loaded for one value of each (the warm pool's kept trainer,
`tidal.colocate.warm_trainer`) is the base of every run with the same values, and of no other."""


def base_model_key(cfg: TrainConfig) -> dict[str, Any]:
    """`BASE_MODEL_KEYS` of `cfg` (JSON values)."""
    dumped = cfg.model_dump(mode="json")
    return {k: dumped.get(k) for k in BASE_MODEL_KEYS}
