"""What only co-location on one GPU has: the memory split between vLLM and the trainer (need-sized KV cache,
measured trainer peak) and zero-copy base weights shared from vLLM's workers to the trainer."""
