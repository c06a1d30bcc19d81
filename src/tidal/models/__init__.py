"""Per-architecture knowledge in one place: what a model is (`arch`: architecture name, mixture of experts, tied
embeddings; whether the trainer and vLLM can run it here), which of its modules LoRA adapts (`lora`:
`all-linear` and the check of named targets), and the names its weights have in the checkpoint and in vLLM
(`names`: fused MoE experts, fused qkv / gate_up, tied embeddings). The tested matrix is `docs/models.md`."""
