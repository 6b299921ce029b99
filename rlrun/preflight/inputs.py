"""The files a run config names, checked before any process starts (``config validate`` and ``train``).

Without this a relative ``model.path`` run from another directory fails only after every engine worker
has started, with transformers' ``Repo id must be in the form 'repo_name'`` in a worker log. Each problem
is one line: the key, its value, the directory a relative path was read against (the one rlrun runs
in) and how to make the file; the preflight leads it with the key's file and line.
Stdlib and the prompt-file reader only: ``config validate`` must not import torch.
"""

from __future__ import annotations

from pathlib import Path

from rlrun.config import RunConfig
from rlrun.data.prompt_files import DataSource, PromptDataError, read_rows
from rlrun.preflight.critic import load_critic_config
from rlrun.rollout.rewards.labels import check_text_labels

SMOLLM2_HINT = "run `rlrun prepare smollm2 --out {path}`"
ADDITION_HINT = "run `python configs/data/make_addition.py` in the repository"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any one of them is a tokenizer ``AutoTokenizer.from_pretrained`` can load."""


def input_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """(dotted key, message) for every model directory, prompt file and critic config the run reads that
    does not exist or does not parse (prompt rows parsed and checked)."""
    checks = [
        ("model.path", _model_dir("model.path", cfg.model.path)),
        ("algorithm.ref.path", _model_dir("algorithm.ref.path", cfg.algorithm.ref.path, checkpoints_ok=True)),
        ("algorithm.opd.teacher_path", _model_dir("algorithm.opd.teacher_path", cfg.algorithm.opd.teacher_path)),
        ("critic.config", _file("critic.config", cfg.critic.config, "set critic.config: configs/critic/smollm2.yaml")),
        ("critic.config", _critic_model(cfg)),
        ("data.path", _prompts("data.path", cfg.data.path, cfg)),
        *(
            (f"eval.datasets.{i}.path", _prompts(f"eval.datasets[{i}].path", d.path, cfg, d))
            for i, d in enumerate(cfg.eval.datasets)
        ),
    ]
    return [(key, message) for key, message in checks if message]


def _where(value: str) -> str:
    """Where a path was looked for: relative paths are read against the working directory."""
    return "" if Path(value).is_absolute() else f" relative to {Path.cwd()} (the directory rlrun runs in)"


def _missing(key: str, value: str, what: str, fix: str) -> str:
    return (
        f"{key} ({value}) must name {what} because the run reads it, but it does not exist{_where(value)}; "
        f"{fix}, or set {key} to an absolute path"
    )


def _model_dir(key: str, value: str | None, checkpoints_ok: bool = False) -> str | None:
    if value is None:
        return None
    path = Path(value)
    if not (path / "config.json").is_file() and checkpoints_ok and path.is_dir():
        return None
    what = "a Hugging Face model directory (config.json, weights, tokenizer)"
    smollm2 = "smollm2" in path.name.lower()
    fix = SMOLLM2_HINT.format(path=value) if smollm2 else "download or convert the model"
    if not path.is_dir():
        return _missing(key, value, what, fix)
    lacking = _lacking_model_files(path)
    if not lacking:
        return None
    refill = f"remove it and {fix}" if smollm2 else "save the model there with save_pretrained"
    return (
        f"{key} ({value}) must be {what} because the run loads it, but it has no {', no '.join(lacking)}"
        f"{_where(value)}; {refill}, or set {key} to a complete one"
    )


def _lacking_model_files(path: Path) -> list[str]:
    """What of config.json, the weights the trainer reads and a tokenizer ``path`` lacks: without them a run
    fails only after its engine workers have started, in a transformers traceback."""
    parts = (
        ("config.json", ("config.json",)),
        ("*.safetensors weights", ("*.safetensors",)),
        ("tokenizer files (tokenizer.json, tokenizer_config.json)", TOKENIZER_FILES),
    )
    return [name for name, patterns in parts if not any(any(path.glob(p)) for p in patterns)]


def _file(key: str, value: str | None, fix: str) -> str | None:
    if value is None or Path(value).is_file():
        return None
    return _missing(key, value, "an existing file", fix)


def _critic_model(cfg: RunConfig) -> str | None:
    """The critic's ``model.path`` (its config file's override, else the actor's)."""
    if cfg.critic.config is None or not Path(cfg.critic.config).is_file():
        return None
    try:
        critic = load_critic_config(cfg)
    except ValueError as err:
        return str(err)
    if critic.model.path == cfg.model.path:
        return None
    return _model_dir(f"model.path in critic.config {cfg.critic.config}", critic.model.path)


def _prompts(key: str, spec: str, cfg: RunConfig, eval_set=None) -> str | None:
    path = DataSource.parse(spec).path
    if not path.exists():
        fix = ADDITION_HINT if path.name.startswith("addition") else "write the prompt file"
        return _missing(key, spec, "a prompt file (.jsonl or .parquet) or a datasets directory", fix)
    data = eval_set.data_config(cfg.data) if eval_set is not None else cfg.data
    try:
        rows = read_rows(spec, data.prompt_key, data.label_key, data.metadata_key, data.tools_key, data.split)
        check_text_labels(rows, data.label_key, eval_set.reward if eval_set and eval_set.reward else cfg.rollout.reward)
    except PromptDataError as err:
        return f"{key}: {err}"
    return None
