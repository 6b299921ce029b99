"""Per-rank runtime: torchrun environment, process groups, devices, seeding, Megatron on CPU."""
