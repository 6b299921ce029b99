"""``rlrun bench train``: training tokens/s, TFLOP/s, MFU and peak memory of a random-init Qwen3 shape.

One process, TP=1, the real training path: ``build_model`` from a random HF directory of the shape
(Megatron local spec with ``rlrun.megatron.attention``'s core attention, Megatron DDP), micro-batches
from ``rlrun.data.batch.schedule_micro_batches`` (several samples packed per row), and ``train_step``
with the RL objective (GRPO loss with entropy, as ``rlrun.trainer.actor.Actor.train`` calls it) and
Megatron's Adam. Layout ``rows`` puts the same samples one per row (positions 0..S-1, no packing) for
comparison. One warm-up step, then ``steps`` timed steps; tokens/s uses the median step time.

FLOPs are model FLOPs (what the maths needs, not what recomputation adds), with ``L`` layers, hidden
``h``, ``n_q`` / ``n_kv`` heads of size ``d``, MLP width ``f``, vocabulary ``V`` and sample lengths ``s_i``:

    N_matmul   = L * (h * (n_q + 2 n_kv) * d + n_q * d * h + 3 * h * f) + h * V    (q/k/v/o, gated MLP, LM head)
    forward    = 2 * N_matmul * sum_i s_i  +  L * 2 * n_q * d * sum_i s_i^2
    train step = 3 * forward                                                     (backward = 2 x forward)

The attention term counts QK^T and PV (2 x 2 n_q d s^2 multiply-adds per layer) causally, i.e. half of
the ``s^2`` score matrix; padding tokens, norms, RoPE and softmax are not counted.
MFU = train-step FLOPs / step seconds / the card's bf16 peak (``--peak-tflops``; BENCHMARKS.md, "Training
throughput and MFU").
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path

import torch

from rlrun.config.schema import LMHead, RecomputeMode
from rlrun.tools.bench.kernel_table import profiled, write_kernel_table
from rlrun.tools.bench.shapes import Shape, get_shape, write_random_model
from rlrun.tools.bench.timing import hardware, timer

FLOPS_FORMULA = (
    "3 * (2 * N_matmul * sum_i s_i + L * 2 * n_q * d * sum_i s_i^2); "
    "N_matmul = L * (h * (n_q + 2 n_kv) * d + n_q * d * h + 3 * h * f) + h * V"
)
PROMPT_LEN = 64
"""Prompt tokens of each synthetic sample; the rest of the sample is response (in the loss)."""


def matmul_params(shape: Shape) -> int:
    """``N_matmul``: weights that multiply every token (the embedding lookup is not a matmul)."""
    attention = (
        shape.hidden * (shape.heads + 2 * shape.kv_heads) * shape.head_dim + shape.heads * shape.head_dim * shape.hidden
    )
    return shape.layers * (attention + 3 * shape.hidden * shape.intermediate) + shape.hidden * shape.vocab


def training_flops(shape: Shape, sample_lengths: list[int], causal: bool = True) -> float:
    """FLOPs of one forward + backward over samples of ``sample_lengths`` (module docstring);
    ``causal=False`` counts the full ``s^2`` score matrix."""
    tokens = sum(sample_lengths)
    attention = shape.layers * 4 * shape.heads * shape.head_dim * sum(s * s for s in sample_lengths)
    return 3.0 * (2 * matmul_params(shape) * tokens + (attention / 2 if causal else attention))


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """One layout's ``bench train`` measurement."""

    shape: str
    hardware: str
    dtype: str
    layout: str
    """packed: samples back to back in one row per micro-batch (document-masked); rows: one sample per row."""
    core_attention: str
    sample_len: int
    samples_per_micro_batch: int
    micro_batches: int
    tokens_per_step: int
    step_seconds: list[float]
    tokens_per_s: float
    flops_per_step: float
    flops_formula: str
    tflops: float
    mfu: float
    peak_tflops: float
    peak_memory_gib: float
    """torch.cuda.max_memory_allocated over this layout's warm-up and timed steps (0 on CPU)."""
    memory: MemoryOptions
    """The long-response memory options the model and optimizer were built with."""


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    """``bench train``'s memory options, as the run config names them."""

    recompute: RecomputeMode = "none"
    """``train.recompute`` (rlrun/megatron/recompute.py)."""
    recompute_num_layers: int | None = None
    """``train.recompute_num_layers`` (full recompute only)."""
    lm_head: LMHead = "chunked"
    """``model.lm_head`` (rlrun/megatron/lm_head.py)."""
    optimizer_cpu_offload: bool = False
    """``optimizer.cpu_offload``: Adam's state in host memory (with the distributed optimizer)."""
    offload_fraction: float = 1.0
    """``optimizer.offload_fraction``: the share of the parameters whose state goes to the host."""
    cp_size: int = 1
    """Context-parallel size; rlrun's trainer has none yet, so always 1."""


def synthetic_samples(count: int, length: int, vocab: int, seed: int):
    """``count`` random-token samples of ``length`` tokens, rewards of both signs (group scores)."""
    from rlrun.data.sample import Prompt, Sample

    gen = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(count):
        ids = torch.randint(2, vocab, (length,), generator=gen).tolist()
        prompt = Prompt(index=index, prompt_ids=ids[:PROMPT_LEN], prompt_text="")
        response = ids[PROMPT_LEN:]
        samples.append(
            Sample(
                group_index=index,
                prompt=prompt,
                response_ids=response,
                response_text="",
                rollout_logprobs=[0.0] * len(response),
                finish_reason="length",
                reward=1.0 if index % 2 else -1.0,
            )
        )
    return samples


