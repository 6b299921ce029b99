"""The embedded engine with a deterministic long tail (tests/integration/test_partial_rollout_engine.py).

A call whose prompt is one of ``server_args["held_prompts"]`` (a fresh start of a "slow" row) generates
``server_args["held_tokens"]`` real tokens (EOS ignored, so exactly that many) and then holds, as a long
response still decoding would, until the trainer aborts it; it returns those tokens and log-probs with the
engine's abort finish reason. So whether a group is still generating when the batch fills no longer depends
on how fast the machine is.

The continuation of an aborted held row (its prompt plus carried tokens) is the embedded engine's own call,
and it comes back first: the abort leaves a marker in ``server_args["gate_dir"]`` (a folder every rank's
worker shares), and every other call, on any rank, waits while a marker is there; the continuation removes it
when it returns finished. Nothing else can then fill the batch first, so an aborted held group trains in the
next step that starts a round, however loaded the machine is. A call aborted while it waits returns no tokens,
as a request aborted before its prefill does. It lives on the worker's PYTHONPATH only, like the fake sglang
package.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from pathlib import Path

from rlrun.engine.embedded.backend import EmbeddedBackend
from rlrun.engine.embedded.decode_run import ABORTED
from rlrun.engine.registry import BackendSpec
from rlrun.engine.sampling import SamplingParams, row_rids
from rlrun.engine.types import GenResult

HOLD_TIMEOUT_S = 120.0
POLL_S = 0.01


class HeldBackend(EmbeddedBackend):
    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec.model_path, seed=spec.seed, dtype=spec.dtype, device=spec.resolved_device())
        self.held = [list(ids) for ids in spec.server_args["held_prompts"]]
        self.held_tokens = int(spec.server_args["held_tokens"])
        self.gate = Path(spec.server_args["gate_dir"])
        self.gate.mkdir(parents=True, exist_ok=True)

    def _marker(self, prompt: list[int]) -> Path:
        return self.gate / hashlib.sha1(repr(prompt).encode()).hexdigest()

    def _held_prefix(self, ids: list[int]) -> list[int] | None:
        return next((p for p in self.held if ids[: len(p)] == p), None)

    async def generate(
        self, input_ids: list[list[int]], params: list[SamplingParams], return_logprob: bool, rids: list[str]
    ) -> list[GenResult]:
        prefixes = [self._held_prefix(ids) for ids in input_ids]
        if all(p is not None and len(ids) > len(p) for p, ids in zip(prefixes, input_ids, strict=True)):
            return await self._continue(input_ids, params, return_logprob, rids, prefixes)
        held = [p == ids for p, ids in zip(prefixes, input_ids, strict=True)]
        # Registered while it waits, so an abort that lands before the gate opens is seen.
        with self.control.registered(row_rids(rids, params)) as request:
            if not await _wait(lambda: not any(self.gate.iterdir()) or all(request.aborted)):
                raise RuntimeError(f"call {rids} waited {HOLD_TIMEOUT_S} s for a held continuation that never came")
            if all(request.aborted):
                return self._unstarted(input_ids, params, return_logprob, request.row_rids)
            if not any(held):
                return await super().generate(input_ids, params, return_logprob, rids)
            assert all(held), "a held prompt must come alone in its call (one call per group when streaming)"
            short = [dataclasses.replace(p, max_new_tokens=self.held_tokens, ignore_eos=True) for p in params]
            # Called directly (not through the merged batch), so the abort cannot cut the held tokens short.
            results = await self._on_compute_thread(self.engine.generate, input_ids, short, return_logprob, rids)
            if not await _wait(lambda: all(request.aborted)):
                raise RuntimeError(f"held call {rids} was never aborted in {HOLD_TIMEOUT_S} s")
        self._marker(input_ids[0]).touch()  # before returning: the trainer's next call sees it
        return [{**r, "finish_reason": dict(ABORTED)} for r in results]

    async def _continue(self, input_ids, params, return_logprob, rids, prefixes) -> list[GenResult]:
        """A held row's continuation: the engine's own call, ungated; a finished one opens the gate."""
        results = await super().generate(input_ids, params, return_logprob, rids)
        if all(r["finish_reason"]["type"] != "abort" for r in results):
            for prompt in prefixes:
                self._marker(prompt).unlink(missing_ok=True)
        return results

    def _unstarted(self, input_ids, params, return_logprob: bool, rids: list[str]) -> list[GenResult]:
        """Every row of a call aborted before it started: no tokens (the embedded engine's unstarted row)."""
        prompt_tokens = [len(ids) for ids, p in zip(input_ids, params, strict=True) for _ in range(p.n)]
        return [
            {
                "rid": rid,
                "output_ids": [],
                "output_logprobs": [] if return_logprob else None,
                "finish_reason": dict(ABORTED),
                "prompt_tokens": n,
                "completion_tokens": 0,
                "weight_version": self.engine.weight_version,
            }
            for rid, n in zip(rids, prompt_tokens, strict=True)
        ]


async def _wait(done) -> bool:
    """Poll ``done`` every ``POLL_S``; False after ``HOLD_TIMEOUT_S``."""
    waited = 0.0
    while not done():
        if waited > HOLD_TIMEOUT_S:
            return False
        await asyncio.sleep(POLL_S)
        waited += POLL_S
    return True


def build(spec: BackendSpec) -> HeldBackend:
    return HeldBackend(spec)
