"""One training step's parts: packing, logprobs, the loss, the micro-batch schedule, the optimizer, the mismatch
guard."""
