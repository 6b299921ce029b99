"""Core attention for Megatron's layer spec without TransformerEngine, and the packed-sequence layout.

Megatron's local spec computes attention with ``DotProductAttention``, which materialises the
``S x S`` score matrix (memory that grows with the square of the length: a long micro-batch runs out) and refuses
packed sequences. ``SDPACoreAttention`` replaces it with ``torch.nn.functional.scaled_dot_product_attention``
(flash / memory-efficient kernels on CUDA, causal, grouped-query heads without copies):

* unpacked rows (``sbhd``: ``[S, B, heads, dim]``): one causal SDPA call over the batch;
* packed rows (``thd``: ``[T, heads, dim]`` with ``cu_seqlens``): one causal SDPA call per sample,
  which is exactly the block-diagonal causal (document) mask: no token sees another sample, and no
  ``T x T`` mask or score matrix exists. FlexAttention could express the same mask in one kernel but
  needs ``torch.compile`` (tens of seconds per new shape, recompiles as packings change); a few SDPA
  launches per layer cost microseconds against milliseconds of flash attention per sample.

Packing is described by ``position_ids`` alone: a row holding several samples restarts its positions
at 0 for each of them. ``packed_seq_params`` turns that into Megatron's ``PackedSeqParams`` (``thd``),
under which Megatron's RoPE also restarts per sample (``rope_utils._apply_rotary_pos_emb_thd``).

One SDPA call per sample is host-bound at RL batch sizes: every layer makes one call per sample forward and one
backward, and the GPU waits for the host between them (BENCHMARKS.md, "rlrun against TRL with transformers
`generate`"). So packed rows can be
attended in one varlen call per layer:

* ``efficient_varlen`` (:class:`EfficientVarlenCoreAttention`, CUDA, any dtype; what ``auto`` picks there):
  the memory-efficient kernel that the embedded engine runs too (:mod:`rlrun.kernels.attention`), so the
  trainer's log-probs equal the engine's (bitwise for prompts the engine did not left-pad;
  BENCHMARKS.md "Exactness"). On CUDA the per-sample and unpacked paths run that kernel too.
* ``flash_varlen`` (:class:`FlashVarlenCoreAttention`, CUDA, bf16): FlashAttention-2's varlen kernel. Fast,
  but no engine runs it, so trainer and engine disagree by bf16 rounding amplified over the layers (BENCHMARKS.md,
  "Exactness"): off-policy, kept for comparison.

For long samples the kernel's speed decides the step: attention grows with the square of the length and takes most
of a long sample's GPU time (BENCHMARKS.md, "Long responses"). So there is a third kernel, for
one long sample per row:

* ``cudnn_per_sample`` (:class:`CudnnCoreAttention`, CUDA, bf16): cuDNN's fused attention (SDPA's cuDNN
  backend), one call per sample: the fastest of the three for long samples, the slowest for short ones
  (BENCHMARKS.md, "The attention kernel at long context"). Off-policy like flash_varlen. cuDNN's own varlen entry
  (``aten._cudnn_attention_forward`` with ``cu_seqlens``) is not used: on torch 2.11 its backward returns wrong
  gradients and it is slow (the same section).

Every kernel choice covers unpacked rows (one sample per row, no ``packed_seq_params``) too: there the
whole batch is one call of the same kernel.

When TransformerEngine is importable, its ``TEDotProductAttention`` (cuDNN / flash, ``thd`` with
``cu_seqlens``) is the core attention instead. Only the core attention is swapped, not the whole TE
spec: the TE spec fuses the norms into the linear layers, renaming the parameters that
``rlrun.megatron.hf_weights`` and the checkpoints map.

Imports Megatron at import time: import this module lazily, like every Megatron caller.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, get_args

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from rlrun.config.schema import BF16_KERNEL_ATTENTION, PackedAttention
from rlrun.kernels import attention as attention_kernel
from rlrun.kernels.head_norm import HeadNorm
from rlrun.kernels.hidden_norm import HiddenNorm
from rlrun.kernels.triton_support import triton_available
from rlrun.megatron.transformer_engine import transformer_engine_attention
from rlrun.runtime.host_to_device import to_device

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from rlrun.megatron.hf_config import ModelArch


def core_attention(packed_attention: str = "auto", dtype: str = "float32") -> type:
    """The core attention class: TransformerEngine's when importable, else packed rows attended per sample or
    in one varlen call per layer (``efficient_varlen``: CUDA; ``flash_varlen``: CUDA, bfloat16), or per sample
    on cuDNN (``cudnn_per_sample``: CUDA, bfloat16), or on the chunked kernels (``chunked_varlen``: CUDA, bfloat16);
    ``auto``: :func:`rlrun.kernels.attention.auto_packed_attention`, the embedded engine's kernels. ``dtype`` is
    ``model.dtype`` (its default here too)."""
    if packed_attention not in get_args(PackedAttention):
        raise ValueError(
            f"model.packed_attention ({packed_attention!r}) must be one of {list(get_args(PackedAttention))}"
        )
    if transformer_engine_attention() is not None:
        return transformer_engine_attention()
    if packed_attention == "auto":
        packed_attention = attention_kernel.auto_packed_attention(dtype)
    if packed_attention == "per_sample":
        return SDPACoreAttention
    if not torch.cuda.is_available():
        raise ValueError(
            f"model.packed_attention ({packed_attention}) needs CUDA because its varlen kernel "
            "has no CPU implementation; use per_sample or auto on CPU"
        )
    if packed_attention == "efficient_varlen":
        return EfficientVarlenCoreAttention
    if packed_attention == "chunked_varlen":
        if dtype != "bfloat16" or not triton_available():
            raise ValueError(
                f"model.packed_attention (chunked_varlen) needs model.dtype bfloat16 (not {dtype}) and Triton "
                f"(importable: {triton_available()}) because its kernels are Triton's and multiply in bf16; "
                "use auto or efficient_varlen"
            )
        return ChunkedVarlenCoreAttention
    if dtype != "bfloat16":
        raise ValueError(
            f"model.packed_attention ({packed_attention}) needs model.dtype bfloat16 (not {dtype}) because "
            "its kernel has no float32 version; use per_sample or auto"
        )
    return FlashVarlenCoreAttention if packed_attention == "flash_varlen" else CudnnCoreAttention


def layer_spec(
    arch: ModelArch, pp_rank: int = 0, pp_size: int = 1, packed_attention: str = "auto", dtype: str = "float32"
) -> ModuleSpec | TransformerBlockSubmodules:
    """Megatron's local GPT layer spec (RMSNorm, QK-norm when ``arch`` has it) with a fused core attention and the
    norms the embedded engine shares (:mod:`rlrun.kernels.head_norm`, :mod:`rlrun.kernels.hidden_norm`).

    MoE models get Megatron's ``MoELayer`` as the MLP, with ``SequentialMLP`` experts (one local MLP per
    expert: no grouped-GEMM kernel, so it runs on CPU; ``rlrun.megatron.moe`` maps its weights). When only
    some layers are MoE (``mlp_only_layers``), the result is pipeline stage ``pp_rank``'s list of layer specs.
    """
    moe_layers = arch.moe.moe_layers if arch.moe is not None else (False,) * arch.num_layers
    if arch.mla is not None and packed_attention == "auto":
        # MLA's values are narrower than its queries and keys: FlashAttention's kernel refuses that, and the varlen
        # kernels are untested with it (rlrun.megatron.mla); SDPA per sample takes it.
        packed_attention = "per_sample"
    if arch.mla is not None and packed_attention in BF16_KERNEL_ATTENTION:
        raise ValueError(
            f"model.packed_attention ({packed_attention}) cannot run multi-latent attention because its kernel "
            "needs values as wide as queries and keys; use auto or per_sample"
        )
    attention = core_attention(packed_attention, dtype)
    if all(moe_layers) or not any(moe_layers):
        return _layer_spec(arch, any(moe_layers), attention)
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    per_stage = arch.num_layers // pp_size
    stage = moe_layers[pp_rank * per_stage : (pp_rank + 1) * per_stage]
    sparse, dense = _layer_spec(arch, True, attention), _layer_spec(arch, False, attention)
    return TransformerBlockSubmodules(
        layer_specs=[sparse if moe else dense for moe in stage], layer_norm=LayerNormImpl
    )  # the final norm Megatron adds to a layer spec


def _layer_spec(arch: ModelArch, moe: bool, attention: type) -> ModuleSpec:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=arch.moe.num_experts if moe else None,
        moe_grouped_gemm=False,
        normalization="RMSNorm",
        qk_layernorm=arch.qk_norm or arch.mla is not None,  # MLA: the q/kv latent norms
        multi_latent_attention=arch.mla is not None,
    )
    # get_gpt_layer_local_spec builds fresh submodule objects on every call, so this edits no shared state.
    spec.submodules.self_attention.submodules.core_attention = attention
    # the hidden norms: the engine's kernel on CUDA in bf16 (rlrun.kernels.hidden_norm); the final norm stays Megatron's
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = HiddenNorm
    # per-head QK-norm: the engine's kernel on CUDA in bf16 (rlrun.kernels.head_norm)
    if arch.qk_norm and arch.mla is None:
        spec.submodules.self_attention.submodules.q_layernorm = HeadNorm
        spec.submodules.self_attention.submodules.k_layernorm = HeadNorm
    if arch.mla is not None and arch.mla.q_lora_rank is None:  # no query latent, so no norm on it
        from megatron.core.transformer.identity_op import IdentityOp

        spec.submodules.self_attention.submodules.q_layernorm = IdentityOp
    return spec


@dataclasses.dataclass
class PackedRows(PackedSeqParams):
    """Megatron's ``thd`` parameters plus a device copy of the sample bounds (FlashAttention's varlen
    kernel reads them on the GPU; RoPE and the per-sample path read the CPU ones as Python ints)."""

    cu_seqlens_device: torch.Tensor | None = None


def packed_seq_params(position_ids: torch.Tensor, device: torch.device) -> PackedSeqParams | None:
    """Megatron's ``thd`` description of ``position_ids [B, S]`` flattened into one row, or None when
    every row is ``0..S-1`` (nothing packed: the plain causal path applies).

    Each sample starts where the positions restart at 0 and must count up by one from there; the
    rows are concatenated, so a row start always starts a sample.
    """
    position_ids = position_ids.cpu()
    if torch.equal(position_ids, torch.arange(position_ids.shape[-1]).expand_as(position_ids)):
        return None
    flat = position_ids.reshape(-1)
    starts = flat == 0
    if not bool((position_ids[..., 0] == 0).all() and (starts[1:] | (flat[1:] == flat[:-1] + 1)).all()):
        raise ValueError(
            "position_ids must count 0, 1, 2, ... within each packed sample (restarting at 0 for "
            "the next one) because they define the samples' boundaries; build them with "
            "rlrun.data.batch.collate"
        )
    bounds = torch.cat([starts.nonzero().flatten(), torch.tensor([flat.numel()])]).to(torch.int32)
    max_len = int((bounds[1:] - bounds[:-1]).max())
    # cu_seqlens stay on the CPU for the SDPA path: RoPE and SDPACoreAttention read them as Python ints,
    # and a CUDA copy would cost a device sync in every layer. TE kernels need them on the device; the
    # varlen kernel reads the one device copy made here, per micro-batch.
    on_device = to_device(bounds, device) if device.type == "cuda" else None
    if transformer_engine_attention() is not None:
        bounds = on_device
    return PackedRows(
        qkv_format="thd",
        cu_seqlens_q=bounds,
        cu_seqlens_kv=bounds,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
        cu_seqlens_device=on_device,
    )


class SDPACoreAttention(MegatronModule):
    """Causal core attention through torch SDPA; Megatron's core-attention constructor and forward
    signature (``query/key/value`` after RoPE; output ``[S, B, heads * dim]`` or ``[T, heads * dim]``)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        # k_channels / v_channels: multi-latent attention's q/k and v head sizes differ; SDPA reads them from
        # the tensors.
        super().__init__(config=config)
        self.context_parallel = config.context_parallel_size > 1  # rlrun/megatron/context_parallel.py
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(
                f"attn_mask_type ({attn_mask_type}) must be causal because SDPACoreAttention only "
                "implements causal language-model attention"
            )
        self.softmax_scale = softmax_scale  # None: SDPA's 1 / sqrt(head_dim), as Megatron's default
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if attention_mask is not None or attention_bias is not None:
            raise ValueError(
                "attention_mask must be None because SDPACoreAttention builds the causal (and, "
                "for packed rows, per-sample) mask itself; pass packing through position_ids"
            )
        if self.context_parallel:
            from rlrun.megatron import context_parallel

            if packed_seq_params is not None:
                raise ValueError(
                    "packed rows must not reach context-parallel attention because each CP rank holds chunks of "
                    "one sequence per row; with parallel.cp > 1 give each micro-batch rows of one sample"
                )
            dropout = self.dropout_p if self.training else 0.0
            return context_parallel.attention(query, key, value, self.softmax_scale, dropout)
        if packed_seq_params is None:
            seq, batch = query.shape[:2]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, heads, S, dim]
            return self._sdpa(q, k, v).permute(2, 0, 1, 3).reshape(seq, batch, -1)
        return self._packed(query, key, value, packed_seq_params).reshape(query.shape[0], -1)

    def _packed(self, query, key, value, packed_seq_params) -> torch.Tensor:
        """Causal attention within each sample of a packed ``[T, heads, dim]`` row."""
        bounds = packed_seq_params.cu_seqlens_q
        lengths = (bounds[1:] - bounds[:-1]).tolist()
        # split, not slicing: its backward concatenates the samples' gradients once, where each slice's
        # backward would write a zero-filled full-size gradient. [1, heads, s_i, dim] views: SDPA's fused
        # kernels take 4-D inputs only (3-D ones fall back to the math kernel and its s_i x s_i scores).
        outputs = [
            self._sdpa(*(t.transpose(0, 1).unsqueeze(0) for t in sample))[0].transpose(0, 1)
            for sample in zip(*(t.split(lengths) for t in (query, key, value)), strict=False)
        ]
        return torch.cat(outputs)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over ``[B, heads, S, dim]``; key/value may have fewer (grouped) heads. On CUDA the
        engine's kernel (rlrun.kernels.attention), elsewhere SDPA."""
        return attention_kernel.causal(q, k, v, self.softmax_scale, self.dropout_p if self.training else 0.0)


