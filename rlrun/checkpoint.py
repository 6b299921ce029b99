"""Atomic checkpoints of the whole run, resume from the newest complete one, pruning, async save.

Layout (``checkpoint.dir``, default ``RUN_DIR/checkpoints``; every rank must see it)::

    step_000040/               a complete checkpoint: steps 0..39 are done
        rank_00000.pt          rank 0's model + optimizer shards and RNG states (rlrun/megatron/checkpoint.py)
        rank_00001.pt
        critic_rank_00000.pt   the critic's model + optimizer shards, when the run trains one (PPO)
        run_state.json         the loop's RunState and rank 0's prompt-sampler cursor
        COMPLETE               written last: step and parallel layout
    .tmp-step_000044/          being written, or left by a crash (ignored; removed by the next save)

Save, on every rank after the same step: rank 0 creates the temporary directory; each rank writes
its shard (in a background thread with ``async_save``); then, once every rank has written (one
all-reduce), rank 0 writes ``run_state.json``, renames the directory to ``step_N``, writes
``COMPLETE`` and prunes to ``keep_last``. A crash at any point leaves either no ``step_N`` or a
``step_N`` without ``COMPLETE``; ``resume: auto`` only ever picks directories with the marker.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rlrun.config.schema import CheckpointConfig
from rlrun.megatron.checkpoint import load_rank_state as load_megatron_rank_state
from rlrun.megatron.checkpoint import rank_state as megatron_rank_state
from rlrun.runtime.dist import Parallel

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

    from rlrun.critic import Critic
    from rlrun.data.prompts import PromptSampler
    from rlrun.megatron.model import MegatronModel

COMPLETE = "COMPLETE"
RUN_STATE = "run_state.json"
TMP_PREFIX = ".tmp-"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def critic_file_name(rank: int) -> str:
    return f"critic_{rank_file_name(rank)}"


@dataclass(frozen=True)
class Layout:
    """The parallel layout a checkpoint's shards belong to; resuming needs the same one."""

    world_size: int
    tp: int
    pp: int

    @classmethod
    def of(cls, parallel: Parallel) -> Layout:
        return cls(world_size=parallel.world_size, tp=parallel.tp_size, pp=parallel.pp_size)


def complete_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint with a ``COMPLETE`` marker, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = []
    for path in ckpt_dir.glob("step_*"):
        if (path / COMPLETE).is_file() and path.name[len("step_"):].isdigit():
            found.append((int(path.name[len("step_"):]), path))
    return sorted(found)


def resolve_resume(setting: str, ckpt_dir: Path) -> Path | None:
    """The checkpoint ``checkpoint.resume`` asks for, or None for a fresh start."""
    if setting == "none":
        return None
    if setting == "auto":
        found = complete_checkpoints(ckpt_dir)
        return found[-1][1] if found else None
    path = Path(setting)
    if not (path / COMPLETE).is_file():
        raise ValueError(f"checkpoint.resume ('{setting}') must be 'auto', 'none' or a checkpoint directory with a "
                         f"{COMPLETE} marker because only complete checkpoints can be resumed; pick one of "
                         f"{[str(p) for _, p in complete_checkpoints(path.parent)] or 'none found'}")
    return path


def check_layout(step_dir: Path, layout: Layout, fix: str) -> None:
    """Raise unless complete checkpoint ``step_dir`` was saved on ``layout``; ``fix`` ends the message."""
    saved = Layout(**json.loads((step_dir / COMPLETE).read_text())["layout"])
    if saved != layout:
        raise ValueError(
            f"checkpoint {step_dir} layout ({saved}) must equal this run's ({layout}) because each rank "
            f"saved its own tensor-parallel shard; launch {saved.world_size} processes with parallel.tp="
            f"{saved.tp}, {fix}")


def read_model_shard(step_dir: Path, parallel: Parallel, fix: str) -> dict[str, torch.Tensor]:
    """This rank's model ``state_dict`` from complete checkpoint ``step_dir`` (no optimizer, no RNGs),
    for weights loaded beside the actor's (the reference). Memory-mapped: the optimizer shard is not read."""
    check_layout(step_dir, Layout.of(parallel), fix)
    return torch.load(step_dir / rank_file_name(parallel.rank), map_location="cpu", weights_only=True,
                      mmap=True)["model"]


