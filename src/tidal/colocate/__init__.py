"""All of `tidal grpo`: the derivation of the children's configs from the user's three files and the machine
(`derive`), the GPU memory split between vLLM and the trainer (`split`), sharing vLLM's base weights with the
trainer (`sharing`), every refusal before anything starts (`preflight`), the run-start sequence shared by the CLI
and the Python API (`start`) and the supervisor of the three children (`supervise`). Above the orchestrator and the
trainer in the layers: it may call into both."""
