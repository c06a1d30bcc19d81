"""Run monitoring: the metrics.jsonl sink and console progress lines."""