class Checkpointer:
    """Saves and restores the run; every method is collective over ``parallel.cpu_group``."""

    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path, parallel: Parallel) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.dir) if cfg.dir is not None else Path(run_dir) / "checkpoints"
        self.parallel = parallel
        self.layout = Layout.of(parallel)
        # An asynchronous save in flight: (step, run_state, writer thread, error holder).
        self._pending: tuple[int, dict, threading.Thread, list[BaseException]] | None = None

    # ---- saving ------------------------------------------------------------------------------------

    def due(self, step: int, last: bool, stopping: bool) -> bool:
        """Whether to save after ``step`` steps are done."""
        interval = self.cfg.save_interval
        return stopping or (interval > 0 and (step % interval == 0 or last))

    def save(self, run_state: Any, model: MegatronModel, optimizer: MegatronOptimizer,
             sampler: PromptSampler | None, blocking: bool, critic: Critic | None = None) -> None:
        """Checkpoint after ``run_state.step`` steps: ``run_state`` (a dataclass of JSON values; rank 0's is
        kept), every rank's model/optimizer shards and RNGs (and the critic's, beside them), and rank 0's
        prompt-sampler cursor."""
        step = run_state.step
        self.wait()
        tmp = self.dir / f"{TMP_PREFIX}{step_dir_name(step)}"
        if self.parallel.is_rank0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier(group=self.parallel.cpu_group)
        state = {**dataclasses.asdict(run_state), "sampler": sampler.state_dict() if sampler is not None else None}
        shards = {tmp / rank_file_name(self.parallel.rank): megatron_rank_state(model, optimizer)}
        if critic is not None:
            shards[tmp / critic_file_name(self.parallel.rank)] = critic.state_dict()
        if blocking or not self.cfg.async_save:
            for path, rank_state in shards.items():
                _write_shard(path, rank_state)
            self._commit(step, state)
            return
        errors: list[BaseException] = []
        snapshot = _copy_to_cpu(shards)  # training mutates the live tensors from the next step on
        thread = threading.Thread(target=_write_shards_into, args=(snapshot, errors),
                                  name=f"checkpoint-step-{step}", daemon=True)
        thread.start()
        self._pending = (step, state, thread, errors)

    def poll(self) -> None:
        """Commit an asynchronous save once every rank has written its shard (call after every step)."""
        if self._pending is None:
            return
        _, _, thread, _ = self._pending
        done = torch.tensor([0 if thread.is_alive() else 1])
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.parallel.cpu_group)
        if done.item():
            self.wait()

    def wait(self) -> None:
        """Finish and commit an asynchronous save, if one is in flight."""
        if self._pending is None:
            return
        step, state, thread, errors = self._pending
        self._pending = None
        thread.join()
        if errors:
            raise RuntimeError(f"rank {self.parallel.rank} could not write its shard of checkpoint step {step} "
                               f"in {self.dir}") from errors[0]
        self._commit(step, state)

    def _commit(self, step: int, state: dict) -> None:
        """All shards are written: rank 0 makes the checkpoint visible, then marks it complete."""
        dist.barrier(group=self.parallel.cpu_group)
        if not self.parallel.is_rank0:
            return
        tmp, final = self.dir / f"{TMP_PREFIX}{step_dir_name(step)}", self.dir / step_dir_name(step)
        _write_text(tmp / RUN_STATE, json.dumps(state, indent=1))
        if final.exists():  # left by an earlier run in the same directory (resume: none): replaced
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.dir)
        _write_text(final / COMPLETE, json.dumps({"step": step, "layout": dataclasses.asdict(self.layout)}))
        print(f"[rlrun] checkpoint saved: {final}", flush=True)
        self._prune()

    def _prune(self) -> None:
        complete = complete_checkpoints(self.dir)
        if self.cfg.keep_last:
            for _, path in complete[: -self.cfg.keep_last]:
                shutil.rmtree(path)
        for path in self.dir.glob(f"{TMP_PREFIX}step_*"):  # crashed saves; no save is in flight now
            shutil.rmtree(path, ignore_errors=True)

    # ---- restoring ---------------------------------------------------------------------------------

    def restore(self, model: MegatronModel, optimizer: MegatronOptimizer, sampler: PromptSampler | None,
                critic: Critic | None = None) -> dict | None:
        """Load the checkpoint ``checkpoint.resume`` picks into the model, optimizer, RNGs, the critic and
        (rank 0) sampler; returns the saved RunState fields, or None for a fresh start."""
        path = self._choose_resume()
        if path is None:
            return None
        check_layout(path, self.layout, "or set checkpoint.resume=none to start fresh")
        run_state = json.loads((path / RUN_STATE).read_text())
        shard = torch.load(path / rank_file_name(self.parallel.rank), map_location="cpu", weights_only=True)
        load_megatron_rank_state(model, optimizer, shard)
        if critic is not None:
            critic.load_state_dict(_load_critic_shard(path, self.parallel.rank))
        sampler_state = run_state.pop("sampler")
        if sampler is not None:
            sampler.load_state_dict(sampler_state)
        if self.parallel.is_rank0:
            print(f"[rlrun] resumed from {path} (step {run_state['step']})", flush=True)
        return run_state

    def _choose_resume(self) -> Path | None:
        """Decided on rank 0 and broadcast, so every rank loads the same checkpoint."""
        choice = [str(resolve_resume(self.cfg.resume, self.dir) or "")] if self.parallel.is_rank0 else [None]
        dist.broadcast_object_list(choice, src=0, group=self.parallel.cpu_group)
        return Path(choice[0]) if choice[0] else None


def _copy_to_cpu(value: Any) -> Any:
    """A deep copy of a nest of dicts/lists/tuples whose tensors are cloned to host memory."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _copy_to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_to_cpu(v) for v in value)
    return value


def _write_shard(path: Path, state: dict[str, Any]) -> None:
    with path.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _load_critic_shard(path: Path, rank: int) -> dict[str, Any]:
    file = path / critic_file_name(rank)
    if not file.is_file():
        raise ValueError(f"checkpoint {path} has no critic shard ({file.name}) but critic.config is set: it was "
                         f"saved by a run without a critic; set checkpoint.resume=none to start fresh, or resume "
                         f"without critic.config")
    return torch.load(file, map_location="cpu", weights_only=True)


def _write_shards_into(shards: dict[Path, dict[str, Any]], errors: list[BaseException]) -> None:
    """Thread body: the error is re-raised on the main thread by :meth:`Checkpointer.wait`."""
    try:
        for path, state in shards.items():
            _write_shard(path, state)
    except BaseException as exc:  # noqa: BLE001 - handed to the main thread, never swallowed
        errors.append(exc)


def _write_text(path: Path, text: str) -> None:
    """Write through a temporary name so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
