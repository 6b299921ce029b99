"""Reading prompt rows from jsonl or parquet files, optionally a slice of them, with file:line errors.

A data source is ``path`` or ``path@[start:end]``; the slice has Python semantics (negative indices
count from the end, either side may be empty) and counts *rows*, not file lines (blank jsonl lines
are not rows). Only the selected rows are parsed and checked: rows outside the slice are never
trained on, so a malformed row there does not stop the run.

Each row is a JSON object (a parquet row, or a Hugging Face ``datasets`` row, is read as one) with the
prompt under ``prompt_key`` (a string, or a list of ``{"role", "content"}`` chat messages) and the reference
answer under ``label_key``. With ``metadata_key`` set, that key's object becomes ``Prompt.metadata``; without
it, every other key does. With ``tools_key`` set, that key holds the tool schemas (a list of objects, or a
JSON string of one) handed to the chat template.

Every key may be dotted, to reach into nested objects: ``label_key: reward_model.ground_truth`` reads
``row["reward_model"]["ground_truth"]`` (verl's layout); a key that exists as written, dots included,
wins. A directory (or a ``.csv`` / ``.arrow`` file) is read with the optional ``datasets`` package
(:mod:`rlrun.data.hf_datasets`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlrun.data.errors import PromptDataError
from rlrun.data.hf_datasets import datasets_rows, is_datasets_source

__all__ = ["MISSING", "DataSource", "Messages", "PromptDataError", "PromptRow", "RowKeys", "lookup", "read_rows"]

Messages = list[dict[str, str]]
_SLICE = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<end>-?\d*)\]$")


@dataclass(frozen=True)
class RowKeys:
    """Which keys of a row hold what (``DataConfig``'s keys)."""

    prompt: str = "prompt"
    label: str | None = "label"
    """None: rows have no label (e.g. a remote reward model judges without one)."""
    metadata: str | None = None
    tools: str | None = None


@dataclass(frozen=True)
class PromptRow:
    """One checked row before tokenization. ``where`` is ``file:line`` (jsonl) or ``file:row N`` (parquet)."""

    index: int
    where: str
    prompt: str | Messages
    label: Any
    metadata: dict[str, Any]
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class DataSource:
    """A parsed ``path[@[start:end]]`` spec."""

    path: Path
    start: int | None = None
    end: int | None = None

    @classmethod
    def parse(cls, spec: str | Path) -> DataSource:
        match = _SLICE.match(str(spec))
        if match is None:
            return cls(Path(spec))
        bound = lambda text: int(text) if text else None  # noqa: E731
        return cls(Path(match["path"]), bound(match["start"]), bound(match["end"]))

    def select(self, num_rows: int) -> range:
        """The row numbers (0-based) the slice selects out of ``num_rows``."""
        return range(num_rows)[slice(self.start, self.end)]


def read_rows(
    spec: str | Path,
    prompt_key: str = "prompt",
    label_key: str | None = "label",
    metadata_key: str | None = None,
    tools_key: str | None = None,
    split: str = "train",
) -> list[PromptRow]:
    """Parse and check the rows ``spec`` selects (no tokenizer needed; cheap).

    Row ``index`` is the row's position within the selection, so it is 0..len-1 either way. ``split`` picks
    the split of a ``datasets`` source that has several.
    """
    source = DataSource.parse(spec)
    keys = RowKeys(prompt_key, label_key, metadata_key, tools_key)
    if not source.path.exists():
        raise PromptDataError(f"{source.path}: prompt file not found (cwd {Path.cwd()}); set data.path")
    if is_datasets_source(source.path):
        raw = datasets_rows(source.path, source.select, split)
    elif source.path.suffix == ".parquet":
        raw = _parquet_rows(source)
    else:
        raw = _jsonl_rows(source)
    if not raw:
        raise PromptDataError(
            f"{spec}: no prompts (the file is empty or the slice selects no rows); "
            "set data.path to a file with rows, or widen its @[start:end] slice"
        )
    return [_check_row(where, row, index, keys) for index, (where, row) in enumerate(raw)]


def _jsonl_rows(source: DataSource) -> list[tuple[str, Any]]:
    with source.path.open("rb") as lines:
        numbered = [(line_no, raw) for line_no, raw in enumerate(lines, start=1) if raw.strip()]
    rows = []
    for row_no in source.select(len(numbered)):
        line_no, raw = numbered[row_no]
        where = f"{source.path}:{line_no}"
        try:
            text = raw.decode("utf-8-sig").rstrip()  # -sig: a leading byte-order mark (Windows editors) is no error
        except UnicodeDecodeError as err:
            raise PromptDataError(
                f"{where}: not UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1}); save the file as UTF-8"
            ) from None
        try:
            rows.append((where, json.loads(text)))
        except json.JSONDecodeError as err:
            hint = _cut_hint(text, err)
            raise PromptDataError(f"{where}: invalid JSON ({err.msg} at column {err.pos + 1}){hint}") from None
    return rows


def _cut_hint(text: str, err: json.JSONDecodeError) -> str:
    """A hint when the line ends inside its JSON value: a pretty-printed or one-array ``.json`` file, or a row
    cut short, rather than a typo within the line."""
    if err.pos < len(text.rstrip()):
        return ""
    return "; the line ends inside its JSON value: each row must be one complete JSON object on one line (JSON Lines)"


def _parquet_rows(source: DataSource) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PromptDataError(
            f"{source.path}: reading parquet needs pyarrow; pip install pyarrow, or convert the file to jsonl"
        ) from None
    try:
        table = pq.read_table(source.path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a broken file
        raise PromptDataError(f"{source.path}: not a readable parquet file ({type(err).__name__}: {err})") from None
    selected = source.select(table.num_rows)
    if not selected:
        return []
    rows = table.slice(selected.start, len(selected)).to_pylist()
    return [(f"{source.path}:row {selected.start + i + 1}", row) for i, row in enumerate(rows)]


def _check_row(where: str, row: Any, index: int, keys: RowKeys) -> PromptRow:
    if not isinstance(row, dict):
        raise PromptDataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    for key, field in ((keys.prompt, "data.prompt_key"), (keys.label, "data.label_key")):
        if key is not None and lookup(row, key) is MISSING:
            raise PromptDataError(f"{where}: missing key '{key}' ({field}); {_keys_seen(row, key)}")
    prompt = lookup(row, keys.prompt)
    if not _is_prompt(prompt):
        raise PromptDataError(
            f"{where}: '{keys.prompt}' ({_short(prompt)}) must be a non-empty string or a non-empty list of "
            '{"role": str, "content": str} messages'
        )
    own = {keys.prompt, keys.label, keys.tools}
    metadata = _metadata(where, row, keys.metadata) if keys.metadata else {k: v for k, v in row.items() if k not in own}
    return PromptRow(
        index=index,
        where=where,
        prompt=prompt,
        label=lookup(row, keys.label) if keys.label else None,
        metadata=metadata,
        tools=_tools(where, row, keys.tools) if keys.tools else None,
    )


MISSING = object()
"""What :func:`lookup` returns for a key the row does not have (a row's value may itself be None)."""


def lookup(row: Any, key: str) -> Any:
    """``row[key]``, where a dotted ``key`` walks nested objects (``reward_model.ground_truth``); a key present
    as written, dots included, wins. :data:`MISSING` when any part is absent."""
    if isinstance(row, dict) and key in row:
        return row[key]
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def _keys_seen(row: dict, key: str) -> str:
    """The keys at the level where ``key``'s walk stopped, for the error."""
    value, walked = row, []
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            break
        value, walked = value[part], [*walked, part]
    if not isinstance(value, dict):
        return f"'{'.'.join(walked)}' is of type {type(value).__name__}, not an object"
    return f"the {'.'.join(walked) or 'row'} has keys {sorted(value)}"


def _metadata(where: str, row: dict, key: str) -> dict[str, Any]:
    value = lookup(row, key)
    if value is None or value is MISSING:
        return {}
    if not isinstance(value, dict):
        raise PromptDataError(
            f"{where}: '{key}' ({_short(value)}) must be a JSON object because it is "
            "data.metadata_key; fix the row or unset data.metadata_key"
        )
    return value


def _tools(where: str, row: dict, key: str) -> list[dict[str, Any]] | None:
    value = lookup(row, key)
    if value is MISSING:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise PromptDataError(
                f"{where}: '{key}' is a string but not JSON ({err.msg}); "
                "data.tools_key must hold a list of tool schemas"
            ) from None
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise PromptDataError(
            f"{where}: '{key}' ({_short(value)}) must be a list of tool-schema objects because it is data.tools_key"
        )
    return value


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict)
            and {"role", "content"} <= set(m)
            and isinstance(m["role"], str)
            and isinstance(m["content"], str)
            for m in value
        )
    )


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."
