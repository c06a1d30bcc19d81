"""The trainer's model: loading (quantized, shared with vLLM, compiled), precision, noise, vision, activations,
attention."""
