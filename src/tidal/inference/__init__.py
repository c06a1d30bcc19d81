"""Inference: the engine-neutral protocol the orchestrator and trainer speak (`protocol.py`), the precision vLLM
serves in (`precision.py`), and the servers: `backends/launch.py` (`tidal grpo-infer`: the servers of infer
`backend`), `backends/dp.py` (infer `dp`: N servers supervised as one), and one package per engine,
`backends/vllm/` (vLLM's OpenAI-compatible server, its client, the plugin, weight transfer, tied heads, the worker
extension, CUDA IPC) and `backends/sglang/` (the same for SGLang)."""
