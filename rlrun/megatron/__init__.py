"""Megatron side of the trainer: HF -> Megatron models, log-probs, train step, HF weight export.

Megatron itself is imported lazily inside the functions, so importing this package stays cheap.
"""

from rlrun.megatron.export import export_hf_weights
from rlrun.megatron.logprobs import compute_logprobs, compute_logprobs_and_entropy
from rlrun.megatron.model import MegatronModel, build_model
from rlrun.megatron.train import make_optimizer, make_optimizer_and_scheduler, make_scheduler, train_step

__all__ = [
    "MegatronModel",
    "build_model",
    "compute_logprobs",
    "compute_logprobs_and_entropy",
    "export_hf_weights",
    "make_optimizer",
    "make_optimizer_and_scheduler",
    "make_scheduler",
    "train_step",
]
