"""tidal: GRPO reinforcement learning for language models.

Three components cooperate: a real vLLM inference server (`tidal.inference`), an asyncio orchestrator that
collects and scores rollouts (`tidal.orchestrator`), and a PyTorch/PEFT trainer (`tidal.trainer`). They run
as three processes (`tidal grpo-infer | grpo-orch | grpo-train`) or under one parent (`tidal grpo`).
"""

__version__ = "0.1.0"
