"""Load a run config: a YAML file plus ``--set dotted.key=value`` overrides, validated by the schema.

Every mistake a user can make here becomes a ``ConfigError`` whose message is one line per problem,
naming where the value came from (``file:line`` from the YAML node marks, or the ``--set`` argument),
the dotted key, the value and what is allowed, e.g.::

    configs/x.yaml:7: rollout.temperature (-1) must be greater than 0
    configs/x.yaml:8: unknown key 'rollout.temprature' (did you mean 'temperature'?)
    --set rollout.top_k=abc: rollout.top_k ('abc') must be a valid integer, unable to parse string as an integer

Only pydantic, PyYAML and the reward loader are imported, so ``rlrun config validate`` stays instant
(no torch, no Megatron).
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlrun.config.schema import RunConfig

_MAX_VALUE_CHARS = 60


class ConfigError(ValueError):
    """A config mistake the user can fix; ``str(err)`` is one line per problem, no traceback needed."""


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read ``path`` (YAML, sections as in ``RunConfig``), apply ``overrides`` and validate.

    Overrides are ``dotted.key=value`` strings (what follows ``--set``); the value is parsed as a YAML
    scalar (``8`` is an int, ``1e-5`` a float, ``true`` a bool, ``null`` None, anything else a string).
    The reward spec is resolved here too, so a bad hook path fails before any model is loaded.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found (cwd {Path.cwd()}); pass the path of a YAML run config")
    text = path.read_text()
    lines = _key_lines(text, path)
    data = yaml.safe_load(text)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}:1: the config must be a mapping of sections (model:, rollout:, ...), got {type(data).__name__}"
        )
    sources = {key: f"{path}:{line}" for key, line in lines.items()}
    for override in overrides:
        key, value = _parse_override(override)
        _set_dotted(data, key, value, override)
        sources[key] = f"--set {override}"
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        problems = [_describe(e, sources, path) for e in err.errors()]
        raise ConfigError("\n".join(sorted(set(problems), key=_source_order))) from None
    _check_reward(cfg, sources, path)
    return cfg


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML; ``load_config`` of this text gives back an equal config."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


def _key_lines(text: str, path: Path) -> dict[str, int]:
    """Map every dotted key of the YAML document to its 1-based line; reject duplicate keys."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        reason = " ".join(str(getattr(err, "problem", None) or err).split())
        raise ConfigError(f"{where}: invalid YAML: {reason}") from None
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            if key in lines:
                raise ConfigError(
                    f"{path}:{key_node.start_mark.line + 1}: duplicate key '{key}' "
                    f"(first set on line {lines[key]}); keep one"
                )
            lines[key] = key_node.start_mark.line + 1
            walk(value_node, f"{key}.")

    if root is not None:
        walk(root, "")
    return lines


def _parse_override(override: str) -> tuple[str, Any]:
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {override}: expected dotted.key=value, e.g. --set rollout.temperature=0.7")
    _check_known_key(key, override)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    # "a: b" parses as a mapping but means the text; a mapping is written as one: "{a: b}".
    return key, raw if isinstance(value, dict) and not raw.lstrip().startswith("{") else value


def _check_known_key(key: str, override: str) -> None:
    """Overrides may only name existing fields: a typo must not silently add a key."""
    model: type[BaseModel] | None = RunConfig
    parts = key.split(".")
    for depth, part in enumerate(parts):
        dotted = ".".join(parts[: depth + 1])
        if model is None:
            parent = ".".join(parts[:depth])
            raise ConfigError(f"--set {override}: '{parent}' is a value, not a section; set '{parent}=...'")
        if part not in model.model_fields:
            raise ConfigError(f"--set {override}: {_unknown_key(dotted, model)}")
        model = _section_model(model, part)


def _set_dotted(data: dict, key: str, value: Any, override: str) -> None:
    *parents, leaf = key.split(".")
    node = data
    for depth, part in enumerate(parents):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            section = ".".join(parents[: depth + 1])
            raise ConfigError(f"--set {override}: '{section}' in the config file is {child!r}, not a section")
        node = child
    node[leaf] = value


