"""SGLang 0.5.23's flattened-bucket types (``sglang/srt/weight_sync/tensor_bucket.py``), reconstruction only."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    def __init__(self, flattened_tensor: torch.Tensor, metadata: list[FlattenedTensorMetadata]):
        self.flattened_tensor = flattened_tensor
        self.metadata = metadata

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [
            (meta.name, self.flattened_tensor[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape))
            for meta in self.metadata
        ]
