"""Turn-taking between the trainer and the engine on the same device.

The call sites are the same on every device so the loop reads the same everywhere; on CPU there is
no device memory to give back, so the trainer's sleep/wake do nothing and the engine's
release/resume only run the contract's bookkeeping (which still catches ordering mistakes).

On CUDA with ``offload.train`` the trainer's weights live in one torch_memory_saver region with a pinned CPU
backup (:meth:`Offloader.trainer_region` wraps model construction). The optimizer's state (fp32 main weights and
Adam moments) is built outside it (``offload.optimizer_copy: overlapped``, the default) and held in buffers of the
scratch region by
:class:`~rlrun.trainer.optimizer_state.FlatOptimizerState` (:meth:`Offloader.offload_optimizer_state`), which
copies it to the host at sleep and back on a side stream at wake, behind the forward pass that does not read it.
The fp32 gradient buffers, which every step zeroes before its first backward, are paused without any copy
(:meth:`Offloader.scratch_region`). Activations
and logits stay in torch's default pool (backing them up would copy gigabytes of freed cache blocks to the host at
every sleep); its cached blocks go back to the driver at sleep (``empty_cache``) unless the device has room for what
the engine took during the last measured rollout (``offload.release_cache``, :func:`keeps_cache`), in which case the
next train phase finds them mapped. Megatron sets the saver's hook mode when
it is imported, so the saver is first touched here, after ``rlrun.runtime.dist``.

With ``offload.teardown_nccl`` the sleeping trainer also destroys the NCCL communicators of Megatron's
groups of more than one rank (device memory outside every pool) and rebuilds them at wake,
before any collective runs; ``init_distributed`` made those groups reloadable, and its one-rank groups answer
their collectives without ever getting a communicator (rlrun/runtime/reloadable_groups.py).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Literal, ParamSpec, TypeVar

import torch

from rlrun.config.schema import OffloadConfig
from rlrun.observability.metrics import PhaseTimer
from rlrun.runtime import reloadable_groups
from rlrun.runtime.processes import process_tree
from rlrun.trainer.optimizer_state import FlatOptimizerState, streams_state

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

    from rlrun.engine.group import EngineGroup

P = ParamSpec("P")
R = TypeVar("R")
Placement = Literal["rollout", "train", "sync"]
"""Where device memory is: ``rollout`` (engine awake with its KV cache, trainer asleep), ``train`` (trainer
awake, engine released), ``sync`` (trainer awake, the engine's weights back, its KV cache still released)."""
PLACEMENT_ORDER: tuple[Placement, ...] = ("rollout", "train", "sync")
"""The placements of one step, in order; every step starts with ``rollout``."""
PHASE_PLACEMENT: dict[str, Placement] = {
    "eval": "rollout",
    "rollout": "rollout",
    "scatter": "train",
    "logprobs": "train",
    "train": "train",
    "sync": "sync",
}
"""The placement each phase of a step runs in."""
ENGINE_TAGS_AFTER_SYNC = ["kv_cache", "cuda_graph"]
TRAINER_TAG = "trainer"
GB = 1e9


def process_gpu_gb(groups: dict[str, list[int]]) -> dict[str, float]:
    """GPU memory (GB) each named group of processes holds, as the driver reports it (CUDA contexts
    included), because torch's own counters cannot see the engine nor a paused region."""
    used = gpu_gb_by_pid()
    totals = {}
    for name, pids in groups.items():
        held = [used[pid] for pid in pids if pid in used]
        totals[name] = round(sum(held), 3) if held else float("nan")
    return totals


def gpu_gb_by_pid() -> dict[int, float]:
    """GB each process holds, summed over the GPUs: through NVML when ``pynvml`` (nvidia-ml-py) is
    importable, a library call, else from ``nvidia-smi``, a subprocess whose start the loop's three
    memory marks per step would add to every step (BENCHMARKS.md, "rlrun against TRL with transformers `generate`")."""
    nvml = _nvml()
    if nvml is None:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout
        rows = [line.partition(",")[::2] for line in out.splitlines()]
        return {int(pid): int(mib) * 2**20 / GB for pid, mib in rows if pid.strip().isdigit() and mib.strip().isdigit()}
    used: dict[int, float] = {}
    for index in range(nvml.nvmlDeviceGetCount()):
        for proc in nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(index)):
            if proc.usedGpuMemory is not None:  # None where the driver withholds it (some containers)
                used[proc.pid] = used.get(proc.pid, 0.0) + proc.usedGpuMemory / GB
    return used


