"""The orchestrator: sample examples, collect rollouts from vLLM, score, compute advantages, hand batches on."""