def _device_bounds(packed_seq_params) -> torch.Tensor:
    bounds = packed_seq_params.cu_seqlens_device
    if bounds is None:
        raise ValueError(
            "packed_seq_params must carry cu_seqlens_device because the varlen kernel reads "
            "the sample bounds on the GPU; build it with rlrun.megatron.attention.packed_seq_params"
        )
    return bounds


class EfficientVarlenCoreAttention(SDPACoreAttention):
    """:class:`SDPACoreAttention` with packed rows in one memory-efficient varlen call per layer (CUDA, any
    dtype): the kernel the embedded engine runs (rlrun.kernels.attention), so both compute the same log-probs."""

    def _packed(self, query, key, value, packed_seq_params) -> torch.Tensor:
        return attention_kernel.causal_varlen(
            query,
            key,
            value,
            _device_bounds(packed_seq_params),
            packed_seq_params.max_seqlen_q,
            self.softmax_scale,
            self.dropout_p if self.training else 0.0,
        )


class ChunkedVarlenCoreAttention(SDPACoreAttention):
    """:class:`SDPACoreAttention` on the chunked kernels (``model.packed_attention: chunked_varlen``,
    rlrun.kernels.chunked_attention): the embedded engine's then, whose decode splits each row's keys over thread
    blocks and
    stays bitwise this forward; FlashAttention-2's backward. Packed rows in one call per layer, unpacked rows packed
    for it. Heads the kernels do not take (``attention_kernel.chunked_kernel_takes``) run the memory-efficient
    kernel, as the engine's do."""

    def _packed(self, query, key, value, packed_seq_params) -> torch.Tensor:
        return self._chunked(query, key, value, _device_bounds(packed_seq_params), packed_seq_params.max_seqlen_q)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Unpacked ``[B, heads, S, dim]`` rows as B packed samples of S tokens."""
        batch, heads, seq, _ = q.shape
        packed = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[-1]) for t in (q, k, v)]
        bounds = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=q.device)
        return self._chunked(*packed, bounds, seq).view(batch, seq, heads, -1).transpose(1, 2)

    def _chunked(self, query, key, value, bounds: torch.Tensor, max_len: int) -> torch.Tensor:
        dropout = self.dropout_p if self.training else 0.0
        return attention_kernel.chunked_varlen(query, key, value, bounds, max_len, self.softmax_scale, dropout)


class FlashVarlenCoreAttention(SDPACoreAttention):
    """:class:`SDPACoreAttention` with packed rows in one FlashAttention-2 varlen call per layer (CUDA, bf16
    or fp16): ``aten._flash_attention_forward`` with the rows' ``cu_seqlens``, whose autograd formula is
    torch's own flash backward. Grouped-query heads are native to the kernel (no copies)."""

    def _packed(self, query, key, value, packed_seq_params) -> torch.Tensor:
        bounds = _device_bounds(packed_seq_params)
        max_len = packed_seq_params.max_seqlen_q
        return self._flash(query, key, value, bounds, max_len)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Unpacked ``[B, heads, S, dim]`` rows: the same kernel over the batch (``[B, S, heads, dim]`` inside)."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return self._flash(q, k, v, None, q.shape[1]).transpose(1, 2)

    def _flash(self, query, key, value, bounds, max_len: int) -> torch.Tensor:
        return torch.ops.aten._flash_attention_forward(
            query,
            key,
            value,
            bounds,
            bounds,
            max_len,
            max_len,
            self.dropout_p if self.training else 0.0,
            True,
            False,
            scale=self.softmax_scale,
        )[0]


class CudnnCoreAttention(SDPACoreAttention):
    """:class:`SDPACoreAttention` on cuDNN's fused attention (CUDA, bf16): packed rows one call per sample, as
    ``per_sample``, unpacked rows one call over the batch. SDPA is held to its cuDNN backend, so a shape cuDNN
    refuses fails loudly instead of falling back to another kernel."""

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[2] == 1:  # cuDNN refuses a key length of 1 (a one-token sample); any kernel is exact there
            return super()._sdpa(q, k, v)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                dropout_p=self.dropout_p if self.training else 0.0,
                is_causal=True,
                scale=self.softmax_scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )
