"""One generate call's decode loop with continuous batching (:mod:`.decode_slots`).

The call's rows (samples, prompt-major) wait in a queue. At each host look (every ``SYNC_EVERY`` forwards,
and as soon as every held row must have ended) the loop takes the results of the rows that ended, and loads
waiting rows into the freed slots: their distinct prompts are prefilled together (right-padded, so each
starts at cache column 0 as in the trainer) and their first token is sampled from that prefill. Between looks
the device runs captured decode steps that read only the filled cache columns. Without a cap on running rows
every row gets a slot at the first look, and the loop is the plain batched decode.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rlrun.engine.embedded.decode_batch import BatchShape, DecodeBatch, Finish, row_bucket
from rlrun.engine.embedded.decode_control import DecodeControl, EarlyDelivery, RequestHandle
from rlrun.engine.embedded.decode_graphs import read_len
from rlrun.engine.embedded.decode_slots import SlotTable, StopStringSlots
from rlrun.engine.embedded.routing_record import encode
from rlrun.engine.embedded.session_cache import KeptSession, SessionCache, reusable_columns
from rlrun.engine.embedded.static_cache import StaticKVCache
from rlrun.engine.kept_set import encode_kept_rows
from rlrun.engine.sampling import KEPT_SET_WIDTH, SamplingParams, SamplingTensors
from rlrun.engine.types import FinishReason, GenResult, RoutedExperts

if TYPE_CHECKING:
    from rlrun.engine.embedded.decode_graphs import WarmBatch
    from rlrun.engine.embedded.routing_record import RouterRecorder


class DecodeHost(Protocol):
    """What a decode run reads of its engine (``EmbeddedEngine``), so this module need not import it."""

    device: torch.device
    vocab_size: int
    tokenizer: Any
    weight_version: str
    router_recorder: RouterRecorder | None
    _prefill_experts: torch.Tensor | None
    sessions: SessionCache

    def synchronize(self) -> None: ...

    def _row_key(self, params: SamplingParams, prompt: list[int], sample_index: int) -> int: ...

    def _stop_id_matrix(self, row_params: Sequence[SamplingParams]) -> torch.Tensor: ...

    def _batch_for(self, shape: BatchShape) -> WarmBatch: ...

    def _prefill(
        self, prompts: list[list[int]], kept: Sequence[KeptSession | None] = ()
    ) -> tuple[torch.Tensor, StaticKVCache, torch.Tensor]: ...


SYNC_EVERY = 16
"""Decode steps between host looks at the batch (rows ended? stop strings? slots to refill?): more steps
waste up to that many finished steps; fewer stall the GPU on the host."""
LEN_ALIGN = 128
"""Cache lengths are rounded up to this, so calls with nearby lengths reuse one warm batch (a step reads only
the filled columns, ``decode_graphs.READ_ALIGN``, so the rounding costs memory, not time)."""
REFILL_FRACTION = 1 / 8
"""With rows waiting, the host looks as soon as this share of the slots (at least one) must have ended, so
ended rows are replaced in groups: each refill is one prefill forward (not a captured graph), and refilling
every slot the moment it ends made one prefill per step on long-tailed lengths."""
SHRINK_MIN_ROWS = 16
"""A batch's tail (no row waiting, few held) moves into a smaller batch, but never one under this many rows: a
step costs little less below it, and cuBLAS may pick other kernels (GEMV) at a handful of rows."""
SHRINK_MIN_FORWARDS = 4 * SYNC_EVERY
"""...and only when a held row may still run this many forwards: moving rows costs about a step, and capturing the
smaller batch's steps (where a release dropped them: every colocated rollout) a few eager steps per read length,
which the smaller steps must win back."""
ABORTED: FinishReason = {"type": "abort", "message": "Aborted"}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def num_slots(num_running: int, device: torch.device) -> int:
    """The decode batch's rows: a :func:`row_bucket` on CUDA (nearby sizes share captured steps); exactly the
    running rows on CPU, where nothing is captured and a padding row costs a row of compute."""
    return row_bucket(num_running) if device.type == "cuda" else num_running


_Prefill = tuple[list[int], torch.Tensor, StaticKVCache, torch.Tensor]


class DecodeRun:
    """The state of one call's decode: its rows, the batch, which slot holds which row, the results so far."""

    def __init__(
        self,
        engine: DecodeHost,
        prompts: list[list[int]],
        params: list[SamplingParams],
        request: RequestHandle,
        return_logprob: bool,
        max_running: int | None,
    ) -> None:
        self.engine, self.prompts, self.params, self.request = engine, prompts, params, request
        self.return_logprob = return_logprob
        self.rows = [(i, j) for i, p in enumerate(params) for j in range(p.n)]
        self.row_params = [params[i] for i, _ in self.rows]
        self.keys = [engine._row_key(params[i], prompts[i], j) for i, j in self.rows]
        self.stop_ids = engine._stop_id_matrix(self.row_params)
        sampling = SamplingTensors.of(self.row_params, self.keys, engine.vocab_size, engine.device)
        num_running = len(self.rows) if max_running is None else min(max_running, len(self.rows))
        self.shape = BatchShape(
            num_rows=num_slots(num_running, engine.device),
            max_len=_round_up(max(len(p) for p in prompts) + max(p.max_new_tokens for p in params), LEN_ALIGN),
            stop_width=_round_up(self.stop_ids.shape[1], 8),
            sample=sampling.sample,
            filter=sampling.filter,
            kept_width=min(KEPT_SET_WIDTH, engine.vocab_size) if sampling.sample and sampling.filter else 0,
            unfiltered=sampling.unfiltered,
        )
        self.num_running = num_running
        self.root = engine._batch_for(self.shape)
        """The call's warm batch; :attr:`warm` is it or, in a shrunk tail, one of its heads."""
        self.warm = self.root
        self.batch: DecodeBatch = self.warm.batch
        self.batch.deactivate(self.batch.all_rows)
        self.slots = SlotTable(self.shape.num_rows)
        self.queue = collections.deque(range(len(self.rows)))
        self.done: dict[int, GenResult] = {}
        self.stop_strings = StopStringSlots(engine.tokenizer)
        self.forwards = 0
        self._last_prefill: _Prefill | None = None
        """The last admission's prefill: (its prompts as indices into ``prompts``, their next-token logits, their
        K/V, their [P, W] mask); a group split between two refills takes its prompt's K/V from here."""
        self.cached: dict[int, int] = {}
        """Prompt index -> its leading tokens whose K/V came from its session's kept K/V (:mod:`.session_cache`)."""

    # ---- the loop ---------------------------------------------------------------------------------

    def run(self, control: DecodeControl, early: EarlyDelivery | None) -> list[GenResult]:
        """Decode every row to its end; results in row order."""
        aborted, look_at = [False] * len(self.rows), 0
        while True:
            if control.paused:  # queued steps finish before a load may touch the weights
                self.engine.synchronize()
            control.checkpoint(self.request)
            if self.request.aborted != aborted:
                aborted = list(self.request.aborted)
                held = [s for s in self.slots.occupied if aborted[self.slots.row[s]]]
                if held:
                    index = torch.tensor(held, device=self.engine.device)
                    self.batch.end_rows(index, Finish.ABORT)
                look_at = self.forwards
            if self.forwards >= look_at:
                self.look(aborted)
                if early is not None:
                    early.deliver_done(self.done)
                if not self.slots.occupied and not self.queue:
                    return [self.done[r] for r in range(len(self.rows))]
                self.shrink()
                look_at = self._next_look()
            self.forward()

    def forward(self) -> int:
        """One decode forward of every slot (a captured step's replay on CUDA); returns the cache columns it hands
        attention: the filled ones rounded up (one captured step per bucket), or, where attention reads each row's
        columns by count (``StaticKVCache.reads_by_count``), the whole cache (one captured step for the call)."""
        self.forwards += 1  # this forward attends, in each held row, up to its prompt + tokens so far
        whole = self.batch.cache.reads_by_count
        length = self.shape.max_len if whole else self.read_len_at(self.forwards)
        self.warm.run(length)
        return length

    def read_len_at(self, forward: int) -> int:
        """The cache columns the ``forward``-th forward reads, for the rows held now."""
        return read_len(self.slots.filled(forward), self.shape.max_len)

    def _next_look(self) -> int:
        """The forward after which to look next: every ``SYNC_EVERY``, and as soon as every held row must have
        ended; with rows waiting, also as soon as :data:`REFILL_FRACTION` of the slots (at least one) must have
        ended (by length: the host knows when without reading the device), so they are refilled together."""
        ends = sorted(self.slots.last_forward(s) for s in self.slots.occupied)
        due = [ends[-1]]
        if self.queue:
            due.append(ends[min(len(ends), max(1, int(self.num_running * REFILL_FRACTION))) - 1])
        return min(_round_up(self.forwards + 1, SYNC_EVERY), max(min(due), self.forwards + 1))

    def look(self, aborted: list[bool]) -> None:
        """Stop strings, then the results of the rows that ended, then waiting rows into the free slots."""
        self.stop_strings.scan(self.batch)
        held = self.slots.occupied
        active = self.batch.active.tolist()
        ended = [s for s in held if not active[s]]
        if ended:
            for row, result in zip((self.slots.row[s] for s in ended), self._results(ended), strict=True):
                self.done[row] = result
            for s in ended:
                self.slots.release(s)
        first = self.forwards == 0
        while self.queue and not first and aborted[self.queue[0]]:  # aborted while waiting: no prefill
            row = self.queue.popleft()
            self.done[row] = self._unstarted(row)
        free = self.slots.free[: min(self.num_running - len(self.slots.occupied), len(self.queue))]
        if free:
            self._admit(free, [self.queue.popleft() for _ in free], aborted)

    def shrink(self) -> None:
        """With no row waiting and at most half the slots held, move the held rows into the first slots and go on
        with a batch of that many rows (a row bucket; views of the same buffers, with steps captured apart):
        the last rows of a long tail then run a small batch's steps, not every slot's (SGLang's batch shrinks as
        its requests end). Halving at least bounds the smaller batches a call captures; a row's draws do not
        depend on its slot (per-row noise), and a row bucket is a batch size any call can have."""
        held = self.slots.occupied
        rows = max(SHRINK_MIN_ROWS, num_slots(len(held), self.engine.device))
        if self.queue or 2 * rows > self.batch.num_rows:
            return
        if max(self.slots.last_forward(s) for s in held) - self.forwards < SHRINK_MIN_FORWARDS:
            return
        moving = [s for s in held if s >= rows]
        free = [s for s in range(rows) if self.slots.row[s] < 0][: len(moving)]
        if moving:
            device = self.engine.device
            width = self.read_len_at(self.forwards + 1)  # every column a held row attends to before it writes
            self.batch.move_rows(torch.tensor(moving, device=device), torch.tensor(free, device=device), width)
            for src, dst in zip(moving, free, strict=True):
                self.slots.move(src, dst)
                self.stop_strings.move(src, dst)
        self.slots.shrink(rows)
        self.warm = self.root.head(rows)
        self.batch = self.warm.batch

    def _admit(self, slots: list[int], rows: list[int], aborted: list[bool]) -> None:
        """Load ``rows`` into ``slots``: the rows whose prompt the last admission prefilled reuse its K/V (a group
        split between two refills is prefilled once), the others share one prefill of their distinct prompts;
        then each row's first token (none for a row already aborted: it ends with no output, as SGLang's)."""
        last = self._last_prefill
        reused = [k for k, r in enumerate(rows) if last is not None and self.rows[r][0] in last[0]]
        fresh = [k for k in range(len(rows)) if k not in reused]
        if fresh:
            prompt_ids = sorted({self.rows[rows[k]][0] for k in fresh})
            kept = {i: self._kept_prefix(i) for i in prompt_ids}
            # Prompts that extend a kept session prefill apart from the others, which would forward every column.
            for part in ([i for i in prompt_ids if kept[i] is not None], [i for i in prompt_ids if kept[i] is None]):
                if not part:
                    continue
                prompts, part_kept = [self.prompts[i] for i in part], [kept[i] for i in part]
                start = reusable_columns(prompts, part_kept)
                self.cached.update((i, start) for i in part)
                extra = (part_kept,) if start else ()
                logits, prefill, prompt_mask = self.engine._prefill(prompts, *extra)
                self._last_prefill = (part, logits, prefill, prompt_mask)
                part_rows = [k for k in fresh if self.rows[rows[k]][0] in part]
                self._load([slots[k] for k in part_rows], [rows[k] for k in part_rows], self._last_prefill, aborted)
        if reused:
            assert last is not None  # rows are reused only from a previous prefill
            self._load([slots[k] for k in reused], [rows[k] for k in reused], last, aborted)

    def _session(self, prompt: int) -> str | None:
        """The prompt's session whose K/V are kept across calls; None when nothing is kept or for several samples
        (which one's would the next turn extend?)."""
        params = self.params[prompt]
        return params.session if params.n == 1 and self.engine.sessions.enabled else None

    def _kept_prefix(self, prompt: int) -> KeptSession | None:
        return self.engine.sessions.prefix(self._session(prompt), self.prompts[prompt])

    def _keep_sessions(self, slots: Sequence[int], lengths: list[int], finish: list[int]) -> None:
        """Keep the K/V of the ended rows that name a session (their prompt and every output token but the last,
        which was never forwarded); an aborted row's session is dropped."""
        for s, length, code in zip(slots, lengths, finish, strict=True):
            i = self.rows[self.slots.row[s]][0]
            session = self._session(i)
            if session is None:
                continue
            if code == Finish.ABORT or length < 1:
                self.engine.sessions.drop(session)
                continue
            width = len(self.prompts[i]) + length - 1
            output = self.batch.tokens[s, : length - 1].tolist()
            self.engine.sessions.keep(
                session,
                self.prompts[i] + output,
                [k[s, :, :width].clone() for k in self.batch.cache.keys],
                [v[s, :, :width].clone() for v in self.batch.cache.values],
            )

    def _load(self, slots: list[int], rows: list[int], prefilled: _Prefill, aborted: list[bool]) -> None:
        """Load ``rows`` into ``slots`` from ``prefilled`` (which holds their prompts) and sample their first token."""
        device = self.engine.device
        prompt_ids, logits, prefill, prompt_mask = prefilled
        local = {i: k for k, i in enumerate(prompt_ids)}
        index = torch.tensor(slots, device=device)
        prompt_of_row = torch.tensor([local[self.rows[r][0]] for r in rows], device=device)
        row_params = [self.row_params[r] for r in rows]
        sampling = SamplingTensors.of(row_params, [self.keys[r] for r in rows], self.engine.vocab_size, device)
        max_new = torch.tensor([p.max_new_tokens for p in row_params], device=device)
        stop_ids = self.stop_ids[torch.tensor(rows, device=device)]
        self.batch.load_rows(index, prefill, prompt_mask, prompt_of_row, max_new, stop_ids, sampling)
        ended = [s for s, r in zip(slots, rows, strict=True) if aborted[r]]
        if ended:
            self.batch.end_rows(torch.tensor(ended, device=device), Finish.ABORT)
        self.batch.record(logits[prompt_of_row], index)
        for s, r, p in zip(slots, rows, row_params, strict=True):
            self.slots.occupy(s, r, len(self.prompts[self.rows[r][0]]), self.forwards, p.max_new_tokens)
            self.stop_strings.start(s, p.stop)

    # ---- results ----------------------------------------------------------------------------------

    def _results(self, slots: Sequence[int]) -> list[GenResult]:
        """The results of the rows that ended in ``slots`` (one host read of those rows)."""
        index = torch.tensor(list(slots), device=self.engine.device, dtype=torch.long)
        lengths, finish = self.batch.lengths[index].tolist(), self.batch.finish[index].tolist()
        width = max(lengths)
        tokens = self.batch.tokens[index, :width].tolist()
        logprobs = self.batch.logprobs[index, :width].tolist()
        results: list[GenResult] = []
        for k, s in enumerate(slots):
            row = self.slots.row[s]
            output_ids = tokens[k][: lengths[k]]
            stop = self.stop_strings.matched.get(s)
            result = self._result(
                row,
                output_ids,
                logprobs[k][: lengths[k]],
                _finish_reason(finish[k], output_ids, self.row_params[row], stop),
            )
            results.append(result)
        if self.batch.kept_ids is not None:
            filtering = [k for k, f in enumerate(self.batch.sampling.filters[index].tolist()) if f]
            rows = index[torch.tensor(filtering, dtype=torch.long, device=index.device)]
            kept = encode_kept_rows(self.batch.kept_ids[rows], [lengths[k] for k in filtering])
            for k, wire in zip(filtering, kept, strict=True):
                results[k]["kept_ids"] = wire
        if self.engine.router_recorder is not None:
            for result, s, length in zip(results, slots, lengths, strict=True):
                result["routed_experts"] = self._routed_experts(s, length)
        self._keep_sessions(slots, lengths, finish)
        return results

    def _result(self, row: int, output_ids: list[int], logprobs: list[float], finish: FinishReason) -> GenResult:
        i = self.rows[row][0]
        result: GenResult = {
            "rid": self.request.row_rids[row],
            "output_ids": output_ids,
            "output_logprobs": logprobs if self.return_logprob else None,
            "finish_reason": finish,
            "prompt_tokens": len(self.prompts[i]),
            "completion_tokens": len(output_ids),
            "weight_version": self.engine.weight_version,
        }
        if self._session(i) is not None:
            result["cached_tokens"] = self.cached.get(i, 0)
        return result

    def _unstarted(self, row: int) -> GenResult:
        """A row aborted before it got a slot: no tokens (and an empty kept set where it filters)."""
        result = self._result(row, [], [], ABORTED)
        if self.batch.kept_ids is not None and self.row_params[row].needs_filter and not self.row_params[row].greedy:
            result["kept_ids"] = encode_kept_rows(torch.empty(1, 0, 1, dtype=torch.long), [0])[0]
        return result

    def _routed_experts(self, slot: int, length: int) -> RoutedExperts:
        """SGLang's ``routed_experts`` of the row in ``slot``: its prompt's tokens (from the prefill that loaded
        it, whose prompts start at the first column) then the output tokens that were forwarded (all but the
        last). A MoE call runs every row from one prefill (``max_running_requests`` is refused with MoE)."""
        experts, decoded = self.engine._prefill_experts, self.batch.routed_experts
        assert experts is not None and decoded is not None  # a MoE records them
        assert self._last_prefill is not None  # the prefill that loaded every row
        prompt_ids, _, loaded, _ = self._last_prefill
        width = loaded.max_len
        prefill = experts.reshape(len(prompt_ids), width, *experts.shape[1:])
        i = self.rows[self.slots.row[slot]][0]
        prompt = self.prompts[i]
        row = torch.cat([prefill[prompt_ids.index(i), : len(prompt)], decoded[slot, : max(length - 1, 0)]])
        return encode(row[: len(prompt) + length - 1])


def _finish_reason(code: int, output_ids: list[int], params: SamplingParams, stop: str | None) -> FinishReason:
    if code == Finish.STOP_TOKEN:
        return {"type": "stop", "matched": output_ids[-1]}
    if code == Finish.STOP_STRING:
        assert stop is not None  # the code of a stop string that matched
        return {"type": "stop", "matched": stop}
    if code == Finish.ABORT:
        return ABORTED
    assert code == Finish.LENGTH, f"a decoded row ended without a finish code ({code})"
    return {"type": "length", "length": params.max_new_tokens}
