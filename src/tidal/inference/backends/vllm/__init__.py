"""The vLLM backend: `tidal grpo-infer` starts vLLM's OpenAI-compatible server(s) (`server`, `dp`); `client`
talks to them."""
