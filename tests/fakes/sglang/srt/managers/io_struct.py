"""The request objects the SGLang worker builds, with 0.5.23's names, fields and defaults
(``sglang/srt/managers/io_struct.py``; msgspec kw_only structs there, kw_only dataclasses here).
With ``FAKE_SGLANG_VERSION=0.5.17`` they are 0.5.17's: no Begin/EndWeightUpdateReqInput, and
UpdateWeightsFromTensorReqInput has ``disable_draft_model`` where 0.5.23 has ``selector`` (0.5.17 l.1699-1721).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal, Optional

SESSIONS = os.environ.get("FAKE_SGLANG_VERSION", "0.5.23") >= "0.5.23"


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
    if SESSIONS:
        selector: Literal["target", "draft", "all"] = "all"
    else:
        disable_draft_model: Optional[bool] = None
    torch_empty_cache: bool = False


@dataclasses.dataclass(kw_only=True)
class ReleaseMemoryOccupationReqInput(BaseReq):
    tags: Optional[list[str]] = None


@dataclasses.dataclass(kw_only=True)
class ResumeMemoryOccupationReqInput(BaseReq):
    tags: Optional[list[str]] = None


if SESSIONS:

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
    return_routed_experts: bool = False
    stream: bool = False
    logprob_start_len: Optional[int | list[int]] = None
    """Where ``input_token_logprobs`` start in the input; None / -1: output tokens only (io_struct.py:567)."""
