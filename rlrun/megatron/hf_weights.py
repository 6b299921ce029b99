"""The map between HF parameter names and Megatron ``GPTModel`` parameters, on full (unsharded) tensors.

One table (``weight_mappings``) drives both directions, so loading and export cannot disagree:

==========================================  ==============================================  ========
Megatron (local layer spec)                  HF                                              how
==========================================  ==============================================  ========
embedding.word_embeddings.weight             model.embed_tokens.weight                       vocab
decoder.layers.i.input_layernorm.weight      model.layers.i.input_layernorm.weight           copy
decoder.layers.i.self_attention.linear_qkv   model.layers.i.self_attn.{q,k,v}_proj           qkv
decoder.layers.i.self_attention.q_layernorm  model.layers.i.self_attn.q_norm (Qwen3)         copy
decoder.layers.i.self_attention.linear_proj  model.layers.i.self_attn.o_proj                 o_proj
decoder.layers.i.pre_mlp_layernorm.weight    model.layers.i.post_attention_layernorm.weight  copy
decoder.layers.i.mlp.linear_fc1.weight       model.layers.i.mlp.{gate,up}_proj.weight        concat
decoder.layers.i.mlp.linear_fc2.weight       model.layers.i.mlp.down_proj.weight             copy
decoder.final_layernorm.weight               model.norm.weight                               copy
output_layer.weight (untied only)            lm_head.weight                                  vocab
==========================================  ==============================================  ========

MoE layers map their router, experts and shared expert instead of ``mlp.linear_fc*`` (``rlrun.megatron.moe``);
the dense layers of an MoE model (``mlp_only_layers``, ``decoder_sparse_step``) map as above.

Layouts: ``linear_qkv`` is ``[num_groups, (heads_per_group + 2) * head_dim, hidden]`` flattened, i.e.
each query group's q heads, then its k head, then its v head (biases alike), so a TP shard is whole
query groups. ``linear_proj`` is o_proj, ``[hidden, num_heads * head_dim]``. ``linear_fc1`` is
``[gate; up]``.

Pipeline stages (``weight_mappings(arch, pp_rank, pp_size)``): stage ``s`` holds global layers
``[s * L/pp, (s + 1) * L/pp)`` under the local names ``decoder.layers.0 ...``, the first stage the
embedding, the last the final norm and output layer. With tied embeddings the last stage holds its own
copy of the embedding as ``output_layer.weight`` (Megatron keeps the two equal by summing their
gradients); it is loaded from ``model.embed_tokens.weight`` but never exported (``exported=False``).

Padding, all with zeros, added by ``to_megatron`` for a TP size and cut off by ``to_hf`` (which reads the
padded sizes from the tensor, so it needs no TP size): vocabulary rows up to
``ModelArch.padded_vocab_size``, and inert key/value groups appended after the real ones up to
``ModelArch.padded_num_kv_heads`` (``linear_qkv`` rows, ``linear_proj`` columns; see "Head padding" in
``hf_config``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from rlrun.megatron.hf_config import ModelArch
from rlrun.megatron.moe import moe_mlp_mappings

Kind = Literal["copy", "vocab", "qkv", "o_proj", "concat", "mla_q", "mla_kv"]


@dataclass(frozen=True)
class WeightMapping:
    """One Megatron parameter and the HF tensors it is made of."""

    megatron_name: str
    hf_names: tuple[str, ...]
    kind: Kind
    exported: bool = True
    """False for a copy of a tensor another stage exports (the last stage's tied output layer)."""


def weight_mappings(
    arch: ModelArch, pp_rank: int = 0, pp_size: int = 1, ep_rank: int = 0, ep_size: int = 1
) -> list[WeightMapping]:
    """Every parameter of pipeline stage ``pp_rank`` of ``pp_size`` of the Megatron model of ``arch``, in
    HF checkpoint order (so stage after stage is the whole checkpoint's order). MoE layers list the
    experts of expert-parallel rank ``ep_rank`` of ``ep_size`` only (``rlrun.megatron.moe``)."""
    if arch.num_layers % pp_size != 0:
        raise ValueError(
            f"parallel.pp ({pp_size}) must divide config.json num_hidden_layers ({arch.num_layers}) "
            f"because every pipeline stage holds the same number of layers; set parallel.pp to a divisor"
        )
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    per_stage = arch.num_layers // pp_size
    maps = [WeightMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")] if first else []
    for local in range(per_stage):
        i = pp_rank * per_stage + local
        mc, hf = f"decoder.layers.{local}.", f"model.layers.{i}."
        attn = f"{hf}self_attn."
        maps.append(WeightMapping(f"{mc}input_layernorm.weight", (f"{hf}input_layernorm.weight",), "copy"))
        if arch.mla is not None:  # multi-latent attention (rlrun.megatron.mla)
            maps += [WeightMapping(*row) for row in arch.mla.mappings(mc, attn)]
        else:
            maps += _attention_mappings(arch, mc, attn)
        maps.append(WeightMapping(f"{mc}pre_mlp_layernorm.weight", (f"{hf}post_attention_layernorm.weight",), "copy"))
        if arch.moe is not None and arch.moe.moe_layers[i]:
            maps += [WeightMapping(*row) for row in moe_mlp_mappings(arch.moe, mc, hf, ep_rank, ep_size)]
            continue
        maps.append(
            WeightMapping(
                f"{mc}mlp.linear_fc1.weight", (f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"), "concat"
            )
        )
        maps.append(WeightMapping(f"{mc}mlp.linear_fc2.weight", (f"{hf}mlp.down_proj.weight",), "copy"))
    if not last:
        return maps
    maps.append(WeightMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"))
    if not arch.tie_embeddings:
        maps.append(WeightMapping("output_layer.weight", ("lm_head.weight",), "vocab"))
    elif not first:
        maps.append(WeightMapping("output_layer.weight", ("model.embed_tokens.weight",), "vocab", exported=False))
    return maps


def _attention_mappings(arch: ModelArch, mc: str, attn: str) -> list[WeightMapping]:
    """Grouped-query attention: packed q/k/v (and biases), QK-norm, o_proj."""
    maps = []
    maps.append(
        WeightMapping(f"{mc}self_attention.linear_qkv.weight", tuple(f"{attn}{p}_proj.weight" for p in "qkv"), "qkv")
    )
    if arch.qkv_bias:
        maps.append(
            WeightMapping(f"{mc}self_attention.linear_qkv.bias", tuple(f"{attn}{p}_proj.bias" for p in "qkv"), "qkv")
        )
    if arch.qk_norm:
        maps.append(WeightMapping(f"{mc}self_attention.q_layernorm.weight", (f"{attn}q_norm.weight",), "copy"))
        maps.append(WeightMapping(f"{mc}self_attention.k_layernorm.weight", (f"{attn}k_norm.weight",), "copy"))
    maps.append(WeightMapping(f"{mc}self_attention.linear_proj.weight", (f"{attn}o_proj.weight",), "o_proj"))
    return maps


def _zero_pad(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``tensor`` with zeros appended along ``dim`` up to ``size``."""
    missing = list(tensor.shape)
    missing[dim] = size - tensor.shape[dim]
    return torch.cat([tensor, tensor.new_zeros(missing)], dim=dim)


def to_megatron(arch: ModelArch, mapping: WeightMapping, hf_tensors: list[torch.Tensor], tp: int) -> torch.Tensor:
    """Build the full Megatron tensor of ``mapping`` from its HF tensors (in ``hf_names`` order), padded
    for a model with ``tp`` tensor-parallel ranks."""
    if mapping.kind == "copy":
        return hf_tensors[0]
    if mapping.kind in ("mla_q", "mla_kv"):
        return arch.mla.permute_rope_rows(mapping.kind, hf_tensors[0])
    if mapping.kind == "concat":
        return torch.cat(hf_tensors, dim=0)
    if mapping.kind == "vocab":
        return _zero_pad(hf_tensors[0], 0, arch.padded_vocab_size(tp))
    if mapping.kind == "o_proj":
        return _zero_pad(hf_tensors[0], 1, arch.padded_num_heads(tp) * arch.head_dim)
    q, k, v = (t.reshape(arch.num_kv_heads, -1, *t.shape[1:]) for t in hf_tensors)
    groups = _zero_pad(torch.cat([q, k, v], dim=1), 0, arch.padded_num_kv_heads(tp))
    return groups.reshape(-1, *q.shape[2:])


def to_hf(arch: ModelArch, mapping: WeightMapping, full: torch.Tensor) -> list[torch.Tensor]:
    """Split a full Megatron tensor back into its HF tensors, padding dropped (inverse of ``to_megatron``)."""
    if mapping.kind == "copy":
        return [full]
    if mapping.kind in ("mla_q", "mla_kv"):
        return [arch.mla.permute_rope_rows(mapping.kind, full, to_hf=True)]
    if mapping.kind == "concat":
        return list(full.chunk(len(mapping.hf_names), dim=0))
    if mapping.kind == "vocab":
        return [full[: arch.vocab_size]]
    if mapping.kind == "o_proj":
        return [full[:, : arch.num_heads * arch.head_dim]]
    q_rows = arch.heads_per_group * arch.head_dim
    groups = full.reshape(-1, q_rows + 2 * arch.head_dim, *full.shape[1:])[: arch.num_kv_heads]
    q, k, v = groups.split([q_rows, arch.head_dim, arch.head_dim], dim=1)
    return [t.reshape(-1, *full.shape[1:]) for t in (q, k, v)]


class HFCheckpoint:
    """Lazy reader of the safetensors files of an HF directory (single file or sharded with an index)."""

    def __init__(self, hf_dir: str | Path):
        hf_dir = Path(hf_dir)
        index = hf_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: hf_dir / file for name, file in weight_map.items()}
        else:
            files = sorted(hf_dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"model.path ({hf_dir}) must contain *.safetensors weights; "
                    f"save the model with save_pretrained(safe_serialization=True)"
                )
            self._file_of = {}
            for file in files:
                with safe_open(file, "pt") as handle:
                    self._file_of.update({name: file for name in handle.keys()})
        self.hf_dir = hf_dir

    def names(self) -> list[str]:
        return list(self._file_of)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise KeyError(f"{self.hf_dir}: tensor {name!r} is missing from the safetensors files")
        with safe_open(self._file_of[name], "pt") as handle:
            return handle.get_tensor(name)