@functools.cache
def _nvml() -> ModuleType | None:
    """The initialised ``pynvml`` module, or None when it is missing or NVML does not start."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver library, or no device: nvidia-smi says why, if it can
        return None
    return pynvml


def default_pool_gb(device: torch.device, other_pools: bool) -> tuple[float, float]:
    """(allocated, reserved) GB of torch's default pool, i.e. outside every torch_memory_saver region:
    what a sleeping trainer cannot give back, split from the CUDA context and NCCL/cuBLAS buffers. Without
    ``other_pools`` (no trainer region) that is all of torch's allocator, read from its counters instead of
    the snapshot that walks every block (three times a step)."""
    if not other_pools:
        return round(torch.cuda.memory_allocated(device) / GB, 3), round(torch.cuda.memory_reserved(device) / GB, 3)
    segments = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) == (0, 0)]
    allocated = sum(s["allocated_size"] for s in segments)
    reserved = sum(s["total_size"] for s in segments)
    return round(allocated / GB, 3), round(reserved / GB, 3)


def keeps_cache(free_gb: float, engine_growth_gb: float | None, margin_gb: float) -> bool:
    """Whether a sleeping trainer may keep torch's cached blocks (``offload.release_cache: when_needed``): only once
    a rollout was measured, and when the device's free memory, the trainer's state paused, covers what the device
    took on during that rollout with a tenth to spare, plus the margin."""
    return engine_growth_gb is not None and free_gb >= engine_growth_gb * 1.1 + margin_gb


class Offloader:
    """Sleep/wake for one rank's trainer and its engine, in the order of docs/architecture.md, and the per-phase
    memory timeline (``memory/<phase>/{trainer,engine,device}_gb``) on CUDA."""

    def __init__(self, cfg: OffloadConfig, engine: EngineGroup, device: torch.device) -> None:
        self.cfg = cfg
        self.engine = engine
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.metrics: dict[str, float] = {}
        self._saver = None
        self._trainer_asleep = False
        self._engine_kv_released = False
        self._engine_tree: tuple[int, list[int]] | None = None
        self._optimizer_states: list[FlatOptimizerState] = []
        self._used_after_sleep: float | None = None  # device GB once the trainer slept, before the engine woke
        self._engine_growth_gb: float | None = None  # the most the device took on from there to a rollout's end
        if cfg.train and self.on_gpu:
            import megatron.core  # noqa: F401  (sets the saver's hook mode; must come before the saver)
            from torch_memory_saver import torch_memory_saver

            self._saver = torch_memory_saver
            # A region allocation that would leave less than the margin free fails as OOM.
            torch_memory_saver.memory_margin_bytes = int(cfg.memory_margin_gb * GB)
            # Keep the pinned host copy between sleeps: pinning tens of GB anew each time costs more
            # than the copy itself (BENCHMARKS.md, "Offload: trainer and engine taking turns on one GPU").
            torch_memory_saver.retain_cpu_backup = True
            # Activations and logits live in the default pool, and empty_cache can only return a
            # segment whose blocks are all free, so a few small live tensors can hold gigabytes of them.
            # Expandable segments are unmapped page by page instead. torch applies them to the
            # default pool only, never to the saver's private pool; a user's own
            # PYTORCH_CUDA_ALLOC_CONF wins.
            if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
                torch._C._accelerator_setAllocatorSettings("expandable_segments:True")

    def trainer_region(self) -> contextlib.AbstractContextManager:
        """Allocations made inside (this thread) are paused by :meth:`trainer_sleep` and restored with
        their contents; a no-op without trainer offload. Only long-lived state belongs here."""
        return self._region(cpu_backup=True)

    def scratch_region(self) -> contextlib.AbstractContextManager:
        """Like :meth:`trainer_region`, but what is allocated inside comes back from a sleep without its contents
        (no host copy either way): for long-lived buffers every step overwrites before reading, the gradient
        buffers (``build_model``'s ``grad_buffer_region``). A no-op without trainer offload."""
        return self._region(cpu_backup=False)

    def _region(self, cpu_backup: bool) -> contextlib.AbstractContextManager:
        if self._saver is None:
            return contextlib.nullcontext()
        return self._saver.region(tag=TRAINER_TAG, enable_cpu_backup=cpu_backup)

    @property
    def needs_hard_exit(self) -> bool:
        """Whether the process must end without Python's teardown once everything is shut down and flushed
        (``os._exit``, which the CLI calls): torch_memory_saver (torch hook mode) aborts the process with
        exit code 1 on a free of region memory made outside a region, which the teardown of the model and
        optimizer does."""
        return self._saver is not None

    def phases(self, timer: PhaseTimer) -> StepPhases:
        """One step's phases on this offloader (:class:`StepPhases`), timed by ``timer``."""
        return StepPhases(self, timer)

    def enter(self, placement: Placement) -> None:
        """Move trainer and engine memory to ``placement`` from the one before it in ``PLACEMENT_ORDER`` (the
        last one for ``rollout``: the previous step's)."""
        if placement == "rollout":  # here, not at the end of a step, so checkpoints see an awake trainer
            self.trainer_sleep()
            self.engine_wake_for_rollout()
        elif placement == "train":
            self._note_engine_growth()
            self.engine_sleep()
            self.trainer_wake()
        else:
            self.engine_wake_for_sync()

    def optimizer_region(self, host_adam: bool) -> contextlib.AbstractContextManager:
        """Where an optimizer is built: outside every region when :meth:`offload_optimizer_state` will hold its state
        (what it builds there and later copies into its buffers goes back to the driver at the first sleep), in
        :meth:`trainer_region` for Megatron's host Adam (``optimizer.cpu_offload``) and with ``offload.optimizer_copy:
        with_weights``, where the saver copies the state."""
        with_weights = host_adam or self.cfg.optimizer_copy == "with_weights"
        return self.trainer_region() if with_weights else contextlib.nullcontext()

    def offload_optimizer_state(self, optimizer: MegatronOptimizer, model_params: Iterable[torch.Tensor]) -> None:
        """Take ``optimizer`` (built in :meth:`optimizer_region`) into the sleeps and wakes; a no-op without trainer
        offload. torch's Adam: its state is held in a :class:`FlatOptimizerState`'s buffers (the moments created there
        at the first step), saved to the host at every sleep and copied back behind the forward pass at every wake,
        every method that reads it waiting for that copy first. Otherwise every ``optimizer.step()`` runs inside
        :meth:`trainer_region`, where the moments it creates on its first call must live."""
        if self._saver is None:
            return
        if self.cfg.optimizer_copy == "with_weights" or not streams_state(optimizer):
            optimizer.step = self._in_region(optimizer.step)
            return
        state = FlatOptimizerState(optimizer, model_params, self.scratch_region)
        optimizer.step = state.stepping(optimizer.step)
        for name in ("state_dict", "sharded_state_dict", "load_state_dict", "reload_model_params"):
            if hasattr(optimizer, name):
                setattr(optimizer, name, state.waiting_first(getattr(optimizer, name)))
        self._optimizer_states.append(state)

    def _in_region(self, fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def in_region(*args: P.args, **kwargs: P.kwargs) -> R:
            with self.trainer_region():
                return fn(*args, **kwargs)

        return in_region

    def engine_sleep(self) -> None:
        """After rollout: the engine gives back weights, KV cache and graphs (never mid-request)."""
        if self.cfg.rollout:
            with self._seconds("offload/engine_release_s"):
                self.engine.release_memory_occupation()
            self._engine_kv_released = True

    def engine_wake_for_sync(self) -> None:
        """Before weight sync: only the weights come back, the KV cache waits until after."""
        if self.cfg.rollout:
            with self._seconds("offload/engine_resume_weights_s"):
                self.engine.resume_memory_occupation(["weights"])

    def engine_wake_for_rollout(self) -> None:
        """Before rollout: the KV cache and graphs come back (nothing to do before the first rollout)."""
        if self.cfg.rollout and self._engine_kv_released:
            with self._seconds("offload/engine_resume_kv_s"):
                self.engine.resume_memory_occupation(ENGINE_TAGS_AFTER_SYNC)
            self._engine_kv_released = False

    def engine_restarted(self, restarted_here: bool) -> None:
        """Before the re-sync after engine restarts (rlrun/trainer/recovery.py), whichever placement the step
        was in: as in ``sync``, the engine holds its weights but not its KV cache (a restarted engine holds
        everything, a healthy one may be in ``rollout``) and the trainer is awake for the export."""
        if restarted_here:
            self._engine_kv_released = False
        if self.cfg.rollout and not self._engine_kv_released:
            self.engine.release_memory_occupation(ENGINE_TAGS_AFTER_SYNC)
            self._engine_kv_released = True
        self.trainer_wake()

    def trainer_sleep(self) -> None:
        """Pause the trainer's region (after the weight sync has read the weights) and return the
        transient blocks outside it (activations, sync buckets the engine has let go of) to the driver, unless the
        engine fits beside them (``offload.release_cache``). Nothing to release on CPU."""
        if self._saver is None or self._trainer_asleep:
            return
        self._timed("sleep", self._release_trainer)
        self._trainer_asleep = True
        # measured only where the engine's KV cache comes back in this rollout (or is never released): a rollout
        # whose engine held it throughout (the first) would understate what a later one takes on
        if not self.cfg.rollout or self._engine_kv_released:
            self._used_after_sleep = self.device_used_gb()

    def _note_engine_growth(self) -> None:
        """At a rollout's end: what the device took on since the trainer slept (the engine's KV cache and graphs
        coming back, its temporaries), the most seen so far, for :func:`keeps_cache`."""
        if self._used_after_sleep is None:
            return
        grown = max(self.device_used_gb() - self._used_after_sleep, 0.0)
        self._engine_growth_gb = max(grown, self._engine_growth_gb or 0.0)
        self.metrics["offload/engine_growth_gb"] = round(grown, 3)
        self._used_after_sleep = None

    def _release_trainer(self) -> None:
        assert self._saver is not None
        with self._seconds("offload/trainer_gc_s"):
            gc.collect()  # tensors kept alive only by reference cycles would pin their blocks
        torch.cuda.ipc_collect()  # sync buckets whose IPC handles the engine has closed
        torch._C._cuda_clearCublasWorkspaces()  # re-created on the next matmul
        if self.cfg.teardown_nccl:  # after the device sync in _timed: no kernel still uses them
            with self._seconds("offload/nccl_destroy_s"):
                self.metrics["offload/nccl_groups_destroyed"] = reloadable_groups.destroy_all()
            kept = reloadable_groups.one_rank_groups_with_communicator()
            self.metrics["offload/nccl_one_rank_groups_with_communicator"] = kept
        with self._seconds("offload/optimizer_state_save_s"):
            for state in self._optimizer_states:
                state.save_to_host()
        with self._seconds("offload/trainer_pause_s"):
            self._saver.pause(TRAINER_TAG)
        keep = self.cfg.release_cache == "when_needed" and keeps_cache(
            torch.cuda.mem_get_info(self.device)[0] / GB, self._engine_growth_gb, self.cfg.memory_margin_gb
        )
        self.metrics["offload/trainer_cache_kept"] = float(keep)
        with self._seconds("offload/trainer_empty_cache_s"):
            if not keep:
                torch.cuda.empty_cache()

    def trainer_wake(self) -> None:
        """Counterpart of :meth:`trainer_sleep`: the region comes back with its contents, and the NCCL
        groups with new communicators (NCCL creates them lazily, at each group's first collective)."""
        if self._saver is None or not self._trainer_asleep:
            return
        self._timed("wake", self._restore_trainer)
        # after the timed part, which synchronises the device: the copy runs behind the forward pass, and the
        # optimizer's methods wait for it (offload_optimizer_state)
        for state in self._optimizer_states:
            state.load_from_host()
        self._trainer_asleep = False

    def _restore_trainer(self) -> None:
        assert self._saver is not None
        with self._seconds("offload/trainer_resume_s"):
            self._saver.resume(TRAINER_TAG)
        if self.cfg.teardown_nccl:  # the communicators themselves are created at each group's first collective
            with self._seconds("offload/nccl_rebuild_s"):
                self.metrics["offload/nccl_groups_rebuilt"] = reloadable_groups.rebuild_all()

    @contextlib.contextmanager
    def _seconds(self, key: str) -> Iterator[None]:
        """Wall seconds of the body as ``metrics[key]``: the parts of a sleep or wake (and the engine's
        release/resume RPCs, which return once the engine is done), so a slow offload phase says which
        part was slow."""
        start = time.perf_counter()
        yield
        self.metrics[key] = round(time.perf_counter() - start, 4)

    def _timed(self, what: str, fn: Callable[[], None]) -> None:
        before = self.device_used_gb()
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        moved = abs(self.device_used_gb() - before)
        self.metrics[f"offload/trainer_{what}_s"] = round(seconds, 4)
        self.metrics[f"offload/trainer_{what}_gb"] = round(moved, 3)
        self.metrics[f"offload/trainer_{what}_gb_per_s"] = round(moved / max(seconds, 1e-9), 2)

    def device_used_gb(self) -> float:
        free, total = torch.cuda.mem_get_info(self.device)
        return (total - free) / GB

    def mark(self, phase: str) -> None:
        """Record GPU memory of the trainer, the engine and the whole device at the end of ``phase``."""
        if not self.on_gpu:
            return
        groups = {"trainer": [os.getpid()]}  # not its tree: that holds the engine worker
        if self.engine.process is not None:  # members of an engine group (engine.tp > 1) have no engine
            # SGLang's memory belongs to the scheduler processes below the worker
            groups["engine"] = self._engine_processes(self.engine.process.pid)
        for name, gb in process_gpu_gb(groups).items():
            self.metrics[f"memory/{phase}/{name}_gb"] = gb
        self.metrics[f"memory/{phase}/device_gb"] = round(self.device_used_gb(), 3)
        allocated, reserved = default_pool_gb(self.device, other_pools=self._saver is not None)
        self.metrics[f"memory/{phase}/trainer_default_pool_allocated_gb"] = allocated
        self.metrics[f"memory/{phase}/trainer_default_pool_reserved_gb"] = reserved

    def _engine_processes(self, worker_pid: int) -> list[int]:
        """The engine worker's process tree, walked once per worker (/proc, every thread of every process):
        the engine starts its processes before it reports ready, and a restarted engine is a new worker."""
        if self._engine_tree is None or self._engine_tree[0] != worker_pid:
            self._engine_tree = (worker_pid, process_tree(worker_pid))
        return self._engine_tree[1]

    def step_metrics(self) -> dict[str, float]:
        """This step's timeline and sleep/wake figures (on CPU only the engine's release/resume seconds),
        then a fresh record for the next."""
        out, self.metrics = self.metrics, {}
        if self.on_gpu:
            out["memory/trainer_max_allocated_gb"] = round(torch.cuda.max_memory_allocated(self.device) / GB, 3)
            torch.cuda.reset_peak_memory_stats(self.device)
        return out


class StepPhases:
    """One step's phases: ``with phases("rollout"): ...`` first moves memory to the placement the phase runs in
    (``PHASE_PLACEMENT``; timed as ``offload``), then times the body as the phase. Every step passes through
    every placement of ``PLACEMENT_ORDER``, in order, also when phases are skipped; when a placement ends its
    memory timeline is recorded (timed as ``memory``, so ``time/step_s`` is the step's whole wall time)."""

    def __init__(self, offloader: Offloader, timer: PhaseTimer) -> None:
        self.offloader = offloader
        self.timer = timer
        self.placement: Placement | None = None

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self._move_to(PHASE_PLACEMENT[phase])
        with self.timer(phase):
            yield

    def finish(self) -> dict[str, float]:
        """Walk on to the step's last placement (the engine gets its weights back even in a step that did not
        train), record its timeline; the step's offload, memory and time metrics (call once, at the end)."""
        self._move_to(PLACEMENT_ORDER[-1])
        self._mark()
        return {**self.offloader.step_metrics(), **self.timer.as_metrics()}

    def _move_to(self, placement: Placement) -> None:
        """Through every placement up to ``placement``, in order: each one ends with its timeline."""
        at = -1 if self.placement is None else PLACEMENT_ORDER.index(self.placement)
        target = PLACEMENT_ORDER.index(placement)
        assert target >= at, f"placement {placement} after {self.placement}: a step moves through them in order"
        for following in PLACEMENT_ORDER[at + 1 : target + 1]:
            self._mark()
            with self.timer("offload"):
                self.offloader.enter(following)
            self.placement = following

    def _mark(self) -> None:
        if self.placement is not None:
            with self.timer("memory"):  # the timeline's GPU memory queries (nothing on CPU)
                self.offloader.mark(self.placement)
