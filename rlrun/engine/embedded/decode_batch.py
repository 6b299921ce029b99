"""The device-resident state of one batched decode: static buffers that one step reads and updates.

Every tensor here keeps its storage for the life of the batch (updates are in place), so a decode
step over them can be captured once as a CUDA graph (:mod:`rlrun.engine.embedded.cuda_graph`) and
reused by later generate calls of the same shape after :meth:`DecodeBatch.load`. Nothing in a
step reads a value back to the host: end conditions (stop tokens, length) are applied on the device
and recorded as a finish code per row; the host reads the state every few steps.

Rows are samples. The layout is right-padded: every prompt starts at column 0 of the cache, and row b's
decode step t writes column ``len_b + t - 1`` (its own column, ``cache.columns[b]``), over the prompt
padding first. So each row's keys are columns ``0 .. len_b + t - 1`` with no gap, as the trainer sees
them (rlrun.kernels.attention: that is what makes the two bitwise equal).
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from rlrun.engine.embedded.static_cache import StaticKVCache
from rlrun.engine.sampling import SamplingTensors, sample_tokens, uniform_noise
from rlrun.kernels.triton_support import triton_available


class Finish(enum.IntEnum):
    """Why a row stopped (``finish`` codes); ``RUNNING`` while it is active."""

    RUNNING = 0
    STOP_TOKEN = 1
    LENGTH = 2
    ABORT = 3
    STOP_STRING = 4


ROW_ALIGN = 16
"""Decode batches above this many rows have a multiple of it (smaller ones a power of two), so calls of
nearby sizes share one warm batch and its captured steps; the padding rows are inactive."""


def row_bucket(num_rows: int) -> int:
    """The rows of the decode batch that holds ``num_rows`` samples."""
    if num_rows <= ROW_ALIGN:
        return 1 << (num_rows - 1).bit_length()
    return -(-num_rows // ROW_ALIGN) * ROW_ALIGN


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """What a captured step depends on: rows (a :func:`row_bucket`), cache length, stop-id width, and the
    sampling mode."""

    num_rows: int
    max_len: int
    stop_width: int
    sample: bool
    filter: bool
    kept_width: int = 0
    """Width of the kept-set buffer (top-p mask replay; ``sampling.KEPT_SET_WIDTH`` or the vocabulary if
    smaller) when some row filters, else 0."""
    unfiltered: bool = True
    """Some drawing row draws over the whole vocabulary (``SamplingTensors.unfiltered``)."""


@dataclasses.dataclass
class DecodeBatch:
    """Static buffers of B rows over a cache of ``max_len`` columns (see the module docstring)."""

    cache: StaticKVCache
    input_ids: torch.Tensor
    """[B, 1] the token each row feeds to the next forward (the last one sampled)."""
    positions: torch.Tensor
    """[B, 1] its position id (each row's own prompt length plus tokens so far)."""
    mask: torch.Tensor
    """[B, 1, 1, max_len] which cache columns each row attends to."""
    step: torch.Tensor
    """[B] index of each row's next token to sample (0 = the first one, from the prefill logits)."""
    tokens: torch.Tensor
    """[B, max_len] sampled tokens, valid up to ``lengths``."""
    logprobs: torch.Tensor
    lengths: torch.Tensor
    active: torch.Tensor
    finish: torch.Tensor
    """[B] :class:`Finish` codes."""
    max_new: torch.Tensor
    stop_ids: torch.Tensor
    """[B, stop_width] token ids that end each row, padded with -1."""
    sampling: SamplingTensors
    kept_ids: torch.Tensor | None = None
    """[B, max_len, kept_width] int64: step s's kept set of each row (``sample_tokens``' ``kept_out``), when
    some row filters; None otherwise."""
    routed_experts: torch.Tensor | None = None
    """[B, max_len, layers, topk] (uint8 or int32, ``RouterRecorder.dtype``): the experts of the token each
    decode step forwarded (column ``step - 1`` of each row), written by the engine's router hooks (MoE models
    only; ``routing_record``)."""
    noise: torch.Tensor | None = None
    """[B, max_len] float32: ``uniform_noise(key, s)`` of each row for every step s, tabulated when the row is
    loaded (the hash is ~60 small kernels a step otherwise); sampling batches only."""

    def __post_init__(self) -> None:
        self.all_rows = torch.arange(self.num_rows, device=self.input_ids.device)
        """[B] every row's index (a decode step's ``record`` over all rows)."""

    @classmethod
    def allocate(cls, shape: BatchShape, device: torch.device) -> DecodeBatch:
        rows = shape.num_rows

        def zeros(*size: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(*size, dtype=dtype, device=device)

        return cls(
            cache=StaticKVCache(rows, shape.max_len, device, per_row=True),
            input_ids=zeros(rows, 1),
            positions=zeros(rows, 1),
            mask=torch.ones(rows, 1, 1, shape.max_len, dtype=torch.bool, device=device),
            step=zeros(rows),
            tokens=zeros(rows, shape.max_len),
            logprobs=zeros(rows, shape.max_len, dtype=torch.float32),
            lengths=zeros(rows),
            active=torch.ones(rows, dtype=torch.bool, device=device),
            finish=zeros(rows),
            max_new=zeros(rows),
            stop_ids=zeros(rows, shape.stop_width) - 1,
            sampling=SamplingTensors.empty(rows, shape.sample, shape.filter, device, shape.unfiltered),
            kept_ids=zeros(rows, shape.max_len, shape.kept_width) - 1 if shape.kept_width else None,
            noise=zeros(rows, shape.max_len, dtype=torch.float32) if shape.sample else None,
        )

    def load_rows(
        self,
        slots: torch.Tensor,
        prefill: StaticKVCache,
        prompt_mask: torch.Tensor,
        prompt_of_row: torch.Tensor,
        max_new: torch.Tensor,
        stop_ids: torch.Tensor,
        sampling: SamplingTensors,
    ) -> None:
        """Put new rows into ``slots`` (the others untouched): each slot takes prefill row ``prompt_of_row[k]``'s
        K/V and mask, its counters restart at 0. A slot's old K/V past the new prompt stays, masked, and is
        overwritten column by column before the new row attends to it."""
        width = prefill.max_len
        self.cache.load_prefix(prefill, prompt_of_row, slots)
        row_mask = prompt_mask.bool()[prompt_of_row]
        lengths = row_mask.sum(-1)
        self.positions[slots] = lengths[:, None]
        self.cache.columns[slots] = lengths  # the first decode forward writes each prompt's next column
        mask = torch.zeros(len(slots), self.mask.shape[-1], dtype=torch.bool, device=self.mask.device)
        mask[:, :width] = row_mask
        mask.scatter_(1, lengths[:, None], True)
        self.mask[slots, 0, 0] = mask
        for name in ("step", "lengths"):
            getattr(self, name)[slots] = 0
        self.active[slots] = True
        self.finish[slots] = Finish.RUNNING
        self.max_new[slots] = max_new
        self.stop_ids[slots] = torch.nn.functional.pad(
            stop_ids, (0, self.stop_ids.shape[1] - stop_ids.shape[1]), value=-1
        )
        self.sampling.put(slots, sampling)
        if self.noise is not None:
            steps = torch.arange(self.noise.shape[1], device=self.noise.device)
            self.noise[slots] = uniform_noise(sampling.keys[:, None], steps[None])

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def _row_tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer with a row per slot along its first dimension, by field name (cache and sampling aside)."""
        return {f.name: t for f in dataclasses.fields(self) if isinstance(t := getattr(self, f.name), torch.Tensor)}

    def head(self, rows: int) -> DecodeBatch:
        """The first ``rows`` rows as a batch of their own: views of these buffers, so a step over it (captured
        apart) reads and writes those rows here, and costs ``rows`` rows, not all of them."""
        views = {name: t[:rows] for name, t in self._row_tensors().items()}
        return dataclasses.replace(self, cache=self.cache.head(rows), sampling=self.sampling.head(rows), **views)

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, width: int) -> None:
        """The rows ``src`` into the slots ``dst`` (disjoint), all their state; of the KV cache only the first
        ``width`` columns (the ones attended to before a row writes again)."""
        for t in self._row_tensors().values():
            t[dst] = t[src]
        self.cache.move_rows(src, dst, width)
        self.sampling.put(dst, self.sampling.take(src))

    def deactivate(self, slots: torch.Tensor) -> None:
        """Make ``slots`` inactive without a finish code (a row bucket's padding, a slot left empty)."""
        self.active[slots] = False

    def record(self, logits: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        """Sample each row's next token (its ``step``-th) from ``logits`` ([B, V], or [len(slots), V] for just
        ``slots``: the first token of rows just loaded) and apply the device-side end conditions. A row's step
        advances only while it is active, so its k-th token always draws the noise of step k."""
        whole = slots is None
        rows = self.all_rows if slots is None else slots

        def take(buffer: torch.Tensor) -> torch.Tensor:
            """The rows' values: the buffer itself for the whole batch (a decode step: no gather kernel)."""
            return buffer if whole else buffer[rows]

        step, active = take(self.step), take(self.active)
        sampling = self.sampling if slots is None else self.sampling.take(slots)
        kept = None if self.kept_ids is None else self.kept_ids.new_empty(len(rows), self.kept_ids.shape[-1])
        noise = None if self.noise is None else self.noise[rows, step]
        token, logprob = _sample(logits, sampling, step, kept, noise)
        if kept is not None and self.kept_ids is not None:  # both or neither
            self.kept_ids[rows, step] = kept
        self.tokens[rows, step] = token
        self.logprobs[rows, step] = logprob
        lengths = take(self.lengths) + active
        stopped = (token[:, None] == take(self.stop_ids)).any(-1) & active
        too_long = (lengths >= take(self.max_new)) & active & ~stopped
        finish = take(self.finish).masked_fill(stopped, Finish.STOP_TOKEN).masked_fill(too_long, Finish.LENGTH)
        # Every new value is computed before any is written: ``step`` and ``active`` may be the buffers themselves.
        updates = {
            "lengths": lengths,
            "finish": finish,
            "active": active & ~(stopped | too_long),
            "input_ids": token[:, None],
            "step": step + active,
        }
        for name, value in updates.items():
            if whole:
                getattr(self, name).copy_(value)
            else:
                getattr(self, name)[rows] = value

    def advance(self) -> None:
        """After a decode forward: an active row's next one writes (and attends to) its next column; an
        inactive row stays on its column (it never passes its prompt + max_new_tokens)."""
        self.positions += self.active[:, None]
        self.cache.columns += self.active
        self.mask.scatter_(3, self.cache.columns.view(-1, 1, 1, 1), True)

    def end_rows(self, slots: torch.Tensor, code: Finish) -> None:
        """Finish the still-active rows among the indices ``slots`` with ``code`` (abort)."""
        rows = torch.zeros_like(self.active).index_fill_(0, slots, True) & self.active
        self.finish.masked_fill_(rows, code)
        self.active &= ~rows

    _STEP_STATE = ("input_ids", "positions", "mask", "step", "lengths", "active", "finish")

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of the small buffers a step updates (a capture's warm-up runs the step). The per-token buffers
        (tokens, log-probs, kept sets, routed experts) are left out: a step writes them at each row's ``step``,
        past the row's valid tokens, and the real steps write those places again."""
        return [getattr(self, name).clone() for name in self._STEP_STATE] + [self.cache.columns.clone()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        tensors = [getattr(self, name) for name in self._STEP_STATE] + [self.cache.columns]
        for tensor, copy in zip(tensors, saved, strict=True):
            tensor.copy_(copy)

    def nbytes(self) -> int:
        """Device bytes of the buffers (the KV cache once loaded, the token and log-prob buffers)."""
        tensors = [*self.cache.keys, *self.cache.values, self.tokens, self.logprobs, self.mask]
        tensors += [t for t in (self.kept_ids, self.routed_experts, self.noise) if t is not None]
        return sum(t.nbytes for t in tensors)

    def cut(self, row: int, length: int) -> None:
        """End ``row`` at ``length`` tokens with a stop string (found on the host, possibly late)."""
        self.lengths[row] = length
        self.finish[row] = Finish.STOP_STRING
        self.active[row] = False


def _sample(
    logits: torch.Tensor,
    sampling: SamplingTensors,
    step: torch.Tensor,
    kept: torch.Tensor | None,
    noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_tokens``, or with every row greedy on CUDA (and Triton) one kernel that picks the tokens and their
    log-probs (``triton_kernels.greedy_tokens``: the trainer's formula, within fp32 rounding of the eager path's)."""
    if not sampling.sample and logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1 and triton_available():
        from rlrun.engine.embedded.triton_kernels import greedy_tokens

        if kept is not None:
            kept.fill_(-1)
        return greedy_tokens(logits, sampling.temperature)
    return sample_tokens(logits, sampling, step, kept, noise)
