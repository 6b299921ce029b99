"""Reloadable process groups (rlrun/runtime/reloadable_groups.py) on real 2-process gloo worlds.

On the GPU the mechanism acts on NCCL groups; here ``reloadable_backends=("gloo",)`` makes it act on
Megatron's gloo groups, so destroy and rebuild run for real. One process trains two fresh models from the
same weights: two steps untouched (the reference), then one step, every reloadable group of more than one
rank destroyed and rebuilt (one-rank groups answer their collectives themselves and keep their real group),
and a second step; both must end with the same losses, grad norms and weights.
"""

from __future__ import annotations

import pytest
import torch
from test_megatron_train import OPTIM, TEMPERATURE, MicroBatch, make_batch, pg_loss

from dist_utils import run_distributed

pytestmark = pytest.mark.slow


def _destroy_and_rebuild() -> dict:
    """Destroy every reloadable group, try collectives on one, rebuild; facts about what happened."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from rlrun.runtime import reloadable_groups

    def held():
        return [
            mpu.get_tensor_model_parallel_group(),
            mpu.get_data_parallel_group(),
            mpu.get_model_parallel_group(),
            mpu.get_pipeline_model_parallel_group(),
        ]

    before, wrappers = held(), reloadable_groups.groups()
    old_inner = [group.inner for group in wrappers]
    two_ranks = next(g for g in before if g.size() > 1)  # the TP group at tp=2, the DP group at dp=2
    facts = {"destroyed": reloadable_groups.destroy_all(), "errors": []}
    for collective in (lambda g: dist.all_reduce(torch.ones(1), group=g), lambda g: dist.barrier(group=g)):
        try:
            collective(two_ranks)
        except RuntimeError as exc:
            facts["errors"].append(str(exc))
    facts["tp_size_asleep"] = mpu.get_tensor_model_parallel_world_size()
    facts["rebuilt"] = reloadable_groups.rebuild_all()
    renewed = [g.inner is not old for g, old in zip(wrappers, old_inner, strict=True)]
    facts.update(
        wrapped=all(isinstance(g, reloadable_groups.ReloadableGroup) for g in before),
        same_objects=all(a is b for a, b in zip(before, held(), strict=False)),
        renewed_are_the_multi_rank=renewed == [g.size() > 1 for g in wrappers],
        multi_rank_groups=sum(g.size() > 1 for g in wrappers),
        one_rank_groups=sum(g.size() == 1 for g in wrappers),
        # the first step ran every gradient and norm reduction of Megatron's: none reached a one-rank real group
        one_rank_with_communicator=reloadable_groups.one_rank_groups_with_communicator(),
    )
    return facts


def _worker(hf_dir: str, tp: int, batch: MicroBatch) -> dict:
    from rlrun.megatron import build_model, export_hf_weights, make_optimizer, train_step
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp=tp, pp=1, seed=0, reloadable_backends=("gloo",))
    rows = batch.tokens.shape[0] // parallel.dp_size
    local = batch.rows(parallel.dp_rank * rows, (parallel.dp_rank + 1) * rows)
    num_global_tokens = int(batch.loss_mask.sum())

    def two_steps(teardown: bool) -> dict:
        model = build_model(hf_dir, parallel, dtype="float32")
        optimizer = make_optimizer(model, **OPTIM)
        stats = [train_step(model, optimizer, [local], pg_loss, num_global_tokens, TEMPERATURE)]
        facts = _destroy_and_rebuild() if teardown else {}
        stats.append(train_step(model, optimizer, [local], pg_loss, num_global_tokens, TEMPERATURE))
        return {"stats": stats, "weights": {k: v.clone() for k, v in export_hf_weights(model)}, "facts": facts}

    out = {"reference": two_steps(False), "teardown": two_steps(True)}
    destroy_distributed()
    return out


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_teardown_and_rebuild_keeps_training_identical(tp, tiny_model_dirs):
    from rlrun.megatron.hf_config import ModelArch

    hf_dir = str(tiny_model_dirs["llama"])
    batch = make_batch(ModelArch.from_hf_dir(hf_dir).vocab_size)
    for result in run_distributed(_worker, 2, hf_dir, tp, batch, all_ranks=True):
        ref, torn = result["reference"], result["teardown"]
        facts = torn["facts"]
        assert facts["wrapped"] and facts["same_objects"] and facts["renewed_are_the_multi_rank"], facts
        assert facts["destroyed"] == facts["rebuilt"] == facts["multi_rank_groups"] > 0
        assert facts["one_rank_groups"] > 0 and facts["one_rank_with_communicator"] == 0, facts  # e.g. PP at pp=1
        assert facts["tp_size_asleep"] == tp  # sizes stay answerable while the communicators are gone
        assert len(facts["errors"]) == 2 and all("destroyed" in e and "rebuild_all" in e for e in facts["errors"])
        assert ref["stats"][0]["loss"] != pytest.approx(ref["stats"][1]["loss"])  # the second step sees new weights
        for got, want in zip(torn["stats"], ref["stats"], strict=False):
            assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
        for name, tensor in ref["weights"].items():
            torch.testing.assert_close(torn["weights"][name], tensor, rtol=0, atol=0, msg=name)


def _one_rank_world_worker(hf_dir: str, batch: MicroBatch, distributed_optimizer: bool) -> dict:
    """Two steps on one rank with plain groups, then from the same weights with reloadable ones, where every
    group has one rank and the wrappers answer all of Megatron's collectives."""
    from rlrun.megatron import build_model, export_hf_weights, make_optimizer, train_step
    from rlrun.runtime import reloadable_groups
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    out = {}
    for name, backends in (("plain", ()), ("wrapped", ("gloo",))):
        parallel = init_distributed(tp=1, pp=1, seed=0, reloadable_backends=backends)
        model = build_model(hf_dir, parallel, dtype="float32", distributed_optimizer=distributed_optimizer)
        optimizer = make_optimizer(model, **OPTIM)
        num_global_tokens = int(batch.loss_mask.sum())
        stats = [train_step(model, optimizer, [batch], pg_loss, num_global_tokens, TEMPERATURE) for _ in range(2)]
        out[name] = {
            "stats": stats,
            "weights": {k: v.clone() for k, v in export_hf_weights(model)},
            "groups": len(reloadable_groups.groups()),
            "with_communicator": reloadable_groups.one_rank_groups_with_communicator(),
        }
        destroy_distributed()
    return out


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["adam", "distributed_adam"])
def test_one_rank_world_trains_as_with_plain_groups(distributed_optimizer, tiny_model_dirs):
    """On one GPU every Megatron group has one rank: training with the wrappers answering the gradient reduction,
    the norm and (with the distributed optimizer) the parameter gather must match plain groups exactly."""
    from rlrun.megatron.hf_config import ModelArch

    hf_dir = str(tiny_model_dirs["llama"])
    batch = make_batch(ModelArch.from_hf_dir(hf_dir).vocab_size)
    out = run_distributed(_one_rank_world_worker, 1, hf_dir, batch, distributed_optimizer)
    plain, wrapped = out["plain"], out["wrapped"]
    assert plain["groups"] == 0 and wrapped["groups"] > 0 and wrapped["with_communicator"] == 0, wrapped
    assert plain["stats"][0]["loss"] != pytest.approx(plain["stats"][1]["loss"])
    assert wrapped["stats"] == plain["stats"]
    for name, tensor in plain["weights"].items():
        torch.testing.assert_close(wrapped["weights"][name], tensor, rtol=0, atol=0, msg=name)


