"""Megatron distributed checkpoints of one model: weights, optimizer, LR scheduler and RNG states.

The format is ``megatron.core.dist_checkpointing``'s ``torch_dist``: every tensor is stored once under a
global key with its global shape, and each rank's TP shard or DP slice is described by offsets and
replica ids. So a checkpoint written at one data-parallel size loads at another (the optimizer state
is the parameters' own sharded form: Adam moments and fp32 main weights; the distributed optimizer's
is its DP-reshardable bucket form, see ``OPTIMIZER_METADATA``). TP and PP must match the saving run
because the vocabulary padding, and with it the embedding's global shape, depends on TP (and the
distributed optimizer's buckets on both); :func:`load` checks every global shape first and says so
instead of failing inside the reader.

Writing: Megatron's torch_dist writer forks one process per file and collects their results through a
``multiprocessing.Manager``; neither works in a daemonic process (tests), and forking a rank that
holds communicator threads is fragile. :func:`start_save` instead runs Megatron's collective planning
on the calling thread (``async_sharded_save=True`` returns the plan without writing) and copies every
tensor to host memory; :meth:`PendingSave.write` then writes the files in this process (on any
thread), and :meth:`PendingSave.finish` (collective again) gathers the write results and lets rank 0
write the metadata. A directory without that metadata is not a loadable checkpoint.

RNG states are saved although the loop seeds its sampling per step: dropout (off today), user reward
functions and Megatron's model-parallel RNG tracker draw from them. They are per rank, so they come
back only on the layout that saved them.
"""

from __future__ import annotations

import queue
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlrun.megatron.model import MegatronModel
from rlrun.megatron.train import adam_step, optimizer_parts

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

RNG_KEY = "rng_state"
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
"""The distributed optimizer's checkpoint form: its buckets as they are, re-sliced on load for another DP
size (Megatron 0.16's default, ``fully_sharded_model_space``, needs flattened ShardedTensors it no longer
accepts). The other optimizers ignore it."""


@dataclass
class PendingSave:
    """A planned save into ``directory``: host copies of this rank's tensors, waiting to be written."""

    directory: Path
    request: AsyncRequest
    buckets: list = field(default_factory=list)
    results: queue.Queue = field(default_factory=queue.Queue)

    def write(self) -> None:
        """Write this rank's files (no communication: may run on a background thread)."""
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        if self.request.async_fn is None:  # nothing of this rank's is the main replica
            return
        transforms = self.request.async_fn.args[0]
        local: queue.Queue = queue.Queue()
        done: queue.Queue = queue.Queue()
        written = {}
        for index, bucket in enumerate(self.buckets):
            done.put(index)
            FileSystemWriterAsync.write_preloaded_data(transforms, index, bucket, local, done, True)
            index, result = local.get()
            if isinstance(result, Exception):
                raise RuntimeError(f"could not write checkpoint file {bucket[0]}") from result
            written[index] = result
        self.results.put(written)

    def finish(self) -> None:
        """Collective: every rank has written; rank 0 records the global metadata."""
        for fn in self.request.finalize_fns:
            fn()


def start_save(state: dict[str, Any], directory: Path) -> PendingSave:
    """Collective: plan the save of ``state`` (from :func:`training_state`) into the empty ``directory``
    and copy this rank's tensors to host memory, so training may change them from now on."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    results: queue.Queue = queue.Queue()
    # The writer takes its result queue from this module global (a Manager queue by default); an
    # in-process queue per save keeps the results of two saves apart and starts no helper process.
    filesystem_async._results_queue = results
    request = dist_checkpointing.save(state, str(directory), async_sharded_save=True)
    buckets = []
    if request.async_fn is not None:
        _, write_buckets, _ = request.async_fn_args
        for path, storage_key, (byte_items, tensor_items) in write_buckets:
            host = [(item, tensor.detach().to("cpu", copy=True)) for item, tensor in tensor_items]
            buckets.append((path, storage_key, (byte_items, host)))
    return PendingSave(directory=directory, request=request, buckets=buckets, results=results)


def training_state(
    model: MegatronModel,
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    with_rng: bool,
    for_loading: bool = False,
) -> dict[str, Any]:
    """The sharded state dict of ``model`` (and of ``optimizer``, ``scheduler`` and this rank's RNGs when
    given), as :func:`start_save` writes it and :func:`load` fills it."""
    model_state = _model_sharded_state(model)
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        if for_loading and model.ddp.ddp_config.use_distributed_optimizer:
            _init_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state, is_loading=for_loading, metadata=OPTIMIZER_METADATA
        )
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng"] = _rng_object(model)
    return state


def _model_sharded_state(model: MegatronModel) -> dict[str, Any]:
    """The model's sharded state dict. A value model (rlrun/megatron/value_head.py) replaced the LM head that
    Megatron's LanguageModule expects to tie or pad, so its state skips that step (the generic module walk)."""
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    module = model.module
    head = getattr(module, "output_layer", None)
    if head is None or hasattr(head, "weight"):
        return module.sharded_state_dict()
    return MegatronModule.sharded_state_dict(module, "", (), ensure_metadata_has_dp_cp_group(None))


