"""The torchrun environment and the layout check of init_distributed (no process groups started)."""

from __future__ import annotations

import pytest

from rlrun.runtime.dist import DistEnv, init_distributed

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_torchrun_variables_are_read(monkeypatch):
    env = dict(RANK="5", LOCAL_RANK="1", WORLD_SIZE="8", LOCAL_WORLD_SIZE="4", MASTER_ADDR="node0", MASTER_PORT="29511")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert DistEnv.from_env() == DistEnv(5, 1, 8, 4, "node0", 29511)


def test_without_torchrun_is_one_process_on_a_free_port(monkeypatch):
    for key in TORCHRUN_VARS:
        monkeypatch.delenv(key, raising=False)
    env = DistEnv.from_env()
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (0, 0, 1, 1)
    assert 0 < env.master_port < 65536


def test_world_size_not_divisible_by_tp_pp_is_refused(monkeypatch):
    for key, value in dict(RANK="0", WORLD_SIZE="6", MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"world_size \(6\) must be divisible by tp\*pp\*cp \(4\*1\*1\)"):
        init_distributed(tp=4, pp=1, seed=0)
