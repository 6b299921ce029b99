"""Prompt data, rollout samples, training micro-batches and their movement between ranks."""
