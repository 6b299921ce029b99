"""Per-token estimators of KL(pi || pi_ref) at the sampled token (Schulman, http://joschu.net/blog/kl-approx.html).

With ``log_ratio = logp - logp_ref`` (tokens sampled from pi):

    k1          =  log_ratio                                  unbiased, can be negative
    k2          =  log_ratio**2 / 2                           biased, low variance
    k3          =  exp(-log_ratio) - 1 + log_ratio            unbiased, always >= 0
    low_var_kl  =  clamp(k3, -10, 10)                         k3 kept finite (slime / verl name)

``importance_ratio`` (pi_theta / pi_old) re-weights the estimate when the tokens were sampled from an
older policy than the one in the numerator (the "unbiased KL" of DeepSeek-V3.2).
"""

from __future__ import annotations

import torch

from rlrun.config.schema import KLEstimator

LOW_VAR_KL_BOUND = 10.0


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: KLEstimator,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate, same shape as the inputs (mask it yourself)."""
    log_ratio = logprobs.float() - ref_logprobs.float()
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = log_ratio.square() / 2.0
    elif estimator in ("k3", "low_var_kl"):
        kl = torch.exp(-log_ratio) - 1.0 + log_ratio
    else:
        raise ValueError(f"KL estimator ({estimator!r}) must be one of k1, k2, k3, low_var_kl")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if estimator == "low_var_kl":
        kl = kl.clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
    return kl
