"""The embedded engine with a deterministic long tail (tests/integration/test_partial_rollout_engine.py).

A call whose prompt is one of ``server_args["held_prompts"]`` (a fresh start of a "slow" row) generates
``server_args["held_tokens"]`` real tokens (EOS ignored, so exactly that many) and then holds, as a long
response still decoding would, until the trainer aborts it; it returns those tokens and log-probs with the
engine's abort finish reason. Every other call, continuations of held rows included, is the embedded
engine's own. So whether a group is still generating when the batch fills no longer depends on how fast
the machine is. It lives on the worker's PYTHONPATH only, like the fake sglang package.
"""

from __future__ import annotations

import asyncio
import dataclasses

from rlrun.engine.backends import BackendSpec
from rlrun.engine.backends.decode_run import ABORTED
from rlrun.engine.backends.embedded_backend import EmbeddedBackend
from rlrun.engine.sampling import SamplingParams, row_rids
from rlrun.engine.types import GenResult

HOLD_TIMEOUT_S = 120.0
POLL_S = 0.01


class HeldBackend(EmbeddedBackend):
    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec.model_path, seed=spec.seed, dtype=spec.dtype, device=spec.resolved_device())
        self.held = {tuple(ids) for ids in spec.server_args["held_prompts"]}
        self.held_tokens = int(spec.server_args["held_tokens"])

    async def generate(
        self, input_ids: list[list[int]], params: list[SamplingParams], return_logprob: bool, rids: list[str]
    ) -> list[GenResult]:
        held = [tuple(ids) in self.held for ids in input_ids]
        if not any(held):
            return await super().generate(input_ids, params, return_logprob, rids)
        assert all(held), "a held prompt must come alone in its call (one call per group when streaming)"
        # Registered first, so an abort that lands while the held tokens are generated is seen.
        with self.control.registered(row_rids(rids, params)) as request:
            short = [dataclasses.replace(p, max_new_tokens=self.held_tokens, ignore_eos=True) for p in params]
            # Called directly (not through the merged batch), so the abort cannot cut the held tokens short.
            results = await self._on_compute_thread(self.engine.generate, input_ids, short, return_logprob, rids)
            waited = 0.0
            while not all(request.aborted):
                if waited > HOLD_TIMEOUT_S:
                    raise RuntimeError(f"held call {rids} was never aborted in {HOLD_TIMEOUT_S} s")
                await asyncio.sleep(POLL_S)
                waited += POLL_S
        return [{**r, "finish_reason": dict(ABORTED)} for r in results]


def build(spec: BackendSpec) -> HeldBackend:
    return HeldBackend(spec)
