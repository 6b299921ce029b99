"""Prompt rows through Hugging Face ``datasets`` (optional): a dataset saved with ``save_to_disk``, or local
files ``load_dataset`` reads (a directory of data files, a ``.csv`` or ``.arrow`` file).

    data:
      path: data/gsm8k_saved          # Dataset.save_to_disk(...) or DatasetDict.save_to_disk(...)
      split: train                     # which split of a DatasetDict / of load_dataset's result

Rows are read as plain Python objects (nested features become dicts and lists) and then checked like jsonl
rows; ``where`` is ``path:row N`` (1-based within the split). Only local data: nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlrun.data.errors import PromptDataError

_FILE_BUILDERS = {".csv": "csv", ".arrow": "arrow"}
_SAVED_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")


def is_datasets_source(path: Path) -> bool:
    """Whether ``path`` is read with ``datasets`` (a directory, or a file type only ``datasets`` reads)."""
    return path.is_dir() or path.suffix in _FILE_BUILDERS


def datasets_rows(path: Path, select: Callable[[int], range], split: str) -> list[tuple[str, Any]]:
    """``(where, row)`` for the rows ``select(num_rows)`` picks out of ``split`` of the dataset at ``path``."""
    try:
        import datasets
    except ImportError:
        raise PromptDataError(
            f"{path}: reading a directory or {'/'.join(_FILE_BUILDERS)} file needs the datasets package; "
            "pip install datasets (or rlrun[datasets]), or convert the data to .jsonl / .parquet"
        ) from None
    table = _load(datasets, path, split)
    selected = select(len(table))
    rows = table.select(selected) if selected else []
    return [(f"{path}:row {selected.start + i + 1}", row) for i, row in enumerate(rows)]


def _load(datasets, path: Path, split: str):
    saved = path.is_dir() and any((path / name).is_file() for name in _SAVED_MARKERS)
    try:
        if saved:
            loaded = datasets.load_from_disk(str(path))
        elif path.is_dir():
            loaded = datasets.load_dataset(str(path))
        else:
            loaded = datasets.load_dataset(_FILE_BUILDERS[path.suffix], data_files=str(path))
    except Exception as err:  # noqa: BLE001 - datasets raises many types for unreadable data
        raise PromptDataError(f"{path}: datasets could not read it ({type(err).__name__}: {err})") from None
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded
    if split not in loaded:
        raise PromptDataError(
            f"{path}: data.split ({split}) must name one of the dataset's splits ({sorted(loaded)}); set data.split"
        )
    return loaded[split]
