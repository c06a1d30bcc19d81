"""The PyTorch trainer. Recipes at the top (`grpo`, `sft`), with the policy whole (`policy`), ranks (`distributed`),
checkpoints (`ckpt`, `state`), its refusals (`preflight`), memory at run time (`memory`) and the calibration step
(`calibrate`); rooms below: `model/` (load, quantization, precision, noise, vision, activations, attention,
kernels, shared base), `step/` (packing, logprobs, loss, schedule, optimizer, health), `publish/` (broadcast, the
weight push into vLLM or SGLang, export)."""