def _section_model(model: type[BaseModel], field: str) -> type[BaseModel] | None:
    """The section type of ``field``, also of an optional section (``model.lora: LoraConfig | None``, which
    ``--set model.lora.rank=8`` turns on)."""
    annotation = model.model_fields[field].annotation
    members = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    section = members[0] if len(members) == 1 else None
    return section if isinstance(section, type) and issubclass(section, BaseModel) else None


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] | None = RunConfig
    for part in loc:
        if model is None or part not in model.model_fields:
            return None
        model = _section_model(model, part)
    return model


def _unknown_key(dotted: str, model: type[BaseModel]) -> str:
    name = dotted.rpartition(".")[2]
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else f"allowed: {', '.join(allowed)}"
    return f"unknown key '{dotted}' ({hint})"


def _source(key: str, sources: dict[str, str], path: Path) -> str:
    """Where ``key`` (or its nearest enclosing section) was set: an override wins over the file."""
    parts = key.split(".") if key else []
    for depth in range(len(parts), 0, -1):
        found = sources.get(".".join(parts[:depth]))
        if found:
            return found
    return str(path)


def _describe(err: dict, sources: dict[str, str], path: Path) -> str:
    loc = tuple(str(p) for p in err["loc"])
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        return f"{_source(key, sources, path)}: {_unknown_key(key, _model_at(loc[:-1]) or RunConfig)}"
    msg = " ".join(err["msg"].split())
    if err["type"] == "value_error":
        # Cross-field validators already name their key ("parallel.pp must be 1: ..."); point at that key.
        msg = msg.removeprefix("Value error, ")
        named = msg.split(" ", 1)[0]
        return f"{_source(named if named in sources else key, sources, path)}: {msg}"
    value = repr(err["input"])
    if len(value) > _MAX_VALUE_CHARS:
        value = value[: _MAX_VALUE_CHARS - 3] + "..."
    if msg.startswith("Input should "):
        text = f"{key} ({value}) must {msg.removeprefix('Input should ')}"
    else:
        text = f"{key} ({value}): {msg[:1].lower()}{msg[1:]}"
    return f"{_source(key, sources, path)}: {text}"


def _source_order(problem: str) -> tuple[int, str]:
    """Sort problems by file line; override and file-level problems after them."""
    head = problem.split(": ", 1)[0]
    line = head.rpartition(":")[2]
    return (int(line) if line.isdigit() else 1 << 30, problem)


def _check_reward(cfg: RunConfig, sources: dict[str, str], path: Path) -> None:
    from rlrun.data.source import load_source_factory
    from rlrun.preflight.hooks import HookSpecError
    from rlrun.rollout.hook_specs import HOOK_LOADERS
    from rlrun.rollout.rewards import RewardSpecError, load_reward_fn

    r = cfg.rollout
    specs = [("rollout.reward", r.reward)] + [(f"rollout.rewards.{name}", spec) for name, spec in r.rewards.items()]
    specs += [(f"eval.datasets.{i}.reward", ds.reward) for i, ds in enumerate(cfg.eval.datasets) if ds.reward]
    checks = [(key, lambda spec=spec: load_reward_fn(spec, r.remote_reward)) for key, spec in specs]
    hooks = [(name, load, getattr(r, name)) for name, load in HOOK_LOADERS.items()]
    checks += [(f"rollout.{name}", lambda load=load, spec=spec: load(spec)) for name, load, spec in hooks if spec]
    if cfg.data.sampler:
        checks.append(("data.sampler", lambda: load_source_factory(cfg.data.sampler)))
    for key, check in checks:
        try:
            check()
        except (RewardSpecError, HookSpecError) as err:
            message = str(err) if str(err).startswith(key) else f"{key}: {err}"
            raise ConfigError(f"{_source(key, sources, path)}: {message}") from None
