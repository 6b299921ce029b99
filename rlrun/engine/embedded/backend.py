"""The embedded engine behind the worker's async backend interface.

Generation runs on one compute thread, so the worker's event loop stays free to answer abort,
pause and heartbeats mid-generate. Weight loads follow SGLang's locking: normally they queue on the
compute thread behind in-flight generations (SGLang's ``model_update_lock`` writer lock); while
generation is paused in place they run at once on another thread, after every running decode loop
has parked at a step boundary (SGLang skips the lock when paused).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlrun.engine.embedded.decode_control import DecodeControl, EarlyDelivery, RequestHandle
from rlrun.engine.embedded.engine import EmbeddedEngine
from rlrun.engine.payload import deserialize_flattened_bucket, tensor_checksum
from rlrun.engine.registry import BackendSpec
from rlrun.engine.sampling import SamplingParams, row_rids
from rlrun.engine.types import GenResult, OpResult

PARK_POLL_S = 0.005
MERGE_WAIT_S = 0.005
"""How long a generate call that finds the engine idle waits for others to join its batch (calls sent
together from several trainer threads arrive within a few milliseconds)."""


@dataclass
class _PendingCall:
    input_ids: list[list[int]]
    params: list[SamplingParams]
    return_logprob: bool
    rids: list[str]
    request: RequestHandle
    future: asyncio.Future


class _MergedRequest:
    """The requests of merged calls seen as one (their rows in order); abort flags stay each call's own,
    so aborting one call's rids (or a call queued behind the batch) works as before merging."""

    def __init__(self, requests: list[RequestHandle]) -> None:
        self.requests = requests
        self.row_rids = [rid for r in requests for rid in r.row_rids]

    @property
    def aborted(self) -> list[bool]:
        return [flag for r in self.requests for flag in r.aborted]


