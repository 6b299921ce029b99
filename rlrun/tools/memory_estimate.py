"""The trainer's device memory for one config, estimated before it starts (``rlrun doctor CONFIG``).

Per rank, with ``P`` the parameters it holds (``/ tp / pp``, routed experts ``/ pp / ep / etp``), ``dp``
data-parallel ranks (the optimizer of routed experts shards over the expert data-parallel ranks,
``dp * tp / (ep * etp)``, Megatron's expert_data_parallel_size) and
``T = train.max_tokens_per_micro_batch / parallel.cp`` (one micro-batch is alive at a time at PP=1;
context parallelism's gathered keys and values, ``cp`` times one layer's, are not counted):

    static       = P * (w + g + (m + a) / dp_opt)     bf16: w 2, g 4 (fp32 grad buffer), m 4 (fp32 main), a 8
                                                      (Adam moments); fp32: w 4, g 4, m 0, a 8; dp_opt = dp
                                                      with the distributed optimizer, else 1; with
                                                      optimizer.cpu_offload a leaves the device (host: 16 / dp:
                                                      moments, an fp32 weight copy, pinned gradients)
    activations  = T * L_stage * per_token_layer      (below, bytes of the model's dtype)
    lm head      = T * V_local * 2 * e  (logits: the output layer's logits and GPTModel's transposed copy)
                   or 2 * CHUNK_BYTES + 6 * V_local * H   (chunked: two fp32 chunk buffers and the backward's fp32
                   weight-gradient sum with its bf16 result; no [T, V] tensor)

Kept per token and layer, in elements (H hidden, q = n_q * d, kv = 2 * n_kv * d, f the MLP width, TP
dividing the head and MLP terms; no sequence parallelism, so the H terms are whole on every TP rank):

    none       attention 2H + 2(q + kv) + 2q  +  MLP 2H + 5f   (norm in/out, QKV out, Q/K/V after norm and RoPE,
                                                                attention out; fc1 out 2f, SwiGLU's halves 2f, fc2 in f)
    selective  2H + 2(q + kv) + q + 2H                          (the core attention and the MLP keep their inputs only)
    full       H per layer, plus one layer's ``none`` activations while it is recomputed

Calibrated against the peaks of ``rlrun bench train --samples-per-micro-batch 1`` (BENCHMARKS.md, "Long
responses"); tests/unit/test_memory_estimate.py holds those rows and how close the estimate must come. The
allocator's fragmentation, NCCL buffers and the CUDA context (a few GiB) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlrun.config.schema import RunConfig
    from rlrun.megatron.hf_config import ModelArch

GIB = 2**30
CHUNK_BYTES = 1 << 30
"""rlrun.megatron.token_stats.CHUNK_BYTES (not imported: that module imports torch)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """GiB per rank on the device (and in host memory for offloaded optimizer state)."""

    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    """fp32 main weights and Adam moments left on the device."""
    host_optimizer_gib: float
    activations_gib: float
    lm_head_gib: float
    activation_bytes_per_token: float
    """Of all of this rank's layers, at the config's recompute."""

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.grads_gib + self.optimizer_gib + self.activations_gib + self.lm_head_gib


def rank_params(arch: ModelArch, tp: int, pp: int, ep: int, etp: int = 1) -> float:
    """Parameters one rank holds (norms left out: under 0.1%)."""
    return sum(rank_param_split(arch, tp, pp, ep, etp))


