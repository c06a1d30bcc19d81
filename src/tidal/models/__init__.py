"""Model knowledge in one place, torch-free where it can be (import-linter lists the exceptions): one reader of a
model's config.json and the one `text_config` rule (`config`), what a model directory holds (`files`: the one
"is this a model directory?" test, its weights), what a model is (`arch`: architecture name, mixture
of experts, tied embeddings; whether the trainer and vLLM can run it here), which of its modules LoRA adapts
(`lora`), the names its weights have in the checkpoint and in vLLM (`names`), its length limit and RoPE parameters
(`limits`, `rope`), the trainer's memory footprint estimate (`memory`) and the view plan of the trainer's weights
over vLLM's (`shared_weights`). The tested matrix is `docs/models.md`."""
