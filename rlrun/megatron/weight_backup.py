"""CPU copies of one model's weights under tags ("actor", "ref", "teacher", "old_actor"), swapped in and out.

Roles that need a different set of weights for a forward pass (the reference, a teacher, the previous
policy) do not get models of their own: their weights live in host memory and are copied into the one
Megatron model for their forward pass, then the actor's weights are copied back (slime's
``TensorBackuper``). Each copy is this rank's shard (TP-sliced), so host memory per rank is
``num_tags x shard size``.

Hazard: ``restore`` overwrites the live parameters. Back the actor up first and restore it before the
optimizer runs; the optimizer's fp32 main weights (bf16 models) are not touched, so the actor backup
must hold exactly the weights the optimizer last wrote.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class WeightBackup:
    """Tagged host copies of ``module``'s parameters and buffers (same names, shapes and dtypes); with
    ``trainable_only``, of the parameters that train alone (LoRA: the base is frozen, so copies of the adapters
    are whole copies of the weights as long as no role loads other base weights)."""

    def __init__(self, module: torch.nn.Module, trainable_only: bool = False) -> None:
        self._module = module
        self._trainable_only = trainable_only
        self._copies: dict[str, dict[str, torch.Tensor]] = {}
        self._on_cuda = any(t.is_cuda for _, t in self._named_tensors())

    @property
    def tags(self) -> list[str]:
        return list(self._copies)

    def backup(self, tag: str) -> None:
        """Copy the live weights into ``tag`` (allocated on first use, reused after)."""
        store = self._copies.get(tag)
        if store is None:
            store = self._copies[tag] = {name: self._host_like(t) for name, t in self._named_tensors()}
        with torch.no_grad():
            for name, tensor in self._named_tensors():
                store[name].copy_(tensor.detach(), non_blocking=True)
        self._synchronize()

    def restore(self, tag: str) -> None:
        """Copy ``tag`` into the live weights."""
        store = self._get(tag)
        with torch.no_grad():
            for name, tensor in self._named_tensors():
                tensor.copy_(store[name], non_blocking=True)
        self._synchronize()

    def copy(self, src: str, dst: str) -> None:
        """Make ``dst`` a copy of ``src`` without touching the live weights."""
        source = self._get(src)
        target = self._copies.setdefault(dst, {name: self._host_like(t) for name, t in source.items()})
        for name, tensor in source.items():
            target[name].copy_(tensor)

    def get(self, tag: str) -> dict[str, torch.Tensor]:
        """The host tensors of ``tag`` by parameter name (read them, do not keep them across backups)."""
        return self._get(tag)

    def _get(self, tag: str) -> dict[str, torch.Tensor]:
        if tag not in self._copies:
            raise KeyError(
                f"weight backup tag ({tag!r}) must be one of {self.tags} because only those were "
                f"backed up; call backup({tag!r}) first"
            )
        return self._copies[tag]

    def _named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._trainable_only:
            yield from ((name, p) for name, p in self._module.named_parameters() if p.requires_grad)
            return
        yield from self._module.named_parameters()
        yield from self._module.named_buffers()

    @staticmethod
    def _host_like(tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        # Pinned memory lets the GPU copy run asynchronously; pageable memory would serialise it.
        return host.pin_memory() if tensor.is_cuda else host

    def _synchronize(self) -> None:
        """``non_blocking`` copies between pinned host memory and the GPU must finish before use."""
        if self._on_cuda:
            torch.cuda.synchronize()