def rank_param_split(arch: ModelArch, tp: int, pp: int, ep: int, etp: int = 1) -> tuple[float, float]:
    """(dense, routed-expert) parameters one rank holds: the routed experts split over ``ep * etp`` ranks
    of a stage, everything else (attention, shared experts, dense MLPs, router, vocab) over ``tp``."""
    h, d = arch.hidden_size, arch.head_dim
    attention = h * (arch.num_heads + 2 * arch.num_kv_heads) * d + arch.num_heads * d * h
    routed = 0.0
    if arch.moe is None:
        mlp = 3.0 * h * arch.ffn_hidden_size
    else:
        moe = arch.moe
        sparse_layers = sum(1 for sparse in moe.moe_layers if sparse)
        mlp = (
            sparse_layers * (3 * h * moe.shared_expert_ffn_hidden_size + h * moe.num_experts)
            + (arch.num_layers - sparse_layers) * 3 * h * arch.ffn_hidden_size
        ) / arch.num_layers
        routed = sparse_layers * moe.num_experts * 3 * h * moe.ffn_hidden_size / (pp * ep * etp)
    # the embedding on the first stage, the LM head on the last (one tensor when tied at PP=1)
    vocab = arch.vocab_size * h * (2 if pp == 1 and not arch.tie_embeddings else 1)
    return (arch.num_layers * (attention + mlp) / pp + vocab) / tp, routed


def layer_elements_per_token(arch: ModelArch, tp: int, recompute: str) -> float:
    """Activation elements one layer keeps per token (module docstring)."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * d / tp, 2 * arch.num_kv_heads * d / tp
    f = (arch.ffn_hidden_size if arch.moe is None else arch.moe.topk * arch.moe.ffn_hidden_size) / tp
    full_layer = 2 * h + 2 * (q + kv) + 2 * q + 2 * h + 5 * f
    if recompute == "none":
        return full_layer
    if recompute == "selective":
        return 2 * h + 2 * (q + kv) + q + 2 * h
    return h


def estimate(cfg: RunConfig, arch: ModelArch, dp: int) -> MemoryEstimate:
    """The trainer's memory per rank for ``cfg`` at ``dp`` data-parallel ranks (module docstring)."""
    par, opt, train = cfg.parallel, cfg.optimizer, cfg.train
    dense, routed = rank_param_split(arch, par.tp, par.pp, par.ep, par.etp)
    params = dense + routed
    bf16 = cfg.model.dtype == "bfloat16"
    elem = 2 if bf16 else 4
    expert_dp = max(dp * par.tp * par.cp // (par.ep * par.etp), 1)
    shard = dp if opt.use_distributed_optimizer else 1
    expert_shard = expert_dp if opt.use_distributed_optimizer else 1
    # sharded state per parameter, averaged over the dense and the routed-expert parameters
    sharded = (dense / shard + routed / expert_shard) / params
    main = (4 if bf16 else 0) * sharded
    adam = 8 * sharded
    offloaded = opt.offload_fraction if opt.cpu_offload else 0.0
    tokens = train.max_tokens_per_micro_batch / par.cp  # context parallelism: each rank holds 1/cp of a row
    layers = arch.num_layers // par.pp
    per_layer = layer_elements_per_token(arch, par.tp, train.recompute)
    if train.recompute == "full":
        recomputed = layers if train.recompute_num_layers is None else train.recompute_num_layers
        kept = recomputed * per_layer + (layers - recomputed) * layer_elements_per_token(arch, par.tp, "none")
        working = layer_elements_per_token(arch, par.tp, "none")  # the layer being recomputed
    else:
        kept, working = layers * per_layer, 0.0
    per_token = kept * elem
    v_local = arch.vocab_size / par.tp
    if cfg.model.lm_head != "logits":
        head = 2 * CHUNK_BYTES + v_local * arch.hidden_size * (4 + elem)
        if cfg.model.lm_head == "chunked_kept":  # the forward's logits, kept for the backward
            head += tokens * v_local * elem
    else:
        head = tokens * v_local * 2 * elem + 2 * CHUNK_BYTES
    return MemoryEstimate(
        weights_gib=params * elem / GIB,
        grads_gib=params * 4 / GIB,
        optimizer_gib=params * (main + adam * (1 - offloaded)) / GIB,
        # the host holds Adam's moments, its own fp32 copy of the weights and a pinned copy of the gradients
        host_optimizer_gib=params * offloaded * (adam + 8 * sharded) / GIB,
        activations_gib=tokens * (per_token + working * elem) / GIB,
        lm_head_gib=head / GIB,
        activation_bytes_per_token=per_token,
    )