def _plain_worker() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from rlrun.runtime import reloadable_groups
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    def tp_group_type(**kwargs) -> str:
        init_distributed(tp=1, pp=1, seed=0, **kwargs)
        name = f"{type(mpu.get_tensor_model_parallel_group()).__name__}/{len(reloadable_groups.groups())}"
        destroy_distributed()
        return name

    out = {
        "without_offload": tp_group_type(),
        "patched_without_offload": dist.new_group is not reloadable_groups._original_new_group,
        "offload_train_on_cpu": tp_group_type(reloadable_backends=("nccl",)),
        "gloo": tp_group_type(reloadable_backends=("gloo",)),
    }
    out["next_world_without_offload"] = tp_group_type()  # the gloo world's record must not leak into it
    return out


def test_cpu_path_is_untouched():
    """No offload: torch's new_group and plain groups. offload.train on CPU asks for NCCL groups only,
    and a CPU world has none, so nothing is wrapped."""
    from rlrun.config.schema import OffloadConfig

    assert OffloadConfig().reloadable_backends == ()
    assert OffloadConfig(train=True).reloadable_backends == ("nccl",)
    assert OffloadConfig(train=True, teardown_nccl=False).reloadable_backends == ()
    out = run_distributed(_plain_worker, 1)
    assert out.pop("gloo").startswith("ReloadableGroup/")  # the same calls do wrap when asked for gloo
    assert out == {
        "without_offload": "ProcessGroup/0",
        "patched_without_offload": False,
        "offload_train_on_cpu": "ProcessGroup/0",
        "next_world_without_offload": "ProcessGroup/0",
    }


