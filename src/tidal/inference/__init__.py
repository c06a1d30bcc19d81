"""Inference: launching vLLM's OpenAI-compatible server and talking to it."""
