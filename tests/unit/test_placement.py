"""Disaggregated placement's parts on CPU: the link between training rank 0 and the engine ranks (real gloo
process groups on a real TCPStore, 4 processes), the rank split, the engine groups of engine ranks and their
share of a round, the weight broadcast's backend, and the config refusals."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from dist_utils import run_distributed
from minimal_config import run_config
from rlrun.rollout.engine_rank import engine_layout
from rlrun.runtime.dist import DistEnv
from rlrun.runtime.placement import Link, is_engine_rank, num_training_ranks, weights_backend
from rlrun.trainer.placement import engine_calls, engine_of

BUCKET_BYTES = 64


def tensors() -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and odd sizes (a bf16 tensor after a 3-byte one lands at an odd offset of its bucket), one
    tensor larger than a bucket, a scalar and an empty one."""
    g = torch.Generator().manual_seed(0)
    return [
        ("a.bool", torch.tensor([True, False, True])),
        ("b.bf16", torch.randn(5, 3, generator=g).to(torch.bfloat16)),
        ("c.f32.big", torch.randn(40, generator=g)),  # 160 bytes > BUCKET_BYTES: a bucket of its own
        ("d.i64", torch.arange(3)),
        ("e.scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("f.empty", torch.empty(0, 4)),
    ]


def link_roundtrip() -> list:
    """Rank 1 is a training rank outside the link; ranks 2-3 are engine ranks. Rank 0 sends each engine rank a
    message and broadcasts the weights; each engine rank returns what it received."""
    env = DistEnv.from_env()
    server = None
    if env.rank == 0:  # torchrun's agent hosts this store in a real job
        server = torch.distributed.TCPStore("127.0.0.1", env.master_port, is_master=True, wait_for_workers=False)
    if env.rank == 1:
        return []
    link = Link.open(env, 2, torch.device("cpu"))
    if link.rank == 0:
        for dst in (1, 2):
            link.send(("hello", dst, list(range(dst))), dst)
        link.send_weights(iter(tensors()), BUCKET_BYTES)
        replies = [link.recv(dst) for dst in (1, 2)]
        del server
        return replies
    message = link.recv(0)
    received = [(name, t.clone()) for name, t in link.recv_weights()]
    link.send("done", 0)
    return [message, received]


def test_link_carries_messages_and_weights_exactly():
    results = run_distributed(link_roundtrip, 4, all_ranks=True, timeout_s=120)
    assert results[0] == ["done", "done"] and results[1] == []
    for engine, result in enumerate(results[2:]):
        message, received = result
        assert message == ("hello", 1 + engine, list(range(1 + engine)))
        sent = tensors()
        assert [name for name, _ in received] == [name for name, _ in sent]
        for (name, got), (_, want) in zip(received, sent, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got, want), name


def test_the_last_ranks_are_engine_ranks():
    env = DistEnv(rank=2, local_rank=2, world_size=3, local_world_size=3, master_addr="x", master_port=1)
    assert num_training_ranks(env, 1) == 2 and is_engine_rank(env, 1)
    assert not is_engine_rank(env, 0)
    assert not is_engine_rank(DistEnv(1, 1, 3, 3, "x", 1), 1)
    with pytest.raises(ValueError, match=r"placement.engine_ranks \(3\) must be smaller than the number of processes"):
        num_training_ranks(env, 3)


def test_engine_ranks_form_engine_groups_of_engine_tp_on_one_host():
    """1 training + 4 engine ranks on one host, engine.tp 2: engine ranks 0-1 and 2-3 (torchrun ranks 1-2, 3-4)
    form the groups, numbered in the engine ranks' own world, with the leader's GPU as ``base_gpu_id``."""
    layouts = [engine_layout(DistEnv(r, r, 5, 5, "x", 1), 4, 2) for r in range(1, 5)]
    assert [(lay.rank, lay.leader, lay.local_leader, lay.rank_offset) for lay in layouts] == [
        (0, 0, 1, 1),
        (1, 0, 1, 1),
        (2, 2, 3, 1),
        (3, 2, 3, 1),
    ]
    assert layouts[0].all_groups() == [[0, 1], [2, 3]]
    # 2 hosts of 3 ranks, 2 training ranks: engine ranks 0-1 are torchrun ranks 2 (host 0) and 3 (host 1)
    with pytest.raises(
        ValueError, match=r"engine.tp \(2\) groups torchrun ranks 2..3 into one engine, which would span"
    ):
        engine_layout(DistEnv(3, 0, 6, 3, "x", 1), 4, 2)


def test_a_round_goes_to_engine_groups_as_colocated_engine_groups_call_their_engines():
    """Each colocated rank's share and seed: tp consecutive shares make one call with the first share's seed
    (the colocated group leader's call), and each engine group serves a contiguous run of calls."""
    shares = [([f"p{s}a", f"p{s}b"], 100 + s) for s in range(4)]
    assert engine_calls(shares, 1) == shares
    assert engine_calls(shares, 2) == [(["p0a", "p0b", "p1a", "p1b"], 100), (["p2a", "p2b", "p3a", "p3b"], 102)]
    assert [engine_of(c, 4, 2) for c in range(4)] == [0, 0, 1, 1]
    assert [engine_of(c, 2, 2) for c in range(2)] == [0, 1]


def test_weights_travel_over_nccl_between_gpus_and_gloo_on_cpu():
    assert weights_backend(torch.device("cuda", 1)) == "nccl"
    assert weights_backend(torch.device("cpu")) == "gloo"


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"engine": {"tp": 2}},
            r"engine.tp \(2\) must divide placement.engine_ranks \(1\) because every engine rank belongs",
        ),
        ({"offload": {"colocate": True}}, r"offload.train / offload.rollout / offload.colocate \(True\) must be off"),
        ({"rollout": {"partial_rollout": True}}, r"rollout.partial_rollout / rollout.abort_surplus \(True\)"),
    ],
)
def test_unsupported_combinations_are_refused_at_load(sections, message):
    with pytest.raises(ValidationError, match=message):
        run_config({"placement": {"engine_ranks": 1}, **sections})


def test_engine_ranks_default_to_colocated_and_accept_staleness():
    assert run_config().placement.engine_ranks == 0
    assert run_config({"placement": {"engine_ranks": 4}, "engine": {"tp": 2}}).engine.tp == 2
    cfg = run_config({"placement": {"engine_ranks": 2}, "rollout": {"max_staleness": 1}})
    assert cfg.placement.engine_ranks == 2 and cfg.rollout.max_staleness == 1


def test_engine_ranks_restart_their_workers_where_colocated_ranks_would():
    """engine.max_restarts loads with engine ranks at K = 0 and K = 1, as without them."""
    cfg = run_config({"placement": {"engine_ranks": 1}, "engine": {"max_restarts": 1}})
    assert cfg.engine.max_restarts == 1
    cfg = run_config({"placement": {"engine_ranks": 1}, "engine": {"max_restarts": 1}, "rollout": {"max_staleness": 1}})
    assert cfg.engine.max_restarts == 1
