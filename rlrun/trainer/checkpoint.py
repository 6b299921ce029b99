"""Atomic checkpoints of the whole run, resume from the newest complete one, pruning, async save.

Layout (``checkpoint.dir``, default ``RUN_DIR/checkpoints``; every rank must see it)::

    step_000040/               a complete checkpoint: steps 0..39 are done
        actor/                 Megatron distributed checkpoint (torch_dist): model, optimizer, LR scheduler,
                               every rank's RNG states (rlrun/megatron/checkpoint.py)
        critic/                the critic's model, optimizer and scheduler, when the run trains one (PPO)
        hf/                    model.path's config and tokenizer files, for ``rlrun convert mcore-to-hf``
        adapter/               with ``model.lora``: the adapters in PEFT's format (rlrun/megatron/peft_export.py)
        run_state.json         the run's RunState and rank 0's prompt-sampler cursor (the data position)
        rollout_carry.pt       with rollout.partial_rollout: the groups drawn but not trained yet, with
                               their tokens so far (rank 0's RolloutRuntime.carry as plain data)
        COMPLETE               written last: step, parallel layout, whether it holds weights only
    .tmp-step_000044/          being written, or left by a crash (ignored; removed by the next save)

Save, on every rank after the same step: rank 0 creates the temporary directory; every rank plans
its part of each distributed checkpoint (collective) and copies its tensors to host memory; the files
are written (in a background thread with ``async_save``); then, once every rank has written (one
all-reduce), the checkpoints' metadata is recorded and rank 0 writes ``run_state.json``, renames the
directory to ``step_N``, writes ``COMPLETE`` and prunes to ``keep_last``. A crash at any point leaves
either no ``step_N`` or a ``step_N`` without ``COMPLETE``; resuming only ever picks directories with
the marker. A rank whose writes fail (a full disk, a quota) raises ``CheckpointWriteError`` naming the
cause, the space left and the newest complete checkpoint. The same directory shape, with weights only and
step 0, is what ``rlrun convert hf-to-mcore`` writes, so ``checkpoint.load`` can start a run from it.

A checkpoint loads on any data-parallel size, with the tensor- and pipeline-parallel sizes it was
saved with; RNG states come back only on the very layout that saved them.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlrun.config.schema import CheckpointConfig
from rlrun.megatron import checkpoint as mcore_ckpt
from rlrun.runtime import fault_points
from rlrun.runtime.dist import Parallel

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from rlrun.data.source import PromptSource
    from rlrun.megatron.model import MegatronModel
    from rlrun.trainer.critic import Critic

COMPLETE = "COMPLETE"
RUN_STATE = "run_state.json"
ROLLOUT_CARRY = "rollout_carry.pt"
TMP_PREFIX = ".tmp-"
ACTOR = "actor"
CRITIC = "critic"
HF_FILES = "hf"
ADAPTER = "adapter"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class CheckpointWriteError(RuntimeError):
    """A rank could not write its part of a checkpoint (a full disk, a quota, a file-size limit, an I/O error)."""


@dataclass
class RunState:
    """Everything that changes as the run goes and must survive a restart (saved as JSON, so fields must be
    JSON values; rank 0's prompt-sampler cursor is saved beside it)."""

    step: int = 0
    """Steps completed."""
    weight_version: int = 0
    """Version of the weights the engine holds (bumped by every sync)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


@dataclass(frozen=True)
class Layout:
    """The parallel layout a checkpoint was saved on; loading needs the same TP and PP (any DP)."""

    world_size: int
    tp: int
    pp: int

    @classmethod
    def of(cls, parallel: Parallel) -> Layout:
        return cls(world_size=parallel.world_size, tp=parallel.tp_size, pp=parallel.pp_size)

    def loads_on(self, other: Layout) -> bool:
        return (self.tp, self.pp) == (other.tp, other.pp)


@dataclass(frozen=True)
class Marker:
    """The ``COMPLETE`` file: written last, so its presence means every part of the checkpoint is there."""

    step: int
    layout: Layout
    weights_only: bool = False
    """True for ``rlrun convert hf-to-mcore`` output: model weights, no optimizer, RNG or run state."""
    model_path: str | None = None
    """The HF directory the model was built from (``rlrun convert mcore-to-hf`` builds the model from it)."""

    @classmethod
    def read(cls, step_dir: Path) -> Marker:
        raw = json.loads((step_dir / COMPLETE).read_text())
        return cls(
            step=raw["step"],
            layout=Layout(**raw["layout"]),
            weights_only=raw.get("weights_only", False),
            model_path=raw.get("model_path"),
        )

    def write(self, step_dir: Path) -> None:
        _write_text(step_dir / COMPLETE, json.dumps(dataclasses.asdict(self)))


def complete_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint with a ``COMPLETE`` marker, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = []
    for path in ckpt_dir.glob("step_*"):
        if (path / COMPLETE).is_file() and path.name[len("step_") :].isdigit():
            found.append((int(path.name[len("step_") :]), path))
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
        raise ValueError(
            f"checkpoint.resume ('{setting}') must be 'auto', 'none' or a checkpoint directory with a "
            f"{COMPLETE} marker because only complete checkpoints can be resumed; pick one of "
            f"{[str(p) for _, p in complete_checkpoints(path.parent)] or 'none found'}"
        )
    return path


def resolve_load(setting: str) -> Path:
    """The checkpoint ``checkpoint.load`` names: a complete checkpoint directory (``step_*`` or ``rlrun
    convert`` output) or a checkpoint directory holding ``step_*`` ones (the newest complete)."""
    path = Path(setting)
    if (path / COMPLETE).is_file():
        return path
    found = complete_checkpoints(path)
    if found:
        return found[-1][1]
    found_what = "it does not exist" if not path.exists() else "it holds none"
    raise ValueError(
        f"checkpoint.load ('{setting}') must be a complete checkpoint (a directory with a {COMPLETE} "
        f"marker: a step_* directory or `rlrun convert hf-to-mcore` output) or a directory holding "
        f"them because nothing else can be loaded; {found_what}: point it at one"
    )


def resolve_start(cfg: CheckpointConfig, ckpt_dir: Path) -> Path | None:
    """Where the run starts: ``checkpoint.resume``'s choice (the run's own checkpoints first, so a restarted
    run continues where it stopped), else ``checkpoint.load``, else None (model.path's weights)."""
    own = resolve_resume(cfg.resume, ckpt_dir)
    if own is None and cfg.load is not None:
        return resolve_load(cfg.load)
    return own


def check_layout(step_dir: Path, layout: Layout, fix: str) -> None:
    """Raise unless complete checkpoint ``step_dir`` loads on ``layout``; ``fix`` ends the message."""
    saved = Marker.read(step_dir).layout
    if not saved.loads_on(layout):
        raise ValueError(
            f"checkpoint {step_dir} layout ({saved}) must have this run's tp and pp ({layout}) because the "
            f"vocabulary padding and the pipeline stages depend on them (any data-parallel size loads); "
            f"set parallel.tp={saved.tp} and parallel.pp={saved.pp}, {fix}"
        )


def check_model(step_dir: Path, marker: Marker, model_path: str | None, lora: bool, own: bool) -> None:
    """Raise unless complete checkpoint ``step_dir`` was written for ``model_path`` (and with LoRA adapters exactly
    when ``lora``); ``own``: it is one of the run's own checkpoints (``checkpoint.resume``), else ``checkpoint.load``'s.
    Checkpoints that do not record their model (older ones) pass."""
    if own:
        fix = (
            "set logging.run_dir to a new directory for a new run (or checkpoint.resume: none to start fresh in "
            "this run directory, replacing its checkpoints as the run saves)"
        )
    else:
        fix = "set checkpoint.load to a checkpoint of this model, or unset it"
    saved = marker.model_path
    if saved is not None and model_path is not None and os.path.realpath(saved) != os.path.realpath(model_path):
        raise ValueError(
            f"model.path ({model_path}) must be the model checkpoint {step_dir} was written for ({saved}) because its "
            f"weights and optimizer state are that model's; {fix}"
        )
    has_adapters = (step_dir / ADAPTER).is_dir()
    if not marker.weights_only and has_adapters != lora:
        raise ValueError(
            f"model.lora ({'set' if lora else 'unset'}) must match checkpoint {step_dir}, written "
            f"{'with' if has_adapters else 'without'} LoRA adapters, because the trained parameters differ; {fix}"
        )


def read_model_shard(step_dir: Path, parallel: Parallel, fix: str) -> Path:
    """The model checkpoint inside complete checkpoint ``step_dir``, checked against this run's layout, for
    weights loaded beside the actor's (the reference) with ``load_model_shard`` (no optimizer, no RNGs)."""
    check_layout(step_dir, Layout.of(parallel), fix)
    return step_dir / ACTOR


def copy_hf_files(src: Path, dst: Path) -> None:
    """Copy an HF directory's config, tokenizer and other small files (not its weights) into ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    for file in sorted(src.iterdir()):
        if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES) and file.name != "model.safetensors.index.json":
            shutil.copy2(file, dst / file.name)


@dataclass
class _Pending:
    """An asynchronous save in flight: its planned writes, the writer thread and its error, if any."""

    step: int
    run_state: dict
    saves: list[mcore_ckpt.PendingSave]
    thread: threading.Thread
    errors: list[BaseException]
    carry: bytes | None


class Checkpointer:
    """Saves and restores the run; every method is collective over ``parallel.cpu_group`` (and the
    default process group, which Megatron's checkpointing uses)."""

    def __init__(
        self, cfg: CheckpointConfig, run_dir: str | Path, parallel: Parallel, model_path: str | None = None
    ) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.dir) if cfg.dir is not None else Path(run_dir) / "checkpoints"
        self.parallel = parallel
        self.layout = Layout.of(parallel)
        self.model_path = model_path  # its config/tokenizer files are copied into every checkpoint
        self._pending: _Pending | None = None
        self.restored_carry: list | None = None
        """Rank 0, after :meth:`restore`: the checkpoint's partial-rollout carry (plain data), or None."""

    # ---- saving ------------------------------------------------------------------------------------

    def due(self, step: int, last: bool, stopping: bool) -> bool:
        """Whether to save after ``step`` steps are done."""
        interval = self.cfg.save_interval
        return stopping or (last and self.cfg.save_at_end) or (interval > 0 and (step % interval == 0 or last))

    def save(
        self,
        run_state: RunState,
        model: MegatronModel,
        optimizer: MegatronOptimizer,
        sampler: PromptSource | None,
        blocking: bool,
        critic: Critic | None = None,
        scheduler: OptimizerParamScheduler | None = None,
        carry: list | None = None,
    ) -> None:
        """Checkpoint after ``run_state.step`` steps: ``run_state`` (rank 0's is kept), the model, optimizer,
        scheduler and RNGs (and the critic's), rank 0's sampler cursor and, with partial rollout, rank 0's
        carry (plain data: lists, strings, numbers and tensors; serialized now, so later steps cannot
        change what an asynchronous save writes)."""
        step = run_state.step
        self.wait()
        tmp = self.dir / f"{TMP_PREFIX}{step_dir_name(step)}"
        if self.parallel.is_rank0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / ACTOR).mkdir(parents=True)
            if critic is not None:
                (tmp / CRITIC).mkdir()
        dist.barrier(group=self.parallel.cpu_group)
        fault_points.reached("checkpoint.write")  # test-only (rlrun/runtime/fault_points.py)
        if model.lora is not None:  # small: gathered and written now, also when the rest is written async
            from rlrun.megatron.peft_export import write_peft_adapter

            write_peft_adapter(model, tmp / ADAPTER, self.model_path)
        state = {**dataclasses.asdict(run_state), "sampler": sampler.state_dict() if sampler is not None else None}
        carry_bytes = _torch_bytes(carry) if carry is not None and self.parallel.is_rank0 else None
        saves = [
            mcore_ckpt.start_save(mcore_ckpt.training_state(model, optimizer, scheduler, with_rng=True), tmp / ACTOR)
        ]
        if critic is not None:
            saves.append(mcore_ckpt.start_save(critic.checkpoint_state(), tmp / CRITIC))
        if blocking or not self.cfg.async_save:
            try:
                for pending in saves:
                    pending.write()
            except Exception as exc:
                raise self._write_error(step, exc) from exc
            self._commit(step, state, saves, carry_bytes)
            return
        errors: list[BaseException] = []
        thread = threading.Thread(target=_write_all, args=(saves, errors), name=f"checkpoint-step-{step}", daemon=True)
        thread.start()
        self._pending = _Pending(step, state, saves, thread, errors, carry_bytes)

    def poll(self) -> None:
        """Commit an asynchronous save once every rank has written its files (call after every step)."""
        if self._pending is None:
            return
        done = torch.tensor([0 if self._pending.thread.is_alive() else 1])
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.parallel.cpu_group)
        if done.item():
            self.wait()

    def wait(self) -> None:
        """Finish and commit an asynchronous save, if one is in flight."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.thread.join()
        if pending.errors:
            raise self._write_error(pending.step, pending.errors[0]) from pending.errors[0]
        self._commit(pending.step, pending.run_state, pending.saves, pending.carry)

    def _write_error(self, step: int, exc: BaseException) -> CheckpointWriteError:
        """The one-line failure of this rank's writes: the cause (``OSError: [Errno 28] No space left on device``:
        torch's zip writer reports a failed write as ``unexpected pos``, the OSError only as its context), the free
        space, what is left and what resume does with it."""
        chain: list[BaseException] = []
        link: BaseException | None = exc
        while link is not None and link not in chain:
            chain.append(link)
            link = link.__cause__ or link.__context__
        cause = next((e for e in chain if isinstance(e, OSError)), chain[-1])
        complete = complete_checkpoints(self.dir)
        newest = complete[-1][1].name if complete else "none (a fresh start)"
        free_gib = shutil.disk_usage(self.dir).free / 2**30
        return CheckpointWriteError(
            f"rank {self.parallel.rank} could not write its part of checkpoint {step_dir_name(step)} in {self.dir}: "
            f"{type(cause).__name__}: {cause} ({free_gib:.1f} GiB free there); the half-written "
            f"{TMP_PREFIX}{step_dir_name(step)}/ is never resumed from (newest complete: {newest}); free space in "
            f"{self.dir} (or point checkpoint.dir elsewhere) and run again: checkpoint.resume=auto continues from "
            "the newest complete checkpoint"
        )

    def _commit(self, step: int, state: dict, saves: list[mcore_ckpt.PendingSave], carry: bytes | None) -> None:
        """Every rank has written: record the checkpoints' metadata; rank 0 makes the directory visible, then
        marks it complete."""
        for pending in saves:
            pending.finish()
        dist.barrier(group=self.parallel.cpu_group)
        if not self.parallel.is_rank0:
            return
        tmp, final = self.dir / f"{TMP_PREFIX}{step_dir_name(step)}", self.dir / step_dir_name(step)
        _write_text(tmp / RUN_STATE, json.dumps(state, indent=1))
        if carry is not None:
            _write_bytes(tmp / ROLLOUT_CARRY, carry)
        if self.model_path is not None:
            copy_hf_files(Path(self.model_path), tmp / HF_FILES)
        if final.exists():  # left by an earlier run in the same directory (resume: none): replaced
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.dir)
        Marker(step=step, layout=self.layout, model_path=self.model_path).write(final)
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

    def restore(
        self,
        model: MegatronModel,
        optimizer: MegatronOptimizer,
        sampler: PromptSource | None,
        critic: Critic | None = None,
        scheduler: OptimizerParamScheduler | None = None,
    ) -> dict[str, int] | None:
        """Load the checkpoint ``checkpoint.resume`` / ``checkpoint.load`` pick into the model, optimizer,
        scheduler, RNGs, the critic and (rank 0) sampler; returns the saved RunState fields ({} for a
        weights-only checkpoint: step 0), or None for a fresh start."""
        path = self._choose_start()
        if path is None:
            return None
        check_layout(path, self.layout, "or set checkpoint.resume=none (and unset checkpoint.load) to start fresh")
        marker = Marker.read(path)
        own = path.parent.resolve() == self.dir.resolve()
        check_model(path, marker, self.model_path, lora=model.lora is not None, own=own)
        if marker.weights_only:
            mcore_ckpt.load_weights(model, path / ACTOR)
            optimizer.reload_model_params()  # bf16 models: the fp32 main weights follow the loaded ones
            if self.parallel.is_rank0:
                print(f"[rlrun] model weights loaded from {path}; optimizer and data start fresh", flush=True)
            return {}
        run_state = json.loads((path / RUN_STATE).read_text())
        mcore_ckpt.load(model, optimizer, scheduler, path / ACTOR, with_rng=marker.layout == self.layout)
        if critic is not None:
            if not (path / CRITIC).is_dir():
                raise ValueError(
                    f"checkpoint {path} has no critic ({CRITIC}/) but critic.config is set: it was "
                    f"saved by a run without a critic; set checkpoint.resume=none to start fresh, or "
                    f"resume without critic.config"
                )
            critic.load_checkpoint(path / CRITIC)
        sampler_state = run_state.pop("sampler")
        if sampler is not None:
            sampler.load_state_dict(sampler_state)
            carry_path = path / ROLLOUT_CARRY
            self.restored_carry = torch.load(carry_path, weights_only=True) if carry_path.is_file() else None
        if self.parallel.is_rank0:
            print(f"[rlrun] resumed from {path} (step {run_state['step']})", flush=True)
        return run_state

    def _choose_start(self) -> Path | None:
        """Decided on rank 0 and broadcast, so every rank loads the same checkpoint; rank 0's error is raised
        on every rank, so none waits in a collective for a rank that failed."""
        choice: list[str | ValueError | None] = [None]
        if self.parallel.is_rank0:
            try:
                choice = [str(resolve_start(self.cfg, self.dir) or "")]
            except ValueError as exc:
                choice = [exc]
        dist.broadcast_object_list(choice, src=0, group=self.parallel.cpu_group)
        if isinstance(choice[0], ValueError):
            raise choice[0]
        return Path(choice[0]) if choice[0] else None


def _write_all(saves: list[mcore_ckpt.PendingSave], errors: list[BaseException]) -> None:
    """Thread body: the error is re-raised on the main thread by :meth:`Checkpointer.wait`."""
    try:
        for pending in saves:
            pending.write()
    except BaseException as exc:  # noqa: BLE001 - handed to the main thread, never swallowed
        errors.append(exc)


def _torch_bytes(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _write_text(path: Path, text: str) -> None:
    _write_bytes(path, text.encode())


def _write_bytes(path: Path, data: bytes) -> None:
    """Write through a temporary name so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
