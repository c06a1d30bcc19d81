"""tidal: GRPO reinforcement learning for language models.

Three components cooperate: a real vLLM inference server (`tidal.inference`), an asyncio orchestrator that
collects and scores rollouts (`tidal.orchestrator`), and a PyTorch/PEFT trainer (`tidal.trainer`). They run
as three processes (`tidal grpo-infer | grpo-orch | grpo-train`) or under one parent (`tidal grpo`).

For Python scripts written for TRL: `from tidal import GRPOConfig, GRPOTrainer` (`tidal.api`, docs/trl.md),
imported on first use so `import tidal` stays light; a `rollout_func` samples with
`from tidal import generate_rollout_completions` (`tidal.orchestrator.rollout_func`).
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["GRPOConfig", "GRPOTrainer", "__version__", "generate_rollout_completions"]


def __getattr__(name: str) -> Any:
    if name in ("GRPOConfig", "GRPOTrainer"):
        from tidal import api

        return getattr(api, name)
    if name == "generate_rollout_completions":
        from tidal.orchestrator import rollout_func

        return rollout_func.generate_rollout_completions
    raise AttributeError(f"module 'tidal' has no attribute {name!r}")
