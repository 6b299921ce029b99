"""The fake's TokenizerManager: SGLang's control methods and their locking, plus a one-thread "scheduler".

``TokenizerManager`` is 0.5.17's (no weight-update sessions; ``FAKE_SGLANG_VERSION=0.5.17``),
``TokenizerManager0523`` adds what 0.5.23 changed (docs/sglang-versions.md has both with file:line).
What is reproduced (file:line of the 0.5.23 wheel unless marked 0.5.17):
* ``abort_request`` ignores an empty rid and unknown rids, the scheduler aborts by rid prefix; an
  aborted request returns its partial output with SGLang's abort finish_reason (tokenizer_manager.py:2241);
* ``pause_generation``: ``abort`` mode aborts everything until no generation holds the
  model_update_lock (re-checking every 1 s), other modes hold requests in place; new generate calls
  block while paused (l.939, 2267);
* weight updates take the model_update_lock as writer unless paused (tokenizer_control_mixin.py:471-600;
  0.5.17: :497-528); 0.5.23 refuses them outside a begin/end session with its exact messages
  (weight_updater.py:187-335); 0.5.17 has no sessions (scheduler_components/weight_updater.py:153-166);
* an update asking to flush the cache while requests run: 0.5.23 answers ``(False, "Weights were
  updated, but the cache was not flushed ...")``, 0.5.17's scheduler asserts and dies (0.5.17
  scheduler_components/weight_updater.py:103-108);
* the scheduler *dies* (the whole process, as SGLang's SIGQUIT to its parent does) on: release while
  not idle (assert, weight_updater.py:339), resume of a tag not released (``set.remove`` KeyError),
  generation while memory is released (an illegal memory access on GPU), a payload its
  SafeUnpickler refuses, a payload list whose length is not ``tp_size`` or a weight whose shape does
  not fit (no try/except on the flattened path);
* with ``enable_memory_saver`` and no ``enable_weights_cpu_backup``, weights are garbage (NaN here)
  after a release/resume until the next update.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import resource_sharer

import torch

from rlrun.engine.embedded.decode_control import DecodeControl
from rlrun.engine.embedded.engine import EmbeddedEngine
from rlrun.engine.payload import tensor_checksum
from rlrun.engine.sampling import SamplingParams
from sglang.srt.managers.io_struct import FlushCacheReqOutput
from sglang.srt.utils.common import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

ALL_TAGS = ["kv_cache", "weights", "cuda_graph"]
SAMPLING_KEYS = {
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "ignore_eos",
    "sampling_seed",
    "no_stop_trim",
    "skip_special_tokens",
    "stop_regex",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
}


def die(message: str) -> None:
    """What SGLang does when its scheduler raises: SIGQUIT to the engine's process, which kills its tree."""
    print(
        f"Scheduler hit an exception: {message}\nreceived SIGQUIT; killing the process tree",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGKILL)


def record_update(weight_version, per_rank: list, senders: list) -> None:
    """One ``fake-sglang-update {json}`` line per payload list: the sha256 of every tensor each TP rank
    received, so tests can check what every rank got against the trainer's weights, and each payload's
    sender (see :func:`deserialize_recording_sender`)."""
    payloads = [{name: tensor_checksum(tensor) for name, tensor in named} for named in per_rank]
    print(
        "fake-sglang-update "
        + json.dumps({"weight_version": weight_version, "payloads": payloads, "senders": senders}),
        file=sys.stderr,
        flush=True,
    )