@torch.no_grad()  # the distributed optimizer's fp32 main weights are views of the parameters
def load(
    model: MegatronModel,
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    directory: Path,
    with_rng: bool,
) -> None:
    """Collective: fill the model (and the optimizer, scheduler and RNGs when given) from ``directory``."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    state = training_state(model, optimizer, None, with_rng=with_rng, for_loading=True)
    check_shapes(state["model"], directory, state.get("optimizer"))
    try:
        loaded = dist_checkpointing.load(state, str(directory))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - re-raised with the path and what to do
        raise RuntimeError(
            f"checkpoint {directory} must be readable because the run starts from it, but Megatron's "
            f"reader failed ({type(exc).__name__}: {exc}); the files are damaged or incomplete: pick "
            f"another checkpoint (checkpoint.resume=PATH) or start fresh (checkpoint.resume=none)"
        ) from exc
    load_model_shard(model, loaded["model"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
        if model.ddp.ddp_config.use_distributed_optimizer:
            _restore_adam_steps(optimizer, loaded["optimizer"], directory)
    if scheduler is not None:
        if "scheduler" not in loaded:
            raise ValueError(
                f"checkpoint {directory} has no LR scheduler state although it has optimizer state; "
                f"it was written by an older rlrun: set checkpoint.resume=none to start fresh"
            )
        scheduler.load_state_dict(loaded["scheduler"])
    if with_rng:
        _set_rng_state(loaded["rng"])


def check_shapes(model_state: dict[str, Any], directory: Path, optimizer_state: dict[str, Any] | None = None) -> None:
    """Raise, naming the first difference, unless ``directory`` holds every model tensor at its global shape (and,
    given ``optimizer_state``, every optimizer tensor it reads: :func:`_check_optimizer_keys`)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    if not (directory / "metadata.json").is_file() or not (directory / ".metadata").is_file():
        raise ValueError(
            f"checkpoint {directory} must hold a Megatron distributed checkpoint (metadata.json and "
            f".metadata) because its model is loaded from there; the save did not finish or the "
            f"directory is not a checkpoint: pick another one"
        )
    saved = dist_checkpointing.load_tensors_metadata(str(directory))
    for tensor in nested_values(model_state):
        if not isinstance(tensor, ShardedTensor):
            continue
        if tensor.key not in saved:
            raise ValueError(
                f"checkpoint {directory} must hold model tensor {tensor.key} because the model built "
                f"from model.path has it; use the model.path the checkpoint was written with"
            )
        if tuple(saved[tensor.key].global_shape) != tuple(tensor.global_shape):
            raise ValueError(
                f"checkpoint {directory} tensor {tensor.key} has global shape {tuple(saved[tensor.key].global_shape)} "
                f"but this model's is {tuple(tensor.global_shape)}; the vocabulary padding depends on parallel.tp, so "
                f"load with the tp (and pp) the checkpoint was written with, and the same model.path"
            )
    if optimizer_state is not None:
        _check_optimizer_keys(optimizer_state, saved, directory)


