"""The Tinker-compatible service (`tidal serve-tinker`, docs/tinker.md): the official `tinker` SDK drives tidal.

Modules, one concept each: `config` (the command's settings), `wire` (the SDK's protobuf bodies), `losses` (the
SDK's built-in losses as pure functions), `trainer` (base model + one PEFT LoRA adapter per training client),
`sampler` (the vLLM it starts, adapters hot-loaded), `service` (sessions, models, checkpoints, futures), `app` (the
REST routes), `serve` (start-up). Needs the optional `tinker` extra (`pip install 'tidal[tinker]'`).
"""
