"""Per-GPU memory of recipe layouts on clusters this machine is not (``rlrun doctor --plan``).

Each :class:`Recipe` is a published model's config.json (the dimensions only: the estimate needs no weights)
and a layout a recipe would run: GPUs, GPU memory, ``--set`` overrides of the base config
(configs/qwen3-4b-dapo-math.yaml's rollout and training sizes). :func:`plan` puts every phase of a step
through rlrun/tools/phase_memory.py (trainer estimate from rlrun/tools/memory_estimate.py, the SGLang engine
awake or released) and reports the largest; a layout over the GPU names the fields that lower its phase and,
where one exists, the nearest layout that fits (a doubled ``pp``, ``ep`` or ``tp`` within the same GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlrun.config.schema import RunConfig

QWEN3 = {
    "model_type": "qwen3",
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
}
QWEN3_MOE = {
    **QWEN3,
    "model_type": "qwen3_moe",
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}
MODELS: dict[str, dict[str, Any]] = {
    # config.json of each published model, the fields the architecture reads
    "Qwen3-4B": {
        **QWEN3,
        "hidden_size": 2560,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 9728,
        "tie_word_embeddings": True,
    },
    "Qwen3-8B": {
        **QWEN3,
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 12288,
        "tie_word_embeddings": False,
    },
    "Qwen3-30B-A3B": {
        **QWEN3_MOE,
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
    },
    "Qwen3-235B-A22B": {
        **QWEN3_MOE,
        "hidden_size": 4096,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_experts": 128,
    },
}
BASE = {
    "model": {"path": "unused", "dtype": "bfloat16"},
    "data": {"path": "unused"},
    "rollout": {"prompts_per_step": 128, "samples_per_prompt": 16, "max_new_tokens": 4096, "reward": "math"},
    "engine": {"backend": "sglang", "server_args": {"mem_fraction_static": 0.7}},
    "train": {"max_tokens_per_micro_batch": 16384},
    "offload": {"train": True, "rollout": True},
}
"""configs/qwen3-4b-dapo-math.yaml's sizes, colocated: the engine gets 70% of the GPU while it is awake."""
PROMPT_TOKENS = 512


@dataclass(frozen=True)
class Recipe:
    model: str
    num_gpus: int
    gpu_gib: float
    settings: dict[str, Any] = field(default_factory=dict)
    """Dotted overrides of :data:`BASE` (``parallel.tp``: 2)."""


RECIPES = (
    Recipe("Qwen3-4B", 8, 80, {"parallel.tp": 2}),
    Recipe("Qwen3-8B", 8, 80, {"parallel.tp": 2}),
    Recipe("Qwen3-8B", 8, 80, {"parallel.tp": 2, "optimizer.use_distributed_optimizer": True, "engine.tp": 2}),
    Recipe("Qwen3-30B-A3B", 16, 80, {"parallel.ep": 8, "engine.tp": 4}),
    Recipe(
        "Qwen3-30B-A3B",
        16,
        80,
        {"parallel.ep": 8, "engine.tp": 4, "optimizer.use_distributed_optimizer": True, "train.recompute": "full"},
    ),
    Recipe(
        "Qwen3-235B-A22B",
        64,
        80,
        {
            "parallel.pp": 4,
            "parallel.ep": 16,
            "engine.tp": 8,
            "optimizer.use_distributed_optimizer": True,
            "train.recompute": "full",
        },
    ),
    Recipe(
        "Qwen3-235B-A22B",
        64,
        141,
        {
            "parallel.pp": 4,
            "parallel.ep": 16,
            "engine.tp": 8,
            "optimizer.use_distributed_optimizer": True,
            "train.recompute": "full",
        },
    ),
    Recipe(
        "Qwen3-235B-A22B",
        64,
        141,
        {
            "parallel.pp": 8,
            "parallel.ep": 8,
            "engine.tp": 8,
            "optimizer.use_distributed_optimizer": True,
            "train.recompute": "full",
            "model.lm_head": "chunked",
        },
    ),
)


