"""Reloadable process groups (rlrun/runtime/reloadable_groups.py) on real 2-process gloo worlds.

On the GPU the mechanism acts on NCCL groups; here ``reloadable_backends=("gloo",)`` makes it act on
Megatron's gloo groups, so destroy and rebuild run for real. One process trains two fresh models from the
same weights: two steps untouched (the reference), then one step, every reloadable group destroyed and
rebuilt, and a second step; both must end with the same losses, grad norms and weights.
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
    facts = {"destroyed": reloadable_groups.destroy_all(), "errors": []}
    for collective in (lambda g: dist.all_reduce(torch.ones(1), group=g), lambda g: dist.barrier(group=g)):
        try:
            collective(mpu.get_data_parallel_group())
        except RuntimeError as exc:
            facts["errors"].append(str(exc))
    facts["tp_size_asleep"] = mpu.get_tensor_model_parallel_world_size()
    facts["rebuilt"] = reloadable_groups.rebuild_all()
    facts.update(
        wrapped=all(isinstance(g, reloadable_groups.ReloadableGroup) for g in before),
        same_objects=all(a is b for a, b in zip(before, held(), strict=False)),
        inner_new=all(g.inner is not old for g, old in zip(wrappers, old_inner, strict=False)),
        one_rank_groups=sum(g.size() == 1 for g in wrappers),
        groups=len(wrappers),
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
        assert facts["wrapped"] and facts["same_objects"] and facts["inner_new"], facts
        assert facts["destroyed"] == facts["rebuilt"] == facts["groups"] > 0
        assert facts["one_rank_groups"] > 0  # e.g. the PP group at pp=1: one-rank groups are torn down too
        assert facts["tp_size_asleep"] == tp  # sizes stay answerable while the communicators are gone
        assert len(facts["errors"]) == 2 and all("destroyed" in e and "rebuild_all" in e for e in facts["errors"])
        assert ref["stats"][0]["loss"] != pytest.approx(ref["stats"][1]["loss"])  # the second step sees new weights
        for got, want in zip(torn["stats"], ref["stats"], strict=False):
            assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
        for name, tensor in ref["weights"].items():
            torch.testing.assert_close(torn["weights"][name], tensor, rtol=0, atol=0, msg=name)


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
