"""Reward metrics of multi-task data: each dict-reward key's mean, and the reward per data source.

``prefix/reward/<key>`` is the mean of a dict reward's ``<key>`` over the samples that returned one;
``prefix/source/<source>/reward`` (and ``.../reward/<key>``) the same over the samples whose row's
metadata names ``<source>`` under ``data.source_key``. Samples without a source are left out of the
per-source means only. Names in docs/metrics.md.
"""

from __future__ import annotations

from collections import defaultdict

from rlrun.data.sample import Sample


def reward_breakdown(samples: list[Sample], source_key: str, prefix: str) -> dict[str, float]:
    out = _component_means(samples, f"{prefix}/reward")
    by_source: dict[str, list[Sample]] = defaultdict(list)
    for sample in samples:
        source = sample.prompt.metadata.get(source_key)
        if source is not None:
            by_source[str(source)].append(sample)
    for source, group in sorted(by_source.items()):
        out[f"{prefix}/source/{source}/reward"] = sum(s.reward for s in group) / len(group)
        out.update(_component_means(group, f"{prefix}/source/{source}/reward"))
    return out


def _component_means(samples: list[Sample], prefix: str) -> dict[str, float]:
    values: dict[str, list[float]] = defaultdict(list)
    for sample in samples:
        for key, value in (sample.reward_components or {}).items():
            values[key].append(value)
    return {f"{prefix}/{key}": sum(v) / len(v) for key, v in sorted(values.items())}