def _set_result(future: asyncio.Future, results: list[GenResult]) -> None:
    if not future.done():  # a part delivered early is not resolved again at the end
        future.set_result(results)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class EmbeddedBackend:
    """Adapts :class:`EmbeddedEngine` (synchronous) to the worker's backend interface."""

    tp_size = 1
    loop = None  # the worker creates its own event loop

    def __init__(
        self,
        model_path: str,
        *,
        seed: int,
        dtype: str,
        device: str,
        max_running_requests: int | None = None,
        chunked_prefill_size: int | None = None,
        attention_kernel: str = "efficient",
        session_cache_size: int = 0,
    ) -> None:
        self.engine = EmbeddedEngine(
            model_path,
            seed=seed,
            dtype=dtype,
            device=device,
            max_running_requests=max_running_requests,
            chunked_prefill_size=chunked_prefill_size,
            attention_kernel=attention_kernel,
            session_cache_size=session_cache_size,
        )
        self.control = DecodeControl()
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="embedded-decode")
        self._loading = asyncio.Lock()  # continue_generation waits for a load that runs while paused
        self._pending: list[_PendingCall] = []
        self._merger: asyncio.Future | None = None

    @classmethod
    def from_spec(cls, spec: BackendSpec) -> EmbeddedBackend:
        return cls(
            spec.model_path,
            seed=spec.seed,
            dtype=spec.dtype,
            device=spec.resolved_device(),
            max_running_requests=spec.server_args.get("max_running_requests"),
            chunked_prefill_size=spec.server_args.get("chunked_prefill_size"),
            attention_kernel=spec.attention_kernel,
            session_cache_size=spec.server_args.get("session_cache_size", 0),
        )

    @property
    def weight_version(self) -> str:
        return self.engine.weight_version

    async def _on_compute_thread(self, fn, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._compute, functools.partial(fn, *args, **kwargs))

    async def generate(
        self, input_ids: list[list[int]], params: list[SamplingParams], return_logprob: bool, rids: list[str]
    ) -> list[GenResult]:
        """Calls that arrive together (within ``MERGE_WAIT_S``, or while a batch decodes) decode as one
        batch, and each call returns as soon as its own rows are done: a trainer can send one call per
        group and see groups finish one by one (partial rollout) without losing the batched decode.
        Every row's noise depends only on its own seed, so merging does not change what is sampled."""
        self.engine.check_prompts(input_ids, params)  # a bad call fails alone, not the batch it would join
        with self.control.registered(row_rids(rids, params)) as request:
            future = asyncio.get_running_loop().create_future()
            call = _PendingCall(input_ids, params, return_logprob, rids, request, future)
            self._pending.append(call)
            if self._merger is None or self._merger.done():
                self._merger = asyncio.ensure_future(self._run_merged())
            return await call.future

    async def _run_merged(self) -> None:
        """Decode the pending calls in merged batches until none is left (one batch at a time)."""
        await asyncio.sleep(MERGE_WAIT_S)
        while self._pending:
            by_logprob: dict[bool, list[_PendingCall]] = {}
            for call in self._pending:
                by_logprob.setdefault(call.return_logprob, []).append(call)
            self._pending = []
            for calls in by_logprob.values():
                await self._decode_merged(calls)

    async def _decode_merged(self, calls: list[_PendingCall]) -> None:
        loop = asyncio.get_running_loop()
        parts, start = [], 0
        for call in calls:
            num_rows = len(call.request.row_rids)
            parts.append(range(start, start + num_rows))
            start += num_rows

        def resolve(k: int, results: list[GenResult]) -> None:
            loop.call_soon_threadsafe(_set_result, calls[k].future, results)

        merged = _MergedRequest([c.request for c in calls])
        try:
            results = await self._on_compute_thread(
                self.engine.generate,
                [ids for c in calls for ids in c.input_ids],
                [p for c in calls for p in c.params],
                calls[0].return_logprob,
                [rid for c in calls for rid in c.rids],
                request=merged,
                control=self.control,
                early=EarlyDelivery(parts, resolve),
            )
        except Exception as exc:  # noqa: BLE001 - every merged call fails with the batch's error
            for call in calls:
                _set_exception(call.future, exc)
            return
        for call, rows in zip(calls, parts, strict=True):
            _set_result(call.future, results[rows.start : rows.stop])

    async def abort(self, rid: str, abort_all: bool) -> None:
        self.control.abort(rid, abort_all)

    async def pause_generation(self, mode: str) -> None:
        if mode == "abort":
            self.control.abort(abort_all=True)
        else:  # in_place and retract both keep the requests and resume them on continue
            self.control.pause()

    async def continue_generation(self) -> None:
        async with self._loading:
            self.control.resume()

    async def flush_cache(self) -> OpResult:
        """Drop the sessions' kept K/V (``session_cache_size``); nothing else survives a generate call."""
        await self._on_compute_thread(self.engine.sessions.clear)
        return {"success": True, "message": "Cache flushed."}

    async def release_memory_occupation(self, tags: list[str]) -> None:
        """Weights go to host memory on GPU; the KV cache lives only inside a generate call, so releasing
        it returns the blocks the allocator still caches from the last one."""
        if "weights" in tags:
            await self._on_compute_thread(self.engine.offload_weights)
        if "kv_cache" in tags:
            await self._on_compute_thread(self.engine.free_cache)

    async def resume_memory_occupation(self, tags: list[str]) -> None:
        if "weights" in tags:
            await self._on_compute_thread(self.engine.onload_weights)

    async def begin_weight_update(self) -> OpResult:
        return {"success": True, "message": "Success"}

    async def end_weight_update(self) -> OpResult:
        """Replies once every bucket's copies have finished on the GPU (loads only queue them), so the
        end of the client's sync means the new weights are in place."""
        await asyncio.to_thread(self.engine.synchronize)
        return {"success": True, "message": "Success"}

    async def update_weights_from_tensor(
        self, payloads: list[bytes], load_format: str, weight_version: str | None
    ) -> OpResult:
        if load_format != "flattened_bucket":
            raise ValueError(
                f"load_format ({load_format!r}) must be 'flattened_bucket' because that is the only "
                "payload format the embedded engine reads; build payloads with serialize_flattened_bucket"
            )
        load = functools.partial(self._load_payload, payloads[0], weight_version)
        if not self.control.paused or not self.control.num_requests:
            await self._on_compute_thread(load)
        else:  # the compute thread is held by a parked generation
            async with self._loading:
                while not self.control.all_parked():
                    await asyncio.sleep(PARK_POLL_S)
                await asyncio.to_thread(load)
        return {"success": True, "message": "Success"}

    def _load_payload(self, payload: bytes, weight_version: str | None) -> None:
        self.engine.load_weights(deserialize_flattened_bucket(payload))
        if weight_version is not None:
            self.engine.weight_version = weight_version

    async def weight_checksums(self) -> dict[str, str]:
        params = self.engine.named_parameters()
        return await self._on_compute_thread(lambda: {name: tensor_checksum(t) for name, t in params.items()})

    async def score_tokens(
        self, input_ids: list[list[int]], starts: list[int], temperature: float
    ) -> list[list[float]]:
        return await self._on_compute_thread(self.engine.score_tokens, input_ids, starts, temperature)

    def shutdown(self) -> None:
        self.control.abort(abort_all=True)
        self._compute.shutdown(wait=False, cancel_futures=True)
