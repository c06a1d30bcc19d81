"""The vLLM backend, and every module that touches vLLM's internals: `tidal grpo-infer` starts vLLM's
OpenAI-compatible server(s) (`server`, `dp`); `client` talks to them; `support` reads what the installed vLLM has;
`weight_transfer` (the gloo twin of vLLM's NCCL engine, its plugin entry point), `tied_head`, and the co-located
trainer's shared base weights (`worker_ext`, `ipc`) run inside vLLM's processes."""
