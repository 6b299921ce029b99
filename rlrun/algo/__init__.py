"""Pure tensor math of RL post-training: advantages and losses. No torch.distributed here."""
