"""``sglang``: the worker backend hosting ``sglang.Engine`` in the worker process (the only module
that imports sglang, and only when this backend is built).

It follows the engine contract (docs/engine-contract.md, "Processes and transport" and "Methods"):

* **environment**: the worker inherits the trainer's CUDA_VISIBLE_DEVICES and gets
  ``base_gpu_id=LOCAL_RANK``, so a device index in a CUDA IPC handle names the same GPU on both
  sides; the client drops PYTORCH_CUDA_ALLOC_CONF and torchrun's variables; each engine gets its own
  free ``nccl_port``;
* **one event loop**: the worker's RPC server runs on ``engine.loop``; generation is
  ``engine.async_generate`` and controls are awaited on ``engine.tokenizer_manager`` (the ``Engine``
  has no pause/continue/abort), so abort and pause work while a generation is in flight;
* **versions**: 0.5.17 and 0.5.23 differ where this adapter touches them (docs/sglang-versions.md):
  0.5.23 needs a ``begin_weight_update``/``end_weight_update`` session, 0.5.17 has none; the weight
  version is ``tokenizer_manager.config_value("weight_version")`` or ``Engine.get_model_info()``;
  the payload unpickler allows exact globals (0.5.23) or module prefixes (0.5.17).
  :class:`SglangCapabilities` reads these off the live objects, never off a version number, and
  each operation has one code path that consults it;
* **samples**: ``n`` is expanded here into one request per sample (SGLang would regenerate the
  rids, and give every sample the same ``sampling_seed``), with rid ``<rid>-<j>`` and the same
  per-sample seed as the embedded engine. SGLang only honours ``sampling_seed`` with
  ``enable_deterministic_inference=True`` (pass it in ``server_args``);
* **payloads**: one flattened_bucket payload per engine TP rank, each global of which is first put to
  the installed SGLang's own ``SafeUnpickler.find_class`` (:func:`check_payload`), because a payload
  SGLang refuses kills its scheduler.

:func:`to_gen_result` turns SGLang's output dict into the contract's ``GenResult`` (pure function).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from rlrun.engine.payload import payload_globals
from rlrun.engine.registry import BackendSpec
from rlrun.engine.sampling import SamplingParams
from rlrun.engine.types import FinishReason, GenResult, OpResult


def to_gen_result(
    output: Mapping[str, Any], rid: str, return_logprob: bool, routed_topk: int | None = None
) -> GenResult:
    """One non-streaming ``async_generate`` output (``{"text", "output_ids", "meta_info"}``) as a ``GenResult``.

    ``meta_info["output_token_logprobs"]`` is a list of ``(logprob, token_id, text_or_None)``;
    its token ids must be ``output_ids`` (SGLang keeps a matched EOS / stop token in ``output_ids``
    and only trims the text).
    """
    meta = output["meta_info"]
    output_ids = [int(t) for t in output["output_ids"]]
    logprobs = None
    if return_logprob:
        entries = meta["output_token_logprobs"]
        if [int(e[1]) for e in entries] != output_ids:
            raise ValueError(
                f"meta_info.output_token_logprobs of request {meta['id']} must list the output_ids "
                "in order because each log-prob belongs to one sampled token; SGLang's output changed"
            )
        logprobs = [float(e[0]) for e in entries]
    result: GenResult = {
        "rid": rid,
        "output_ids": output_ids,
        "output_logprobs": logprobs,
        "finish_reason": _finish_reason(meta["finish_reason"]),
        "prompt_tokens": int(meta["prompt_tokens"]),
        "completion_tokens": int(meta["completion_tokens"]),
        "weight_version": str(meta["weight_version"]),
    }
    if routed_topk is not None and meta.get("routed_experts"):  # base64 int32 [seqlen - 1, layers, topk]
        result["routed_experts"] = {"data": meta["routed_experts"], "topk": routed_topk}
    return result


def _finish_reason(reason: Mapping[str, Any] | None) -> FinishReason:
    if reason is None:
        raise ValueError("meta_info.finish_reason (None) must be set because a non-streaming result is finished")
    kind = reason["type"]
    if kind == "stop":
        return {"type": "stop", "matched": reason["matched"]}
    if kind == "length":
        return {"type": "length", "length": int(reason["length"])}
    if kind == "abort":
        return {"type": "abort", "message": str(reason.get("message") or "Aborted")}
    raise ValueError(f"meta_info.finish_reason.type ({kind!r}) must be stop, length or abort as in SGLang 0.5.23")


def sglang_sampling_params(params: SamplingParams, prompt: list[int], sample_index: int) -> dict[str, Any]:
    """SGLang's sampling_params for sample ``sample_index`` of ``prompt`` (always n=1, see the module doc).
    ``params`` is already normalised: temperature 0 became top_k=1, top_k 0 became -1."""
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "ignore_eos": params.ignore_eos,
        "n": 1,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        out["stop"] = list(params.stop)
    if params.sampling_seed is not None:
        out["sampling_seed"] = params.sample_seed(prompt, sample_index) % 2**63  # SGLang wants an int64
    return out


@dataclasses.dataclass(frozen=True)
class SglangCapabilities:
    """What the installed SGLang offers where 0.5.17 and 0.5.23 differ, read off the live objects."""

    weight_update_sessions: bool
    """Updates must run between ``begin_weight_update``/``end_weight_update`` (0.5.23's
    ``TokenizerManager`` has them; 0.5.17 has neither, and its updates need no session)."""
    weight_version_from: Literal["config_value", "model_info"]
    """``tokenizer_manager.config_value("weight_version")`` (0.5.17; a plain read, safe on the running
    loop) or, where the manager lacks it, ``Engine.get_model_info()["weight_version"]``."""
    unpickler: type
    """``sglang.srt.utils.common.SafeUnpickler``: an exact ``(module, name)`` allowlist in 0.5.23,
    module prefixes plus a deny list in 0.5.17. Its ``find_class`` is the judge of a payload."""

    @classmethod
    def detect(cls, engine: Any, unpickler: type) -> SglangCapabilities:
        tm = engine.tokenizer_manager
        sessions = hasattr(tm, "begin_weight_update") and hasattr(engine, "begin_weight_update")
        source: Literal["config_value", "model_info"] = "config_value" if hasattr(tm, "config_value") else "model_info"
        return cls(weight_update_sessions=sessions, weight_version_from=source, unpickler=unpickler)


def check_payload(payload: bytes, unpickler: type) -> None:
    """Refuse a payload whose globals ``unpickler`` (the installed SGLang's ``SafeUnpickler``) would
    refuse, reading the globals from the opcodes without unpickling (the payload's file descriptors
    and CUDA IPC handles stay unclaimed): in SGLang the refusal is raised inside the scheduler,
    which takes the whole engine down."""
    probe = unpickler(io.BytesIO(b""))
    for module, name in payload_globals(payload):
        try:
            probe.find_class(module, name)
        except Exception as exc:  # SGLang raises RuntimeError; an allowed name that fails to import is as fatal
            raise ValueError(
                f"payload global {module}.{name} must be on the installed SGLang's unpickling "
                f"allowlist because its scheduler dies on a refused payload ({exc}); build payloads "
                "with rlrun.engine.payload.serialize_flattened_bucket"
            ) from None


def input_logprobs(output: dict, ids: list[int], start: int) -> list[float]:
    """The log-probs of ``ids[start:]`` from a prefill-only output asked with ``logprob_start_len = start - 1``,
    checked to be of exactly those tokens (a window off by one would score the wrong tokens silently)."""
    entries = output["meta_info"]["input_token_logprobs"][1:]
    scored = [token_id for _, token_id, *_ in entries]
    if scored != ids[start:]:
        raise RuntimeError(
            f"SGLang's input_token_logprobs cover tokens {scored[:8]}... ({len(scored)}), not the {len(ids) - start} "
            f"tokens from position {start} that were asked for; the logprob_start_len contract changed"
        )
    return [float(logprob) for logprob, *_ in entries]


def _routed_topk(spec: BackendSpec) -> int | None:
    """``num_experts_per_tok`` of the model when the server was started to return routed experts (SGLang
    leaves reshaping its flat ids to the caller's model config), else None."""
    if not spec.server_args.get("enable_return_routed_experts"):
        return None
    config = json.loads((Path(spec.model_path) / "config.json").read_text())
    return int(config.get("text_config", config)["num_experts_per_tok"])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _as_op_result(result: tuple) -> OpResult:
    return {"success": bool(result[0]), "message": str(result[1])}


class SglangBackend:
    """``sglang.Engine`` behind the worker's backend interface."""

    def __init__(self, spec: BackendSpec) -> None:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # breaks torch_memory_saver; the client drops it too
        import sglang
        from sglang.srt.managers import io_struct
        from sglang.srt.utils.common import SafeUnpickler

        self._io = io_struct
        kwargs = {
            "model_path": spec.model_path,
            "tp_size": spec.tp_size,
            "base_gpu_id": spec.base_gpu_id,
            "nccl_port": _free_port(),
            "enable_memory_saver": spec.enable_memory_saver,
            "random_seed": spec.seed,
            "dtype": spec.dtype,
            **spec.server_args,
        }
        self.engine = sglang.Engine(**kwargs)
        self.tm = self.engine.tokenizer_manager
        self.loop = self.engine.loop
        self.tp_size = spec.tp_size
        self.capabilities = SglangCapabilities.detect(self.engine, SafeUnpickler)
        self.routed_topk = _routed_topk(spec)
        """The model's top-k when the server records routed experts (``enable_return_routed_experts`` in
        ``engine.server_args``, for ``algorithm.routing_replay: rollout``); requests then ask for them."""
        self._inflight: set[str] = set()

    @property
    def weight_version(self) -> str:
        if self.capabilities.weight_version_from == "config_value":
            return str(self.tm.config_value("weight_version"))
        return str(self.engine.get_model_info()["weight_version"])

    async def generate(
        self, input_ids: list[list[int]], params: list[SamplingParams], return_logprob: bool, rids: list[str]
    ) -> list[GenResult]:
        prompts, sglang_params, sample_rids = [], [], []
        for prompt, p, rid in zip(input_ids, params, rids, strict=False):
            for j in range(p.n):
                prompts.append(prompt)
                sglang_params.append(sglang_sampling_params(p, prompt, j))
                sample_rids.append(rid if p.n == 1 else f"{rid}-{j}")
        self._inflight.update(sample_rids)
        try:
            routed = {"return_routed_experts": True} if self.routed_topk is not None else {}
            outputs = await self.engine.async_generate(
                input_ids=prompts,
                sampling_params=sglang_params,
                return_logprob=return_logprob,
                rid=sample_rids,
                **routed,
            )
        finally:
            self._inflight.difference_update(sample_rids)
        return [
            to_gen_result(out, rid, return_logprob, self.routed_topk)
            for out, rid in zip(outputs, sample_rids, strict=False)
        ]

    async def abort(self, rid: str, abort_all: bool) -> None:
        # The TokenizerManager only forwards rids it knows exactly, so the prefix is matched here.
        if abort_all:
            self.tm.abort_request(abort_all=True)
        elif rid:
            for sample_rid in [r for r in self._inflight if r.startswith(rid)]:
                self.tm.abort_request(rid=sample_rid)

    async def pause_generation(self, mode: str) -> None:
        await self.tm.pause_generation(self._io.PauseGenerationReqInput(mode=mode))

    async def continue_generation(self) -> None:
        await self.tm.continue_generation(self._io.ContinueGenerationReqInput(torch_empty_cache=True))

    async def flush_cache(self) -> OpResult:
        result = await self.tm.flush_cache()
        return {"success": bool(result.success), "message": str(result.message)}

    async def release_memory_occupation(self, tags: list[str]) -> None:
        await self.tm.release_memory_occupation(self._io.ReleaseMemoryOccupationReqInput(tags=tags), None)

    async def resume_memory_occupation(self, tags: list[str]) -> None:
        await self.tm.resume_memory_occupation(self._io.ResumeMemoryOccupationReqInput(tags=tags), None)

    async def begin_weight_update(self) -> OpResult:
        if not self.capabilities.weight_update_sessions:  # 0.5.17: none needed (the worker still enforces one)
            return {"success": True, "message": "Success"}
        return _as_op_result(await self.tm.begin_weight_update(self._io.BeginWeightUpdateReqInput(), None))

    async def end_weight_update(self) -> OpResult:
        """Close the session (0.5.23), then drop SGLang's prefix cache: its KV was computed with the old
        weights, and the buckets were loaded with ``flush_cache=False``. Requests held by an in-place
        pause keep their KV (SGLang cannot flush under them), as in SGLang itself."""
        if self.capabilities.weight_update_sessions:
            ended = _as_op_result(await self.tm.end_weight_update(self._io.EndWeightUpdateReqInput(), None))
            if not ended["success"]:
                return ended
        if self._inflight:
            return {"success": True, "message": "Success"}
        return await self.flush_cache()

    async def update_weights_from_tensor(
        self, payloads: list[bytes], load_format: str, weight_version: str | None
    ) -> OpResult:
        for payload in payloads:
            check_payload(payload, self.capabilities.unpickler)
        request = self._io.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads, load_format=load_format, flush_cache=False, weight_version=weight_version
        )
        return _as_op_result(await self.tm.update_weights_from_tensor(request, None))

    async def weight_checksums(self) -> dict[str, str]:
        raise NotImplementedError(
            "weight_checksums needs per-tensor access to the engine's weights, which "
            "sglang.Engine does not offer; verify syncs with the embedded backend"
        )

    async def score_tokens(
        self, input_ids: list[list[int]], starts: list[int], temperature: float
    ) -> list[list[float]]:
        """Prefill-only requests (``max_new_tokens`` 0, as slime's SGLang teacher sends) with
        ``logprob_start_len`` one token before each start: SGLang's ``input_token_logprobs`` then open with
        the token at that position (logprob None: nothing in the window conditions it), dropped here."""
        for ids, start in zip(input_ids, starts, strict=True):
            if not 1 <= start < len(ids):
                raise ValueError(
                    f"start ({start}) must be in [1, {len(ids) - 1}] because the first token has no logprob"
                )
        outputs = await self.engine.async_generate(
            input_ids=input_ids,
            sampling_params=[{"max_new_tokens": 0, "temperature": temperature} for _ in input_ids],
            return_logprob=True,
            logprob_start_len=[start - 1 for start in starts],
        )
        return [input_logprobs(out, ids, start) for out, ids, start in zip(outputs, input_ids, starts, strict=True)]

    def shutdown(self) -> None:
        self.engine.shutdown()
