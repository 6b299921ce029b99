"""The ``engine`` settings against the registered backends' traits (rlrun/engine/registry.py).

The schema cannot check these: it imports nothing of rlrun, and the backends are named by string. Each
check reads traits, never backend names, so a new backend is one registry entry.
"""

from __future__ import annotations

from rlrun.config.schema import RunConfig
from rlrun.engine.registry import BACKENDS, BackendTraits

Problem = tuple[str, str]


def engine_problems(cfg: RunConfig) -> list[Problem]:
    """What ``engine.*`` and the engines of ``algorithm`` ask of their backends that those cannot do."""
    engine = cfg.engine
    if engine.backend not in BACKENDS:
        return [("engine.backend", _unknown("engine.backend", engine.backend))]
    traits = BACKENDS[engine.backend]
    problems = _option_problems(cfg, traits)
    if cfg.algorithm.routing_replay == "rollout" and traits.routed_experts_args is None:
        problems.append(
            (
                "algorithm.routing_replay",
                "algorithm.routing_replay (rollout) must go with an engine that returns routed experts because it "
                f"replays the engine's expert choices; engine.backend {engine.backend} cannot; set "
                "algorithm.routing_replay: trainer or pick a backend that returns them",
            )
        )
    return problems + _teacher_problems(cfg)


def _unknown(key: str, name: str) -> str:
    return (
        f"{key} ({name!r}) must be one of {sorted(BACKENDS)} because those are the registered backends "
        f"(rlrun/engine/registry.py); set {key} accordingly"
    )


def _option_problems(cfg: RunConfig, traits: BackendTraits) -> list[Problem]:
    engine, problems = cfg.engine, []
    if engine.verify_weights and not traits.supports_checksums:
        problems.append(
            (
                "engine.verify_weights",
                f"engine.verify_weights (true) must be false with backend {engine.backend} because it offers no "
                "per-tensor weight checksums; set it to false or use backend embedded",
            )
        )
    if engine.server_args and not traits.accepts_server_args:
        problems.append(
            (
                "engine.server_args",
                f"engine.server_args must be empty with backend {engine.backend} because it reads none; remove them "
                "or pick a backend that takes server arguments (sglang)",
            )
        )
    elif traits.server_arg_names is not None:
        unknown = sorted(set(engine.server_args) - set(traits.server_arg_names))
        if unknown:
            problems.append(
                (
                    "engine.server_args",
                    f"engine.server_args keys {unknown} must be among {list(traits.server_arg_names)} with backend "
                    f"{engine.backend} because it reads only those; remove them",
                )
            )
    return problems


def _teacher_problems(cfg: RunConfig) -> list[Problem]:
    opd = cfg.algorithm.opd
    if opd.teacher_engine is not None and opd.teacher_engine not in BACKENDS:
        return [("algorithm.opd.teacher_engine", _unknown("algorithm.opd.teacher_engine", opd.teacher_engine))]
    traits = BACKENDS[opd.teacher_engine] if opd.teacher_engine is not None else None
    problems = []
    # The embedded engine's server arguments are the policy engine's (a teacher's scoring is not plumbed to
    # them); SGLang's (server_arg_names None: any sglang.Engine argument) size its memory too.
    if opd.teacher_server_args and not (
        traits is not None and traits.accepts_server_args and traits.server_arg_names is None
    ):
        problems.append(
            (
                "algorithm.opd.teacher_server_args",
                f"algorithm.opd.teacher_server_args ({opd.teacher_server_args}) must be empty with teacher_engine "
                f"{opd.teacher_engine} because that teacher only scores tokens and reads none of them; remove them "
                "or set algorithm.opd.teacher_engine: sglang",
            )
        )
    if traits is not None and not traits.scores_any_temperature and cfg.rollout.temperature != 1.0:
        problems.append(
            (
                "rollout.temperature",
                f"rollout.temperature ({cfg.rollout.temperature}) must be 1 with algorithm.opd.teacher_engine: "
                f"{opd.teacher_engine} because its prompt log-probs ignore the request's temperature while the "
                "student's are taken at rollout.temperature; set rollout.temperature: 1 or teacher_engine: embedded",
            )
        )
    return problems