@dataclass(frozen=True)
class PlanRow:
    recipe: Recipe
    layout: str
    """``tp=2 pp=1 dp=4 engine.tp=2``."""
    phase: str
    """The step's largest phase."""
    peak_gib: float
    parts: dict[str, float]
    fits: bool
    fixes: list[str]
    """Empty when it fits; else the phase's fields to change, then a layout that fits if one does."""


def recipe_config(recipe: Recipe, extra: dict[str, Any] | None = None) -> RunConfig:
    tree: dict[str, Any] = {k: dict(v) for k, v in BASE.items()}
    for key, value in {**recipe.settings, **(extra or {})}.items():
        section, name = key.split(".", 1)
        tree.setdefault(section, {})[name] = value
    return RunConfig.model_validate(tree)


def peak(recipe: Recipe, extra: dict[str, Any] | None = None):
    """The config, its layout string and its largest phase (rlrun/tools/phase_memory.py)."""
    from rlrun.megatron.hf_config import ModelArch
    from rlrun.tools.phase_memory import phase_memory

    cfg = recipe_config(recipe, extra)
    arch = ModelArch.from_dict(MODELS[recipe.model])
    par = cfg.parallel
    model_parallel = par.tp * par.pp * par.cp
    if recipe.num_gpus % model_parallel or (recipe.num_gpus // par.pp) % (par.ep * par.etp):
        raise ValueError(f"{recipe.model}: {par} does not divide {recipe.num_gpus} GPUs")
    dp = recipe.num_gpus // model_parallel
    phases = phase_memory(cfg, arch, dp, recipe.num_gpus, recipe.gpu_gib, PROMPT_TOKENS)
    layout = f"{par} dp={dp} engine.tp={cfg.engine.tp}"
    return cfg, layout, max(phases, key=lambda p: p.total_gib)


def _fitting_layout(recipe: Recipe) -> str | None:
    """The first doubled pp, ep or tp (MoE: tp stays 1; pp doubled with ep halved, as the stages' ranks halve)
    that fits on the same GPUs, as ``--set`` text."""
    par = recipe_config(recipe).parallel
    if MODELS[recipe.model].get("num_experts"):
        candidates = [
            {"parallel.ep": par.ep * 2},
            {"parallel.pp": par.pp * 2},
            {"parallel.pp": par.pp * 2, "parallel.ep": max(par.ep // 2, 1)},
        ]
    else:
        candidates = [{"parallel.pp": par.pp * 2}, {"parallel.tp": par.tp * 2}]
    for extra in candidates:
        try:
            _, _, phase = peak(recipe, extra)
        except ValueError:
            continue
        if phase.total_gib <= recipe.gpu_gib:
            return " ".join(f"{k}={v}" for k, v in extra.items()) + f" (~{phase.total_gib:.0f} GiB)"
    return None


def plan(recipes: tuple[Recipe, ...] = RECIPES) -> list[PlanRow]:
    rows = []
    for recipe in recipes:
        cfg, layout, phase = peak(recipe)
        fits = phase.total_gib <= recipe.gpu_gib
        fixes = [] if fits else list(phase.fixes)
        if not fits and (layout_fix := _fitting_layout(recipe)):
            fixes.append(f"or set {layout_fix}")
        rows.append(PlanRow(recipe, layout, phase.phase, phase.total_gib, phase.parts, fits, fixes))
    return rows


def markdown(rows: list[PlanRow]) -> str:
    """The plan as a markdown table (docs/operations.md, "Clusters")."""
    lines = [
        "| model | GPUs | layout | settings | largest phase | GiB per GPU | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        settings = ", ".join(f"{k}={v}" for k, v in r.recipe.settings.items() if not k.startswith("parallel."))
        verdict = "fits" if r.fits else "over: " + "; ".join(r.fixes)
        lines.append(
            f"| {r.recipe.model} | {r.recipe.num_gpus} x {r.recipe.gpu_gib:.0f} GiB | {r.layout} | {settings or '-'} "
            f"| {r.phase} | {r.peak_gib:.1f} | {verdict} |"
        )
    return "\n".join(lines)
