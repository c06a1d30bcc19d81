"""The PyTorch trainer: model loading (transformers + PEFT), packing, logprobs, GRPO loss, optimizer, broadcast."""
