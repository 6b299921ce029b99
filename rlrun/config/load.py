"""Load a run config: a YAML file plus ``--set dotted.key=value`` overrides, validated by the schema.

Every mistake a user can make here becomes a ``ConfigError`` whose message is one line per problem,
naming where the value came from (``file:line`` from the YAML node marks, or the ``--set`` argument),
the dotted key, the value and what is allowed, e.g.::

    configs/x.yaml:7: rollout.temperature (-1) must be greater than 0
    configs/x.yaml:8: unknown key 'rollout.temprature' (did you mean 'temperature'?)
    --set rollout.top_k=abc: rollout.top_k ('abc') must be a valid integer, unable to parse string as an integer

A file may start from base configs: a top-level ``base:`` (one path or a list, relative to the file) names
YAML files merged in order, then the file's own keys over them (mappings merge key by key; any other value
replaces). A base may have bases of its own. Each key keeps the file and line where it was last written,
so an error about a key that came from a base names the base file's line.

The loader describes the config only: it imports nothing of rlrun but the schema and reads no file but
the YAML. What a config names (hooks, model directories, prompt files, the critic's YAML, backend traits)
is checked by ``rlrun.preflight``, which gets each key's file and line from :class:`LoadedConfig`.
"""

from __future__ import annotations

import copy
import difflib
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlrun.config.schema import REQUIRED_KEYS, RunConfig, required_message

_MAX_VALUE_CHARS = 60
BASE_KEY = "base"
"""Top-level key naming the base configs of a file (not a ``RunConfig`` section)."""


class ConfigError(ValueError):
    """A config mistake the user can fix; ``str(err)`` is one line per problem, no traceback needed."""


@dataclass(frozen=True)
class LoadedConfig:
    """A validated config and where each of its keys was written, for checks that run after loading."""

    cfg: RunConfig
    path: Path
    sources: Mapping[str, str]
    """Dotted key -> ``file:line`` (the file, a base file, or ``--set key=value``) where it was last set."""

    def where(self, key: str) -> str:
        """Where ``key`` (or its nearest enclosing section) was set; the config file when nowhere."""
        return _source(key, dict(self.sources), self.path)

    def error(self, problems: Iterable[tuple[str, str]]) -> ConfigError | None:
        """One ``ConfigError`` of ``(dotted key, message)`` problems, each line led by its key's place and
        sorted by file line; None when there are none."""
        lines = list(dict.fromkeys(f"{self.where(key)}: {message}" for key, message in problems))
        return ConfigError("\n".join(sorted(lines, key=_source_order))) if lines else None


def load_config(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), values: dict[str, Any] | None = None
) -> RunConfig:
    """``read_config(...).cfg``: the validated config, without the preflight's checks of what it names."""
    return read_config(path, overrides, values).cfg


def read_config(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), values: dict[str, Any] | None = None
) -> LoadedConfig:
    """Read ``path`` (YAML, sections as in ``RunConfig``, after its ``base:`` files), apply ``overrides`` and
    validate.

    Overrides are ``dotted.key=value`` strings (what follows ``--set``); the value is parsed as a YAML
    scalar (``8`` is an int, ``1e-5`` a float, ``true`` a bool, ``null`` None, anything else a string).
    ``values`` are dotted keys with Python values (``rlrun.train``'s keyword overrides), applied last.
    ``logging.run_dir`` left unset is ``runs/<path's stem>``.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not a config file; pass the path of a YAML run config in it")
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found (cwd {Path.cwd()}); pass the path of a YAML run config")
    data, sources = _read_with_bases(path, ())
    return _validate(data, overrides, values or {}, sources, path, run_name=path.stem)


def config_from_dict(
    data: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), values: dict[str, Any] | None = None
) -> RunConfig:
    """``load_config`` for a config given as a nested dict (``rlrun.train``'s); ``logging.run_dir`` left unset is
    ``runs/run``."""
    return read_config_dict(data, overrides, values).cfg


def read_config_dict(
    data: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), values: dict[str, Any] | None = None
) -> LoadedConfig:
    """``read_config`` for a config given as a nested dict."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"the config must be a mapping of sections (model:, rollout:, ...), got {type(data).__name__}"
        )
    return _validate(copy.deepcopy(data), overrides, values or {}, {}, Path("<dict config>"), run_name="run")


def _read_with_bases(path: Path, chain: tuple[Path, ...]) -> tuple[dict, dict[str, str]]:
    """The data of ``path`` merged over its ``base:`` files (in order), and each key's ``file:line``."""
    text = _read_text(path)
    lines = _key_lines(text, path)
    data = yaml.safe_load(text)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}:1: the config must be a mapping of sections (model:, rollout:, ...), got {type(data).__name__}"
        )
    own = {key: f"{path}:{line}" for key, line in lines.items() if key != BASE_KEY}
    bases = data.pop(BASE_KEY, None)
    if bases is None:
        return data, own
    where = f"{path}:{lines[BASE_KEY]}"
    names = [bases] if isinstance(bases, str) else bases
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{where}: {BASE_KEY} ({bases!r}) must be a path or a list of paths of YAML configs")
    merged: dict = {}
    sources: dict[str, str] = {}
    for name in names:
        base = path.parent / name
        if not base.is_file():
            raise ConfigError(
                f"{where}: {BASE_KEY} ({name}) must name an existing YAML config because this file starts from it, "
                f"but {base} does not exist; paths are relative to {path.parent}"
            )
        if base.resolve() in chain + (path.resolve(),):
            raise ConfigError(f"{where}: {BASE_KEY} ({name}) includes itself through its bases; remove the loop")
        base_data, base_sources = _read_with_bases(base, chain + (path.resolve(),))
        _merge(merged, base_data)
        sources.update(base_sources)
    _merge(merged, data)
    sources.update(own)
    return merged, sources


