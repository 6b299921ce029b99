"""When a sleeping trainer keeps torch's cached blocks (``offload.release_cache``): the rule against hand-worked
cases; that option's and ``offload.optimizer_copy``'s defaults and choices."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlrun.config.schema import OffloadConfig
from rlrun.trainer.offload import keeps_cache


@pytest.mark.parametrize(
    "free_gb,growth_gb,margin_gb,kept",
    [
        (80.0, None, 1.0, False),  # no rollout measured yet: always released
        (80.0, 42.0, 1.0, True),  # 42 * 1.1 + 1 = 47.2 <= 80
        (47.25, 42.0, 1.0, True),
        (47.15, 42.0, 1.0, False),
        (47.1, 42.0, 0.0, True),  # 46.2 <= 47.1
        (0.5, 0.0, 1.0, False),  # the margin alone must fit
    ],
)
def test_the_cache_stays_only_where_the_last_rollout_fits_beside_it(free_gb, growth_gb, margin_gb, kept):
    assert keeps_cache(free_gb, growth_gb, margin_gb) is kept


def test_offload_choices_default_to_the_fast_paths_and_refuse_other_values():
    assert OffloadConfig().release_cache == "when_needed"
    assert OffloadConfig(release_cache="always").release_cache == "always"
    assert OffloadConfig().optimizer_copy == "overlapped"
    assert OffloadConfig(optimizer_copy="with_weights").optimizer_copy == "with_weights"
    for field in ("release_cache", "optimizer_copy"):
        with pytest.raises(ValidationError, match=field):
            OffloadConfig(**{field: "never"})
