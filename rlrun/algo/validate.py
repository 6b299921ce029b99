"""Load-time checks of the ``algorithm`` section: incompatible combinations and user hook paths.

Called from the schema's validator, so every message starts with the dotted key it is about (the
config loader points at that key's file line). Imports no torch: ``rlrun config validate`` stays instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlrun.runtime.hooks import load_hook

if TYPE_CHECKING:
    from rlrun.config.schema import AlgorithmConfig

CUSTOM_ADVANTAGE_SIGNATURE = "fn(cfg: AlgorithmConfig, mb: MicroBatch, kl: Tensor) -> (advantages, returns)"
CUSTOM_LOSS_SIGNATURE = "fn(cfg: AlgorithmConfig, mb: MicroBatch, logprobs, entropy, aggregate) -> (loss, metrics)"
POSTPROCESS_SIGNATURE = "fn(cfg: AlgorithmConfig, step: int, micro_batches: list[MicroBatch]) -> None"
HOOKS = {
    "custom_advantage": (CUSTOM_ADVANTAGE_SIGNATURE, 3),
    "custom_loss": (CUSTOM_LOSS_SIGNATURE, 5),
    "rollout_data_postprocess": (POSTPROCESS_SIGNATURE, 3),
}


def check_algorithm(cfg: AlgorithmConfig) -> None:
    """Raise ``ValueError`` (key first) on the first problem; resolve every hook path."""
    for problem in _problems(cfg):
        raise ValueError(problem)
    for field, (signature, num_args) in HOOKS.items():
        spec = getattr(cfg, field)
        if spec is not None:
            load_hook(spec, f"algorithm.{field}", signature, num_args)


def load_algorithm_hook(cfg: AlgorithmConfig, field: str):
    """The function of hook ``field`` (None when unset); already validated at config load."""
    spec = getattr(cfg, field)
    if spec is None:
        return None
    signature, num_args = HOOKS[field]
    return load_hook(spec, f"algorithm.{field}", signature, num_args)


def _problems(cfg: AlgorithmConfig):
    kl, tis, opd = cfg.kl, cfg.tis, cfg.opd
    if kl.loss_coef > 0 and kl.reward_coef > 0:
        yield (
            f"algorithm.kl.reward_coef ({kl.reward_coef}) must be 0 when algorithm.kl.loss_coef "
            f"({kl.loss_coef}) > 0 because the KL to the reference is either a loss term or a reward "
            f"penalty, not both; set one of them to 0"
        )
    if kl.unbiased and kl.loss_coef == 0:
        yield (
            "algorithm.kl.unbiased (True) must go with algorithm.kl.loss_coef > 0 because it re-weights "
            "the KL loss term; set algorithm.kl.loss_coef or unbiased: false"
        )
    if (cfg.ref.path is not None or cfg.ref.update_interval is not None) and not cfg.uses_ref:
        yield (
            "algorithm.ref must stay unset when no KL term is on because nothing would read the "
            "reference log-probs; set algorithm.kl.loss_coef or algorithm.kl.reward_coef > 0"
        )
    if cfg.estimator_spec.needs_whitening and not cfg.normalize_advantages:
        yield (
            f"algorithm.normalize_advantages (False) must be true for advantage_estimator "
            f"{cfg.advantage_estimator} because it uses batch whitening as its baseline; "
            f"set algorithm.normalize_advantages: true"
        )
    if cfg.policy_loss is not None and cfg.loss_type != "policy":
        yield (
            f"algorithm.policy_loss ({cfg.policy_loss}) must be unset with loss_type {cfg.loss_type} "
            f"because only loss_type policy has a policy term; remove policy_loss or set loss_type: policy"
        )
    if cfg.use_rollout_logprobs and tis.mode != "off":
        yield (
            f"algorithm.tis.mode ({tis.mode}) must be off with use_rollout_logprobs because the old "
            f"policy is then the rollout policy and the TIS ratio is 1; set one of them off"
        )
    if cfg.use_rollout_logprobs and cfg.keep_old_actor:
        yield (
            "algorithm.keep_old_actor (True) must be false with use_rollout_logprobs because the old "
            "log-probs come from the engine; set one of them to false"
        )
    if tis.clip_low >= tis.clip:
        yield (
            f"algorithm.tis.clip_low ({tis.clip_low}) must be < algorithm.tis.clip ({tis.clip}) "
            f"because they bound the importance ratio from below and above; lower clip_low"
        )
    if (opd.kl_coef > 0) != (opd.teacher_path is not None):
        yield (
            f"algorithm.opd.teacher_path ({opd.teacher_path}) and algorithm.opd.kl_coef ({opd.kl_coef}) "
            f"must be set together because distillation needs both a teacher and a weight; set both "
            f"or neither"
        )
    if opd.teacher_engine is not None and opd.kl_coef == 0:
        yield (
            f"algorithm.opd.teacher_engine ({opd.teacher_engine}) must come with algorithm.opd.kl_coef > 0 and "
            "teacher_path because without distillation no teacher is scored; set both or unset teacher_engine"
        )
    if (cfg.loss_type == "custom") != (cfg.custom_loss is not None):
        yield (
            f"algorithm.custom_loss ({cfg.custom_loss}) must be set exactly when loss_type is custom "
            f"(it is {cfg.loss_type}); set both or neither"
        )