def _merge(into: dict, data: dict) -> None:
    """Merge ``data`` into ``into``: mappings key by key, anything else replaces."""
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def _validate(
    data: dict,
    overrides: list[str] | tuple[str, ...],
    values: dict[str, Any],
    sources: dict[str, str],
    path: Path,
    run_name: str,
) -> LoadedConfig:
    for override in overrides:
        key, value = _parse_override(override)
        _set_dotted(data, key, value, override)
        sources[key] = f"--set {override}"
    for key, value in _leaves(values):
        where = f"rlrun.train({key}={value!r})"
        _check_known_key(key, where)
        _set_dotted(data, key, value, where)
        sources[key] = where
    logging = data.get("logging")
    if logging is None or isinstance(logging, dict) and logging.get("run_dir") is None:
        data["logging"] = {**(logging or {}), "run_dir": f"runs/{run_name}"}
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        problems = [_describe(e, sources, path) for e in err.errors()]
        raise ConfigError("\n".join(sorted(set(problems), key=_source_order))) from None
    return LoadedConfig(cfg, path, sources)


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML; ``load_config`` of this text gives back an equal config."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


def _read_text(path: Path) -> str:
    """The file's text; a binary file (a checkpoint, a parquet file passed by mistake) is a ``ConfigError``."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte {data[err.start]:#04x}); pass a YAML run config, saved as UTF-8"
        ) from None


def _key_lines(text: str, path: Path) -> dict[str, int]:
    """Map every dotted key of the YAML document to its 1-based line; reject duplicate keys."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as err:
        raise _yaml_error(err, path) from None
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


def read_yaml(path: Path) -> Any:
    """The data of a YAML file other than a run config (``critic.config``'s), with a run config's errors."""
    try:
        return yaml.safe_load(_read_text(path))
    except yaml.YAMLError as err:
        raise _yaml_error(err, path) from None


def _yaml_error(err: yaml.YAMLError, path: Path) -> ConfigError:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"{path}:{mark.line + 1}" if mark else str(path)
    reason = " ".join(str(getattr(err, "problem", None) or err).split())
    return ConfigError(f"{where}: invalid YAML: {reason}{_yaml_context(err)}")


def _yaml_context(err: yaml.YAMLError) -> str:
    """Where the construct the parser was inside began, when that is another line than the problem's: an
    unclosed quote or bracket is reported where the file ends or the next key starts, not where it opened."""
    context, start, mark = (getattr(err, name, None) for name in ("context", "context_mark", "problem_mark"))
    if not context or start is None or mark is None or start.line == mark.line:
        return ""
    return f" ({context} that starts on line {start.line + 1})"


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


def _leaves(values: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``{"train": {"num_steps": 2}, "rollout.top_p": 0.9}`` as dotted leaves: a dict under a section key is
    that section's fields; under any other key it is the value (``rollout.rewards``, ``data.chat_template_kwargs``)."""
    leaves = []
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        model: type[BaseModel] | None = RunConfig
        for part in dotted.split("."):
            model = _section_model(model, part) if model is not None and part in model.model_fields else None
        if isinstance(value, dict) and model is not None:
            leaves += _leaves(value, f"{dotted}.")
        else:
            leaves.append((dotted, value))
    return leaves


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
    if err["type"] == "missing":
        return "\n".join(f"{_source(key, sources, path)}: {_required(key)}" for key in _missing_keys(loc))
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


def _missing_keys(loc: tuple[str, ...]) -> list[str]:
    """The dotted keys a missing ``loc`` stands for: the key itself, or a missing section's required keys
    (``rollout``'s is ``rollout.reward``, which a validator requires)."""
    key = ".".join(loc)
    section = _model_at(loc)
    if section is None:
        return [key]
    own = [f"{key}.{name}" for name, field in section.model_fields.items() if field.is_required()]
    return list(dict.fromkeys(own + [k for k in REQUIRED_KEYS if k.startswith(f"{key}.")])) or [key]


def _required(key: str) -> str:
    return required_message(key) if key in REQUIRED_KEYS else f"{key} is required (it has no default); set it"


def _source_order(problem: str) -> tuple[int, str]:
    """Sort problems by file line; override and file-level problems after them."""
    head = problem.split(": ", 1)[0]
    line = head.rpartition(":")[2]
    return (int(line) if line.isdigit() else 1 << 30, problem)