def deserialize_recording_sender(payload: bytes) -> tuple[object, str | None]:
    """The payload, unpickled as SGLang does, and the address of the resource sharer its CPU tensors were
    fetched from: the process that built it. The real TP rank r can only use a payload whose CUDA memory
    is on its own GPU, which in a colocated engine group is group rank r's (seen on two H200s); on CPU the
    analogue tests can check is that payload r was built by group rank r's process."""
    senders = set()
    detach = resource_sharer.DupFd.detach

    def recording_detach(self):
        senders.add(self._id[0])
        return detach(self)

    resource_sharer.DupFd.detach = recording_detach
    try:
        loaded = MultiprocessingSerializer.deserialize(payload)
    finally:
        resource_sharer.DupFd.detach = detach
    if len(senders) > 1:
        raise AssertionError(f"one payload's tensors came from {len(senders)} processes: {sorted(senders)}")
    return loaded, next(iter(senders), None)


class _ModelUpdateLock:
    """SGLang's RWLock: generations are readers, weight updates the writer."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.readers = 0
        self.writing = False

    async def acquire_read(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writing)
            self.readers += 1

    async def release_read(self) -> None:
        async with self._cond:
            self.readers -= 1
            self._cond.notify_all()

    async def acquire_write(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writing and self.readers == 0)
            self.writing = True

    async def release_write(self) -> None:
        async with self._cond:
            self.writing = False
            self._cond.notify_all()

    async def is_locked(self) -> bool:
        return self.writing or self.readers > 0


class TokenizerManager:
    def __init__(self, server_args: dict) -> None:
        self.server_args = server_args
        self.model = EmbeddedEngine(
            server_args["model_path"],
            seed=server_args.get("random_seed") or 0,
            dtype=server_args.get("dtype", "float32"),
            device="cpu",
        )
        self.control = DecodeControl()
        self.rid_to_state: dict[str, bool] = {}
        self.is_pause = False
        self.is_pause_cond = asyncio.Condition()
        self.model_update_lock = _ModelUpdateLock()
        self.offload_tags: set[str] = set()
        self.weight_version = server_args.get("weight_version", "default")
        self._scheduler = ThreadPoolExecutor(1, thread_name_prefix="fake-scheduler")

    def config_value(self, key: str):
        return self.weight_version if key == "weight_version" else self.server_args.get(key)

    # ---- generation -------------------------------------------------------------------------------

    async def generate_request(self, obj, request=None):
        batch = bool(obj.input_ids) and isinstance(obj.input_ids[0], list)
        input_ids = obj.input_ids if batch else [obj.input_ids]
        params = (
            obj.sampling_params
            if isinstance(obj.sampling_params, list)
            else [obj.sampling_params or {}] * len(input_ids)
        )
        rids = self._rids(obj.rid, len(input_ids))
        starts = (
            obj.logprob_start_len
            if isinstance(obj.logprob_start_len, list)
            else [obj.logprob_start_len] * len(input_ids)
        )
        n = params[0].get("n", 1)
        if any(p.get("n", 1) != n for p in params):
            raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")
        if n > 1:  # expanded prompt-major with fresh rids, as _handle_batch_request does
            input_ids = [ids for ids in input_ids for _ in range(n)]
            params = [p for p in params for _ in range(n)]
            starts = [start for start in starts for _ in range(n)]
            rids = [uuid.uuid4().hex for _ in input_ids]
        # max_new_tokens 0 is a prefill-only request (scoring the input): SGLang serves it, the engine needs >= 1.
        prefill_only = [p.get("max_new_tokens") == 0 for p in params]
        parsed = [
            self._sampling_params({**p, "max_new_tokens": 1} if z else p)
            for p, z in zip(params, prefill_only, strict=True)
        ]
        async with self.is_pause_cond:
            await self.is_pause_cond.wait_for(lambda: not self.is_pause)
        await self.model_update_lock.acquire_read()
        self.rid_to_state.update((rid, True) for rid in rids)
        try:
            loop = asyncio.get_running_loop()
            outputs = await loop.run_in_executor(
                self._scheduler,
                self._run_batch,
                input_ids,
                parsed,
                rids,
                obj.return_logprob,
                obj.return_routed_experts,
                prefill_only,
                starts,
            )
        finally:
            for rid in rids:
                self.rid_to_state.pop(rid, None)
            await self.model_update_lock.release_read()
        yield outputs if batch or n > 1 else outputs[0]

    def _rids(self, rid, num: int) -> list[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(num)]
        rids = (
            [rid]
            if isinstance(rid, str) and num == 1
            else [f"{rid}_{i}" for i in range(num)]
            if isinstance(rid, str)
            else list(rid)
        )
        if len(rids) != num:
            raise ValueError("The specified rids length mismatch with the batch_size for batch processing.")
        duplicates = [r for r in rids if r in self.rid_to_state] or [r for r in set(rids) if rids.count(r) > 1]
        if duplicates:
            raise ValueError(f"Duplicate request IDs detected within the request: {duplicates}")
        return rids

    def _sampling_params(self, params: dict) -> SamplingParams:
        unknown = set(params) - SAMPLING_KEYS
        if unknown:
            raise TypeError(f"Unexpected keyword argument {sorted(unknown)[0]!r}")
        top_k = params.get("top_k", -1)
        if top_k is not None and top_k != -1 and top_k < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
        ours = {
            k: params[k]
            for k in (
                "max_new_tokens",
                "stop",
                "stop_token_ids",
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "ignore_eos",
            )
            if params.get(k) is not None
        }
        if self.server_args.get("enable_deterministic_inference") and params.get("sampling_seed") is not None:
            ours["sampling_seed"] = params["sampling_seed"]  # without it SGLang ignores sampling_seed
        return SamplingParams.from_dict(ours)

    def _run_batch(
        self, input_ids, params, rids, return_logprob, return_routed_experts=False, prefill_only=None, starts=None
    ) -> list[dict]:
        if self.offload_tags:
            die(
                f"CUDA error: an illegal memory access was encountered (memory tags {sorted(self.offload_tags)} "
                "are released)"
            )
        start = time.perf_counter()
        prefill_only = prefill_only or [False] * len(input_ids)
        rows = [i for i, z in enumerate(prefill_only) if not z]
        results: list[dict] = [_prefill_result(rid, ids) for rid, ids in zip(rids, input_ids, strict=True)]
        if rows:
            with self.control.registered([rids[i] for i in rows]) as handle:
                generated = self.model.generate(
                    [input_ids[i] for i in rows],
                    [params[i] for i in rows],
                    True,
                    [rids[i] for i in rows],
                    request=handle,
                    control=self.control,
                )
            for i, result in zip(rows, generated, strict=True):
                results[i] = result
        outputs = [
            self._output(r, p, return_logprob, time.perf_counter() - start, return_routed_experts)
            for r, p in zip(results, params, strict=False)
        ]
        for ids, p, begin, output in zip(input_ids, params, starts or [None] * len(input_ids), outputs, strict=True):
            if return_logprob and begin is not None and begin >= 0:
                output["meta_info"]["input_token_logprobs"] = self._input_logprobs(ids, begin, p.temperature)
        return outputs

    def _input_logprobs(self, ids: list[int], begin: int, temperature: float) -> list[tuple]:
        """``(logprob, token_id, None)`` for every input token from ``begin`` on; the first entry's logprob is
        None, as SGLang's (nothing inside the window conditions it). At the request's (normalised) temperature,
        as output log-probs are; rlrun only asks at T = 1."""
        if not 0 <= begin < len(ids):
            raise ValueError(f"logprob_start_len ({begin}) must be < the input length ({len(ids)})")
        scores = self.model.score_tokens([ids], [begin + 1], temperature)[0] if begin + 1 < len(ids) else []
        return [(None, ids[begin], None)] + [(lp, tid, None) for lp, tid in zip(scores, ids[begin + 1 :], strict=True)]

    def _output(
        self,
        result: dict,
        params: SamplingParams,
        return_logprob: bool,
        latency_s: float,
        return_routed_experts: bool = False,
    ) -> dict:
        """The non-streaming output dict of tokenizer_manager.py:2507-2718."""
        finish = dict(result["finish_reason"])
        if finish["type"] == "abort":
            finish.update(status_code=None, err_type=None)
        meta = {
            "id": result["rid"],
            "finish_reason": finish,
            "prompt_tokens": result["prompt_tokens"],
            "weight_version": self.weight_version,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": result["completion_tokens"],
            "cached_tokens": 0,
            "e2e_latency": latency_s,
        }
        if return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                (lp, tid, None) for lp, tid in zip(result["output_logprobs"], result["output_ids"], strict=False)
            ]
            meta["output_token_logprobs_length"] = len(result["output_ids"])
        if return_routed_experts and self.server_args.get("enable_return_routed_experts"):
            meta["routed_experts"] = result["routed_experts"]["data"]  # base64 int32 (state_capturer)
        output = {"output_ids": list(result["output_ids"]), "meta_info": meta}
        if not self.server_args.get("skip_tokenizer_init"):  # token ids only then: no "text" (serving.py:58)
            output["text"] = self._trimmed_text(result["output_ids"], finish)
        return output

    def _trimmed_text(self, output_ids: list[int], finish: dict) -> str:
        matched = finish.get("matched")
        if isinstance(matched, int):
            output_ids = output_ids[:-1]
        text = self.model.tokenizer.decode(output_ids, skip_special_tokens=True)
        return text[: text.find(matched)] if isinstance(matched, str) and matched in text else text

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if not abort_all and (not rid or rid not in self.rid_to_state):
            return
        self.control.abort(rid, abort_all)

    async def pause_generation(self, obj) -> None:
        async with self.is_pause_cond:
            self.is_pause = True
            if obj.mode != "abort":
                self.control.pause()
                return
            while True:
                self.abort_request(abort_all=True)
                if not await self.model_update_lock.is_locked():
                    break
                await asyncio.sleep(1.0)

    async def continue_generation(self, obj) -> None:
        async with self.is_pause_cond:
            self.is_pause = False
            self.control.resume()
            self.is_pause_cond.notify_all()

    # ---- cache, memory and weights (the scheduler's side) ------------------------------------------

    async def _on_scheduler(self, fn, *args):
        """Run a control on the scheduler thread; while paused in place that thread may be held by a
        parked generation, so (as SGLang's scheduler loop stays free) run it beside it instead."""
        if self.is_pause and self.control.num_requests:
            while not self.control.all_parked():
                await asyncio.sleep(0.005)
            return await asyncio.to_thread(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._scheduler, fn, *args)

    async def flush_cache(self, timeout_s=None) -> FlushCacheReqOutput:
        if self.rid_to_state:
            return FlushCacheReqOutput(
                success=False,
                message=f"Cache not flushed because there are pending "
                f"requests. #queue-req: 0, #running-req: {len(self.rid_to_state)}",
            )
        print("fake-sglang-flush-cache", file=sys.stderr, flush=True)  # for tests: the adapter flushed here
        return FlushCacheReqOutput(success=True, message="Cache flushed.")

    async def release_memory_occupation(self, obj, request=None) -> None:
        if self.rid_to_state:  # the scheduler handles the release between two decode steps
            die("AssertionError: release_memory_occupation should be called only when server is idle.")
        await self._on_scheduler(self.offload_tags.update, obj.tags or ALL_TAGS)

    async def resume_memory_occupation(self, obj, request=None) -> None:
        await self._on_scheduler(self._resume, obj.tags or ALL_TAGS)

    def _resume(self, tags: list[str]) -> None:
        for tag in tags:
            if tag not in self.offload_tags:
                die(f"KeyError: {tag!r}\n{''.join(traceback.format_stack(limit=3))}")
            self.offload_tags.remove(tag)
        garbage = self.server_args.get("enable_memory_saver") and not self.server_args.get("enable_weights_cpu_backup")
        if "weights" in tags and garbage:
            with torch.no_grad():
                for param in self.model.named_parameters().values():
                    param.fill_(float("nan"))

    async def update_weights_from_tensor(self, obj, request=None) -> tuple[bool, str]:
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        if self.is_pause:
            success, message = await self._on_scheduler(self._load, obj)
        else:
            await self.model_update_lock.acquire_write()
            try:
                success, message = await self._on_scheduler(self._load, obj)
            finally:
                await self.model_update_lock.release_write()
        if success and obj.weight_version is not None:
            self.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
        return success, message

    def _load(self, obj) -> tuple[bool, str]:
        try:
            tp_size = self.server_args.get("tp_size", 1)
            assert len(obj.serialized_named_tensors) == tp_size, (
                f"{len(obj.serialized_named_tensors)} serialized_named_tensors for tp_size {tp_size}"
            )
            # TP rank r unpickles entry r and loads full tensors; the fake's one model stands for every rank.
            loaded = [deserialize_recording_sender(payload) for payload in obj.serialized_named_tensors]
            per_rank = [self._named_tensors(payload, obj.load_format) for payload, _ in loaded]
            params = self.model.named_parameters()
            for named in per_rank:
                for name, tensor in named:
                    assert name not in params or params[name].shape == tensor.shape, (
                        f"{name}: {params[name].shape} != {tensor.shape}"
                    )
            record_update(obj.weight_version, per_rank, [sender for _, sender in loaded])
            for name, tensor in per_rank[0]:
                if name not in params:
                    print(f"Parameter {name} not found in params_dict", file=sys.stderr, flush=True)
                    continue
                with torch.no_grad():
                    params[name].copy_(tensor)
        except Exception as exc:  # no try/except on SGLang's flattened path: the scheduler dies
            die(f"{type(exc).__name__}: {exc}")
        return self._flush_after_update(obj)

    def _flush_after_update(self, obj) -> tuple[bool, str]:
        if obj.flush_cache and self.rid_to_state:  # 0.5.17: `assert flush_cache_success` in the scheduler
            die("AssertionError: Cache flush failed after updating weights")
        return True, "Success"

    @staticmethod
    def _named_tensors(payload, load_format):
        if load_format != "flattened_bucket":
            return payload
        metadata = [
            FlattenedTensorMetadata(
                name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel
            )
            for m in payload["metadata"]
        ]
        return FlattenedTensorBucket(
            flattened_tensor=payload["flattened_tensor"], metadata=metadata
        ).reconstruct_tensors()

    def shutdown(self) -> None:
        self.control.abort(abort_all=True)
        self._scheduler.shutdown(wait=False, cancel_futures=True)


class TokenizerManager0523(TokenizerManager):
    """0.5.23: weight updates only inside a begin/end session (weight_updater.py:187-240, 309-335), and a
    flush refused while requests run comes back as a message instead of killing the scheduler (l.120-133)."""

    def __init__(self, server_args: dict) -> None:
        super().__init__(server_args)
        self.session_open = False

    async def begin_weight_update(self, obj, request=None) -> tuple[bool, str]:
        if self.session_open:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session_open = True
        return True, "Success"

    async def end_weight_update(self, obj, request=None) -> tuple[bool, str]:
        if not self.session_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session_open = False
        return True, "Success"

    def _load(self, obj) -> tuple[bool, str]:
        if not self.session_open:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        return super()._load(obj)

    def _flush_after_update(self, obj) -> tuple[bool, str]:
        if obj.flush_cache and self.rid_to_state:
            return False, (
                "Weights were updated, but the cache was not flushed because requests are still running "
                "or queued. Retract or finish them, then call /flush_cache."
            )
        return True, "Success"


def _prefill_result(rid: str, ids: list[int]) -> dict:
    """A prefill-only request's result (``max_new_tokens`` 0): no output tokens, finished by length."""
    return {
        "rid": rid,
        "output_ids": [],
        "output_logprobs": [],
        "finish_reason": {"type": "length", "length": 0},
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
    }