def _check_optimizer_keys(optimizer_state: dict[str, Any], saved: dict[str, Any], directory: Path) -> None:
    """Raise, naming a missing key, unless the checkpoint's tensors ``saved`` hold every optimizer tensor this
    run's optimizer reads. The optimizer's keys follow its layout (one optimizer, or a dense and an expert one
    chained), so a checkpoint saved with another layout fails here, not deep inside the distributed reader."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    missing = sorted({v.key for v in nested_values(optimizer_state) if isinstance(v, ShardedTensor)} - set(saved))
    if missing:
        held = sorted(key for key in saved if key.startswith(("optimizer.", "chained_")))
        raise ValueError(
            f"checkpoint {directory} must hold the optimizer state this run's optimizer reads because a resume "
            f"continues it, but {missing[0]} is not there ({len(missing)} keys missing; it holds "
            f"{held[0] if held else 'no optimizer state'}, ...): the checkpoint was saved with another optimizer "
            f"layout (a MoE model keeps its experts' optimizer apart where parallel.ep > 1 or parallel.etp differs "
            f"from parallel.tp, so changing those changes it; rlrun before 0.2.0 kept the experts in the dense "
            f"optimizer at parallel.ep 1). To go on from its weights with a fresh optimizer: "
            f"`rlrun convert mcore-to-hf --ckpt {directory.parent} --out DIR`, then model.path=DIR and "
            f"checkpoint.resume=none"
        )


def load_model_shard(model: MegatronModel, model_state: dict[str, Any] | Path) -> None:
    """Copy a loaded model ``state_dict``, or the model of the checkpoint in directory ``model_state``
    (collective), into the live weights (every parameter must match)."""
    if isinstance(model_state, Path):
        load_weights(model, model_state)
        return
    result = model.module.load_state_dict(model_state, strict=False)
    problems = [key for key in [*result.missing_keys, *result.unexpected_keys] if not key.endswith("_extra_state")]
    if problems:
        raise RuntimeError(
            f"checkpoint model shard does not match the model built from model.path: "
            f"missing {result.missing_keys}, unexpected {result.unexpected_keys}; use "
            f"the model.path the checkpoint was written with"
        )


def load_weights(model: MegatronModel, directory: Path) -> None:
    """Collective: only the model weights of the checkpoint in ``directory`` (no optimizer, no RNGs)."""
    load(model, None, None, directory, with_rng=False)


def _init_adam_state(optimizer: MegatronOptimizer) -> None:
    """Give a fresh distributed optimizer the Adam state it creates at its first step (zero moments, step 0):
    without Apex or TE its ``state_dict``, which loading goes through, needs one step count to exist."""
    for part in optimizer_parts(optimizer):
        for group in part.optimizer.param_groups:
            for param in group["params"]:
                state = part.optimizer.state[param]
                if not state:
                    state.update(
                        exp_avg=torch.zeros_like(param),
                        exp_avg_sq=torch.zeros_like(param),
                        step=adam_step(0, param, group),
                    )


def _restore_adam_steps(optimizer: MegatronOptimizer, saved: dict[str, Any], directory: Path) -> None:
    """Give every parameter its own, saved Adam step count. Without Apex or TE the distributed optimizer's
    ``load_state_dict`` leaves the step of the fresh state (0), shared by every parameter, which torch's
    Adam would then increment once per parameter: every later update would use a wrong bias correction.
    The saved step is in the param groups of its ``state_dict`` (one value for all)."""
    steps = {group["step"] for group in saved["optimizer"]["param_groups"] if "step" in group}
    if len(steps) != 1:
        raise ValueError(
            f"checkpoint {directory} optimizer state must hold one Adam step count because every "
            f"parameter was updated together; found {sorted(steps)}: the checkpoint is corrupt"
        )
    step = float(steps.pop())
    for part in optimizer_parts(optimizer):
        for group in part.optimizer.param_groups:
            for param in group["params"]:
                if param in part.optimizer.state:
                    part.optimizer.state[param]["step"] = adam_step(step, param, group)


def _rng_object(model: MegatronModel) -> Any:
    """This rank's RNG states as one slot of a (pp, tp, dp) grid of objects."""
    from megatron.core.dist_checkpointing import ShardedObject

    p = model.parallel
    return ShardedObject(
        RNG_KEY, _rng_state(), (p.pp_size, p.tp_size, p.dp_size), (p.pp_rank, p.tp_rank, p.dp_rank), replica_id=0
    )


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "megatron_tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(_as_tuples(state["python"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def _as_tuples(value: Any) -> Any:
    """``random.setstate`` wants the nested tuples back that a round trip may have made lists."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
