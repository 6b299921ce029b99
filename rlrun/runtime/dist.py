"""The torchrun environment, process groups and Megatron model-parallel state of one rank.

Rank layout is Megatron's (order ``tp-cp-ep-dp-pp``): the ``tp`` ranks of one tensor-parallel group are
consecutive, so a TP group never spans two nodes when ``tp`` divides the GPUs per node.
"""

from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    """``dist.all_reduce`` in place, skipped on a group of one rank, where it is the identity: after the
    offloader's NCCL teardown (``offload.teardown_nccl``) a collective on a one-rank group would create
    its communicator again at every step (device memory, and its start-up time) for nothing."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as torchrun describes it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls) -> DistEnv:
        """Read torchrun's variables; without them (plain ``python``), a single process on a free port."""
        if "RANK" not in os.environ:
            return cls(0, 0, 1, 1, "127.0.0.1", free_port())
        world_size = int(os.environ["WORLD_SIZE"])
        return cls(
            rank=int(os.environ["RANK"]),
            local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
            world_size=world_size,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(os.environ["MASTER_PORT"]),
        )


@dataclass
class Parallel:
    """This rank's coordinates in the TP x DP x PP mesh, its device, and a gloo group for control.

    ``cpu_group`` spans all ranks on gloo whatever the device: object collectives (samples, metrics,
    configs) and barriers go there so they never touch NCCL or GPU memory.
    """

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device
    cpu_group: dist.ProcessGroup
    env: DistEnv
    """The launcher's view; ``master_addr:master_port`` is the rendezvous store (rlrun/runtime/watchdog.py)."""
    ep_rank: int = 0
    ep_size: int = 1
    """Expert parallelism (MoE models): the EP ranks of one group hold disjoint blocks of experts. Megatron
    folds EP into the data-parallel ranks: ``ep`` divides ``dp * tp / etp`` (``etp`` = expert TP)."""
    etp_rank: int = 0
    etp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    """Context parallelism: the CP ranks of one group share each sequence (rlrun/megatron/context_parallel.py);
    they hold the same data, so ``dp_size`` counts them once."""

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        """This rank's pipeline stage holds the embedding (Megatron's ``pre_process``)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """This rank's pipeline stage holds the final norm and output layer (``post_process``): only it
        computes logits, log-probs, values and losses."""
        return self.pp_rank == self.pp_size - 1


def init_distributed(
    tp: int,
    pp: int,
    seed: int,
    timeout_s: float = 600,
    ep: int = 1,
    etp: int = 1,
    reloadable_backends: tuple[str, ...] = (),
    cp: int = 1,
    engine_ranks: int = 0,
) -> Parallel:
    """Start torch.distributed and Megatron's model-parallel groups for this rank; seed its RNGs.

    ``ep`` / ``etp``: expert model- and tensor-parallel sizes of MoE layers (1 for dense models); ``cp``: the
    context-parallel size (rlrun/megatron/context_parallel.py).

    CPU (no CUDA): gloo and the Megatron CPU patches. GPU: NCCL with ``device = cuda:local_rank``.
    Megatron's groups on ``reloadable_backends`` can be destroyed and rebuilt around trainer sleep
    (rlrun/runtime/reloadable_groups.py; ``OffloadConfig.reloadable_backends``).

    ``engine_ranks``: the last ranks host engines only (``placement.engine_ranks``, rlrun/runtime/placement.py);
    the default process group and Megatron's groups then span the training ranks alone (``world_size``).
    """
    env = DistEnv.from_env()
    world_size = env.world_size - engine_ranks
    assert 0 <= env.rank < world_size, f"rank {env.rank} is an engine rank: it must not initialize the trainer"

    # Megatron warns on import, once per module, that TE/Apex are missing; the local spec is our choice.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed.*")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated.*")
    # train.recompute: selective checkpoints rlrun's own core attention on purpose (Megatron warns for TE's fused one)
    warnings.filterwarnings("ignore", message=r"If you are using transformer_engine as the transformer implementation")
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(
            f"world_size ({world_size}) must be divisible by tp*pp*cp ({tp}*{pp}*{cp}) because every "
            "data-parallel replica holds one full tp x pp x cp model; set the sizes so that their product divides "
            "the number of processes"
        )
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"world_size ({world_size}) must be divisible by tp*pp ({tp}*{pp}) because every "
            f"data-parallel replica holds one full tp x pp model; set parallel.tp and parallel.pp so "
            f"that their product divides the number of processes"
        )
    if (world_size // pp) % (ep * etp) != 0:
        raise ValueError(
            f"world_size / pp ({world_size // pp}) must be divisible by ep*etp ({ep}*{etp}) because "
            f"Megatron lays the expert-parallel x expert-tensor-parallel grid over the ranks of one pipeline "
            f"stage; set parallel.ep and parallel.etp so that their product divides it"
        )
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        from rlrun.runtime.megatron_cpu import apply_cpu_patches

        apply_cpu_patches()
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    cpu_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if reloadable_backends:
        from rlrun.runtime import reloadable_groups

        reloadable_groups.install(frozenset(reloadable_backends))
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        context_parallel_size=cp,
        distributed_timeout_minutes=max(1, round(timeout_s / 60)),
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return Parallel(
        rank=env.rank,
        world_size=world_size,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        tp_size=tp,
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        pp_size=pp,
        dp_rank=mpu.get_data_parallel_rank(),
        dp_size=mpu.get_data_parallel_world_size(),
        device=device,
        cpu_group=cpu_group,
        env=env,
        ep_rank=mpu.get_expert_model_parallel_rank(),
        ep_size=ep,
        etp_rank=mpu.get_expert_tensor_parallel_rank(),
        etp_size=etp,
        cp_rank=mpu.get_context_parallel_rank(),
        cp_size=cp,
    )


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the default process group (safe to call when never started)."""
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