def micro_batches(samples, layout: str, samples_per_micro_batch: int) -> list:
    """The step's micro-batches: ``packed`` through the trainer's scheduler, ``rows`` one sample per row."""
    from rlrun.data.batch import collate, schedule_micro_batches

    rewards = [s.reward for s in samples]
    if layout == "packed":
        budget = samples_per_micro_batch * samples[0].total_length
        (batches,) = schedule_micro_batches(samples, rewards, dp_size=1, max_tokens=budget, pad_token_id=0)
        return batches
    if layout != "rows":
        raise ValueError(f"layout ({layout!r}) must be packed or rows")
    batches = []
    for start in range(0, len(samples), samples_per_micro_batch):
        rows = [
            collate([s], [r], 0)
            for s, r in zip(
                samples[start : start + samples_per_micro_batch],
                rewards[start : start + samples_per_micro_batch],
                strict=False,
            )
        ]
        fields = {
            f.name: torch.cat([getattr(mb, f.name) for mb in rows])
            for f in dataclasses.fields(rows[0])
            if getattr(rows[0], f.name) is not None
        }
        batches.append(type(rows[0])(**fields))
    return batches


def bench_train(
    shape_name: str,
    layouts: list[str],
    sample_len: int,
    samples_per_micro_batch: int,
    num_micro_batches: int,
    steps: int,
    peak_tflops: float,
    profile: Path | None = None,
    memory: MemoryOptions = MemoryOptions(),
    packed_attention: str = "auto",
) -> list[TrainResult]:
    """Measure each layout on one model (random weights; the optimizer keeps stepping between layouts,
    which changes no shape or FLOP). ``profile``: also write the kernel-time table of one step there;
    ``memory``: recompute, LM head and optimizer offload (FLOPs and MFU count model FLOPs only);
    ``packed_attention``: ``model.packed_attention`` (its core attention is reported per row)."""
    from rlrun.megatron import build_model, make_optimizer
    from rlrun.megatron.attention import core_attention
    from rlrun.megatron.recompute import Recompute
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    shape = get_shape(shape_name)
    if sample_len <= PROMPT_LEN:
        raise ValueError(
            f"sample_len ({sample_len}) must exceed the {PROMPT_LEN}-token prompt because the "
            "response is what trains; set --sample-len higher"
        )
    parallel = init_distributed(tp=1, pp=1, seed=0)
    dtype = "bfloat16" if parallel.device.type == "cuda" else "float32"
    try:
        with tempfile.TemporaryDirectory(prefix="rlrun-bench-train-") as tmp:
            hf_dir = write_random_model(shape, Path(tmp), getattr(torch, dtype), str(parallel.device))
            model = build_model(
                str(hf_dir),
                parallel,
                dtype=dtype,
                packed_attention=packed_attention,
                distributed_optimizer=memory.optimizer_cpu_offload,
                recompute=Recompute(memory.recompute, memory.recompute_num_layers),
                lm_head=memory.lm_head,
            )
        optimizer = make_optimizer(
            model,
            lr=1e-6,
            weight_decay=0.0,
            betas=(0.9, 0.95),
            eps=1e-8,
            clip_grad=1.0,
            cpu_offload=memory.optimizer_cpu_offload,
            offload_fraction=memory.offload_fraction,
        )
        samples = synthetic_samples(samples_per_micro_batch * num_micro_batches, sample_len, shape.vocab, seed=0)
        attention = core_attention(packed_attention, dtype).__name__
        results = []
        for layout in layouts:
            batches = micro_batches(samples, layout, samples_per_micro_batch)
            if parallel.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(parallel.device)  # per layout; weights and Adam state stay in
            seconds = _timed_steps(model, optimizer, batches, steps, profile if layout == layouts[0] else None)
            flops = training_flops(shape, [s.total_length for s in samples])
            tokens = sum(s.total_length for s in samples)
            median = statistics.median(seconds)
            peak = torch.cuda.max_memory_allocated(parallel.device) / 2**30 if parallel.device.type == "cuda" else 0.0
            results.append(
                TrainResult(
                    shape=shape_name,
                    hardware=hardware(parallel.device),
                    dtype=dtype,
                    layout=layout,
                    core_attention=attention,
                    sample_len=sample_len,
                    samples_per_micro_batch=samples_per_micro_batch,
                    micro_batches=len(batches),
                    tokens_per_step=tokens,
                    step_seconds=seconds,
                    tokens_per_s=tokens / median,
                    flops_per_step=flops,
                    flops_formula=FLOPS_FORMULA,
                    tflops=flops / median / 1e12,
                    mfu=flops / median / (peak_tflops * 1e12),
                    peak_tflops=peak_tflops,
                    peak_memory_gib=peak,
                    memory=memory,
                )
            )
        return results
    finally:
        destroy_distributed()


def _timed_steps(model, optimizer, batches: list, steps: int, profile: Path | None) -> list[float]:
    """One warm-up step, then the seconds of each of ``steps`` train steps."""
    from rlrun.algo.aggregate import StepCounts
    from rlrun.algo.objective import Objective
    from rlrun.config.schema import AlgorithmConfig
    from rlrun.megatron import train_step

    num_tokens = sum(mb.num_loss_tokens for mb in batches)
    counts = StepCounts(
        num_tokens=num_tokens,
        num_samples=sum(mb.num_loss_samples for mb in batches),
        max_response_len=max(mb.tokens.shape[1] for mb in batches),
    )
    objective = Objective(AlgorithmConfig(), counts)
    device = model.parallel.device

    def step() -> None:
        train_step(
            model, optimizer, batches, objective, num_global_tokens=num_tokens, temperature=1.0, with_entropy=True
        )

    step()
    if profile is not None:  # one step's kernel-time table
        write_kernel_table(profiled(step), profile)
    seconds = []
    for _ in range(steps):
        with timer(device) as elapsed:
            step()
        seconds.append(elapsed[0])
    return seconds
