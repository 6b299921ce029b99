"""The watchdog's torchrun-agent check (rlrun/runtime/watchdog.py): a rank whose agent is gone publishes that as
the run's failure, naming the node and the rank, so every other node's ranks and agents end too."""

from __future__ import annotations

import os

import torch.distributed as dist

from rlrun.runtime import watchdog as wd
from rlrun.runtime.dist import free_port


def test_a_rank_whose_agent_is_gone_publishes_it(monkeypatch):
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    dog = wd.Watchdog(wd.PeerInfo(2, os.getpid(), "node-b"), 1, server, f"127.0.0.1:{port}", "t/")
    assert dog._tick() is None  # not under torchrun: nothing to watch

    dog._agent_pid = os.getppid()
    assert dog._tick() is None  # the agent that started it is still its parent

    monkeypatch.setenv("GROUP_RANK", "1")
    dog._agent_pid = os.getppid() + 100000  # the parent now is someone else: the agent died
    dog.step = 5
    verdict = dog._tick()
    assert verdict == (
        f"the torchrun agent of node 1 (pid {os.getppid() + 100000} on node-b) is gone, leaving rank 2 "
        f"(pid {os.getpid()} on node-b) without its node at step 5 (setup): the node died or its agent was killed"
    )
    assert server.get("t/abort").decode() == verdict  # published: every rank reads it and exits