def test_backend_names_of_per_device_backends():
    """A default group of ``cpu:gloo,cuda:nccl`` makes Megatron's backend=None groups NCCL on CUDA too."""
    from rlrun.runtime.reloadable_groups import backend_names

    assert backend_names("nccl") == {"nccl"}
    assert backend_names("cpu:gloo,cuda:nccl") == {"gloo", "nccl"}
    assert backend_names("GLOO") == {"gloo"}


def _one_rank_ops_worker() -> dict:
    """Every collective Megatron and torch's coalescing manager issue, on a reloadable one-rank gloo group and on
    a plain one (the reference): their results, and whether the wrapped group's real group saw a collective."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    from rlrun.runtime import reloadable_groups
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    init_distributed(tp=1, pp=1, seed=0, reloadable_backends=("gloo",))
    wrapped = dist.new_group([0])
    plain = reloadable_groups._original_new_group([0])
    source = torch.arange(6, dtype=torch.float32) + 1

    def run(group) -> dict[str, torch.Tensor]:
        out = {}
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
            out[f"all_reduce_{op}"] = source.clone()
            dist.all_reduce(out[f"all_reduce_{op}"], op=op, group=group)
        out["all_reduce_async"] = source.clone()
        work = dist.all_reduce(out["all_reduce_async"], group=group, async_op=True)
        work.wait()
        out["broadcast"] = source.clone()
        dist.broadcast(out["broadcast"], src=0, group=group)
        dist.barrier(group=group)
        gathered = [torch.zeros(6)]
        dist.all_gather(gathered, source, group=group)
        out["all_gather"] = gathered[0]
        out["all_gather_into_tensor"] = torch.zeros(2, 3)
        dist.all_gather_into_tensor(out["all_gather_into_tensor"], source.view(2, 3), group=group)
        buckets = [source.clone(), 2 * source.clone()]  # Megatron's gradient reduction: coalesced, async
        with _coalescing_manager(group, async_ops=True) as cm:
            for bucket in buckets:
                dist.all_reduce(bucket, group=group, async_op=True)
        cm.wait()
        out["coalesced_all_reduce"] = torch.cat(buckets)
        shards = [torch.zeros(6), torch.zeros(6)]  # Megatron's parameter gather with the distributed optimizer
        with _coalescing_manager(group, async_ops=False):
            for shard, whole in zip(shards, (source, 3 * source), strict=True):
                dist.all_gather_into_tensor(shard, whole, group=group)
        out["coalesced_all_gather"] = torch.cat(shards)
        return out

    facts = {"plain": run(plain), "wrapped": run(wrapped)}
    facts["real_group_collectives"] = wrapped.inner._get_sequence_number_for_group()
    facts["with_communicator_before"] = reloadable_groups.one_rank_groups_with_communicator()
    facts["destroyed"] = reloadable_groups.destroy_all()
    facts["answers_while_asleep"] = source.clone()
    dist.all_reduce(facts["answers_while_asleep"], group=wrapped)
    facts["rebuilt"] = reloadable_groups.rebuild_all()
    swapped = torch.zeros(6)  # not answered here: goes to the real group, which now has run a collective
    dist.all_to_all_single(swapped, source, group=wrapped)
    facts["forwarded"] = swapped
    facts["with_communicator_after"] = reloadable_groups.one_rank_groups_with_communicator()
    destroy_distributed()
    return facts


def test_one_rank_groups_answer_collectives_without_their_real_group():
    """A one-rank group's collectives are the identity or a copy: answered by the wrapper with the plain group's
    results and nothing run on its real group (so NCCL would never create its communicator), also while the
    trainer sleeps; it is not torn down; an unanswered collective still works and is counted."""
    facts = run_distributed(_one_rank_ops_worker, 1)
    assert facts["plain"].keys() == facts["wrapped"].keys()
    for name, want in facts["plain"].items():
        torch.testing.assert_close(facts["wrapped"][name], want, rtol=0, atol=0, msg=name)
    source = torch.arange(6, dtype=torch.float32) + 1
    torch.testing.assert_close(facts["wrapped"]["all_gather_into_tensor"], source.view(2, 3))
    torch.testing.assert_close(facts["wrapped"]["coalesced_all_gather"], torch.cat([source, 3 * source]))
    assert facts["real_group_collectives"] == 0 and facts["with_communicator_before"] == 0
    assert facts["destroyed"] == facts["rebuilt"] == 0  # one rank: nothing to tear down
    torch.testing.assert_close(facts["answers_while_asleep"], source)
    torch.testing.assert_close(facts["forwarded"], source)
    assert facts["with_communicator_after"] == 1
