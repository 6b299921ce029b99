"""The request objects the SGLang worker builds, with 0.5.23's names, fields and defaults
(``sglang/srt/managers/io_struct.py``; msgspec kw_only structs there, kw_only dataclasses here)."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional


@dataclasses.dataclass(kw_only=True)
class BaseReq:
    rid: Optional[str] = None
    http_worker_ipc: Optional[str] = None


@dataclasses.dataclass(kw_only=True)
class PauseGenerationReqInput(BaseReq):
    mode: Literal["abort", "retract", "in_place"] = "abort"


@dataclasses.dataclass(kw_only=True)
class ContinueGenerationReqInput(BaseReq):
    torch_empty_cache: bool = True


@dataclasses.dataclass(kw_only=True)
class UpdateWeightsFromTensorReqInput(BaseReq):
    serialized_named_tensors: list[bytes]
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


@dataclasses.dataclass(kw_only=True)
class ReleaseMemoryOccupationReqInput(BaseReq):
    tags: Optional[list[str]] = None


@dataclasses.dataclass(kw_only=True)
class ResumeMemoryOccupationReqInput(BaseReq):
    tags: Optional[list[str]] = None


@dataclasses.dataclass(kw_only=True)
class BeginWeightUpdateReqInput(BaseReq):
    selector: Literal["target", "draft", "all"] = "all"


@dataclasses.dataclass(kw_only=True)
class EndWeightUpdateReqInput(BaseReq):
    pass


@dataclasses.dataclass(kw_only=True)
class FlushCacheReqOutput(BaseReq):
    success: bool
    message: str = ""


@dataclasses.dataclass(kw_only=True)
class GenerateReqInput:
    """The fields of 0.5.23's GenerateReqInput that the fake serves (token ids in, no streaming)."""

    input_ids: list[int] | list[list[int]]
    sampling_params: Optional[dict | list[dict]] = None
    return_logprob: bool = False
    rid: Optional[str | list[str]] = None
    stream: bool = False
