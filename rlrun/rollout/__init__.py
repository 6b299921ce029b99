"""Rollout: drawing prompts, generating responses through the engines, scoring them (``rewards``)."""
