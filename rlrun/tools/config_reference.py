"""docs/config.md, generated from the schema: every field of a run's config with its type, default and docstring.

The schema (``rlrun/config/schema.py``) documents each field once, as an attribute docstring that pydantic keeps
as the field's ``description`` (``use_attribute_docstrings``); this module renders those into one page, a section
per config class in the order a YAML file nests them, so the page cannot drift from the code.
``tests/unit/test_config_reference.py`` fails when docs/config.md differs from what this prints.

    python -m rlrun.tools.config_reference            # print the page
    python -m rlrun.tools.config_reference --write    # rewrite docs/config.md
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from rlrun.config.schema import RunConfig

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"

HEADER = """\
# Configuration reference

Generated from `rlrun/config/schema.py` by `python -m rlrun.tools.config_reference --write`; do not edit by hand
(`tests/unit/test_config_reference.py` fails when this page is stale). A run's YAML nests these sections; any key
can be overridden with `--set section.key=value`, and a misspelt key fails at load naming the file and line.
`rlrun config show CONFIG` prints a config with every default filled in.
"""

_CONSTRAINTS = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.MinLen, "min_length", "length >="),
    (annotated_types.MaxLen, "max_length", "length <="),
)


@dataclass(frozen=True)
class Section:
    """One config class at one place in the tree: ``key`` is the dotted prefix a YAML file uses."""

    key: str
    model: type[BaseModel]


def _anchor(key: str) -> str:
    """GitHub's heading anchor of ``## key`` (lowercase, punctuation dropped)."""
    return re.sub(r"[^a-z0-9_\- ]", "", key.lower()).replace(" ", "-")


def _section_models(annotation: Any) -> Iterator[tuple[type[BaseModel], bool]]:
    """The config classes inside a field's type, each with whether it sits in a list (``[i]`` in its key)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, False
        return
    origin = typing.get_origin(annotation)
    for arg in typing.get_args(annotation):
        for model, listed in _section_models(arg):
            yield model, listed or origin in (list, tuple)


def sections(root: type[BaseModel] = RunConfig, prefix: str = "") -> list[Section]:
    """Every config class under ``root``, depth-first in field order (a YAML file's nesting)."""
    found = []
    for name, field in root.model_fields.items():
        for model, listed in _section_models(field.annotation):
            key = f"{prefix}{name}" + ("[i]" if listed else "")
            found.append(Section(key, model))
            found.extend(sections(model, key + "."))
    return found


def type_text(annotation: Any) -> str:
    """A field's type as a reader writes it: ``"a" | "b"`` for a Literal, ``X | null`` for an Optional."""
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_text(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    """The default as YAML would spell it (strings quoted, containers in flow style)."""
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return json.dumps(value, default=str).replace('"', "") if not isinstance(value, str) else json.dumps(value)


def constraint_text(field: FieldInfo) -> str:
    """Numeric and length bounds from ``Field(ge=..., gt=...)``, e.g. ``>= 1``."""
    parts = []
    for meta in field.metadata:
        for kind, attr, symbol in _CONSTRAINTS:
            if isinstance(meta, kind):
                parts.append(f"{symbol} {getattr(meta, attr)}")
    return ", ".join(parts)


def _field_entry(name: str, field: FieldInfo, key: str) -> list[str]:
    nested = list(_section_models(field.annotation))
    facts = [f"`{type_text(field.annotation)}`"]
    if nested:
        child = key + name + ("[i]" if nested[0][1] else "")
        facts.append(f"section [{child}](#{_anchor(child)})")
    if field.is_required():
        facts.append("required")
    elif not (nested and isinstance(field.get_default(call_default_factory=True), BaseModel)):
        facts.append(f"default `{default_text(field)}`")
    bound = constraint_text(field)
    if bound:
        facts.append(bound)
    lines = [f"* **`{name}`** ({'; '.join(facts)})" + (":" if field.description else "")]
    for line in (field.description or "").splitlines():
        lines.append(f"  {line}".rstrip())
    return lines


def _doc(model: type[BaseModel]) -> str:
    """The class's own docstring (pydantic gives BaseModel's when a class has none)."""
    doc = model.__dict__.get("__doc__")
    return inspect.cleandoc(doc) if doc else ""


def section_text(section: Section) -> str:
    lines = [f"## {section.key}", ""]
    if _doc(section.model):
        lines += [_doc(section.model), ""]
    for name, field in section.model.model_fields.items():
        lines += _field_entry(name, field, section.key + ".")
    return "\n".join(lines) + "\n"


ENTRY_TABLES = (
    ("algorithm.advantage_estimator", "rlrun.algo.estimators", "ESTIMATORS"),
    ("algorithm.policy_loss", "rlrun.algo.losses", "POLICY_LOSSES"),
)
"""Where the algorithm's entries live: (the config key that names one, module, table). An entry carries its own
settings model (``settings``) and a one-line ``summary``."""

ENTRIES_INTRO = """\
## Algorithm entries

`algorithm.advantage_estimator` and `algorithm.policy_loss` name an entry (`policy_loss: gspo`) or name it with
settings of its own (`policy_loss: {name: gspo, eps_clip: 3.0e-4}`). The `algorithm` section's flat fields of the same
name (`eps_clip`, `normalize_std`, `gamma`, ...) are the defaults of those settings, in every entry that has one; a key
in the mapping wins over them. Formulas: [algorithms.md](algorithms.md).
"""


@dataclass(frozen=True)
class Entry:
    """One estimator or policy loss: the key that names it, its name, its summary, its settings model."""

    key: str
    name: str
    summary: str
    settings: type[BaseModel]


def algorithm_entries() -> list[Entry]:
    """Every entry of the algorithm's tables, in table order; none for a table whose module does not exist."""
    found = []
    for key, module, table in ENTRY_TABLES:
        if importlib.util.find_spec(module) is None:
            continue
        for name, entry in getattr(importlib.import_module(module), table).items():
            found.append(Entry(key, name, getattr(entry, "summary", ""), entry.settings))
    return found


def entry_text(entry: Entry) -> str:
    lines = [f"### {entry.key}: {entry.name}", ""]
    if entry.summary:
        lines += [entry.summary[0].upper() + entry.summary[1:].rstrip(".") + ".", ""]
    fields = entry.settings.model_fields
    if not fields:
        lines.append("No settings of its own.")
    for name, field in fields.items():
        lines += _field_entry(name, field, f"{entry.key}.")
    return "\n".join(lines) + "\n"


def render() -> str:
    found = sections()
    entries = algorithm_entries()
    keys = [s.key for s in found] + (["Algorithm entries"] if entries else [])
    parts = [HEADER, "Sections: " + ", ".join(f"[{k}](#{_anchor(k)})" for k in keys) + ".\n"]
    parts += [section_text(section) for section in found]
    if entries:
        parts.append(ENTRIES_INTRO)
        parts += [entry_text(entry) for entry in entries]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {DOC_PATH.name} instead of printing")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
