"""A data source (``data.sampler``) that draws the rows of each data source in turn, so a mixture stays
balanced whatever the sources' sizes (``data.source_key``'s values; rows without one form their own)::

    data:
      sampler: examples/hooks/sources.py:round_robin

Each source's rows are shuffled once per pass with ``seed`` (when ``shuffle``); ``state_dict`` is the
cursor, so a resumed run draws exactly what the original would have. Interface: rlrun/data/source.py.
"""

from __future__ import annotations

import random
from typing import Any

SOURCE_KEY = "source"


class RoundRobin:
    """Prompt k comes from source ``k % num_sources`` (sources in name order), each source cycling through
    its rows."""

    def __init__(self, dataset, seed: int, shuffle: bool) -> None:
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        by_source: dict[str, list[int]] = {}
        for i, prompt in enumerate(dataset.prompts):
            by_source.setdefault(str(prompt.metadata.get(SOURCE_KEY, "")), []).append(i)
        self.sources = [by_source[name] for name in sorted(by_source)]
        self.drawn = 0

    def _row(self, k: int) -> int:
        rows = self.sources[k % len(self.sources)]
        lap, at = divmod(k // len(self.sources), len(rows))
        order = list(rows)
        if self.shuffle:
            random.Random(self.seed * 7919 + lap).shuffle(order)
        return order[at]

    def next_batch(self, n: int) -> list:
        batch = [self.dataset[self._row(k)] for k in range(self.drawn, self.drawn + n)]
        self.drawn += n
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn, "num_prompts": len(self.dataset), "fingerprint": self.dataset.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["num_prompts"], state["fingerprint"]) != (len(self.dataset), self.dataset.fingerprint):
            raise ValueError("data.sampler state is of other data; resume with the checkpointed run's data.path")
        self.drawn = state["drawn"]


def round_robin(dataset, seed: int, shuffle: bool) -> RoundRobin:
    return RoundRobin(dataset, seed, shuffle)
