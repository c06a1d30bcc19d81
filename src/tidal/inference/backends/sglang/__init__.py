"""The SGLang backend: `tidal grpo-infer` starts `python -m sglang.launch_server` (`server`); `client`
samples through its native `/generate` and loads weights through its update routes."""
