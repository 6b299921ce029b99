"""``embedded``: a real, pure PyTorch/transformers rollout engine (CPU or one GPU; the default for CI).

It serves the same contract as the SGLang backend with a batched decode loop over static buffers:

1. prefill each *distinct prompt* once (right-padded, so every prompt starts at cache column 0 as each
   sample starts at key 0 in the trainer; only each prompt's last position's logits) into a
   :class:`StaticKVCache`, then copy its KV to the ``n`` samples of its group in a
   preallocated decode cache (:mod:`rlrun.engine.backends.decode_batch`);
2. decode all samples together, one token per step; a step (forward, sampling with per-row
   counter-based noise, end conditions) touches only device buffers and reads only the filled cache
   columns (rounded up to a bucket), so on GPU it is captured once per bucket as a CUDA graph and
   replayed; recent batch shapes keep their buffers and graphs warm (:mod:`.decode_graphs`); the host
   looks at the state only every ``SYNC_EVERY`` steps;
3. a sample ends on EOS / a stop token (kept in ``output_ids``, as SGLang does), on the token that
   completes a stop string (matched on the host at those looks, a few steps behind the device; the
   extra tokens are cut), at max_new_tokens, or when it is aborted (partial output, as SGLang).

Finished samples keep riding along in the batch (their extra tokens are discarded), which keeps
the loop simple; fine for short RL responses, wasteful for long tails of very different lengths.
This module is synchronous; :mod:`rlrun.engine.backends.embedded_backend` runs it on a thread
behind the worker's event loop and owns abort/pause through a :class:`DecodeControl`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlrun.engine.backends.decode_batch import BatchShape, DecodeBatch, Finish, row_bucket
from rlrun.engine.backends.decode_control import DecodeControl, RequestHandle
from rlrun.engine.backends.decode_graphs import WarmBatch, WarmBatches, read_len
from rlrun.engine.backends.fused_experts import expert_slice
from rlrun.engine.backends.fused_norm import fuse_rms_norms
from rlrun.engine.backends.routing_record import RouterRecorder, encode
from rlrun.engine.backends.static_cache import ATTENTION, StaticKVCache, prefill_mask
from rlrun.engine.kept_set import encode_kept_ids
from rlrun.engine.sampling import (
    KEPT_SET_WIDTH,
    SamplingParams,
    SamplingTensors,
    per_prompt_params,
    row_key,
    row_rids,
)
from rlrun.engine.types import DEFAULT_WEIGHT_VERSION, FinishReason, GenResult, RoutedExperts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ABORTED: FinishReason = {"type": "abort", "message": "Aborted"}


SYNC_EVERY = 16
"""Decode steps between host looks at the batch (all rows done? stop strings?): more steps waste
up to that many finished steps; fewer stall the GPU on the host."""
LEN_ALIGN = 128
"""Cache lengths are rounded up to this, so calls with nearby lengths reuse one warm batch (a step reads only
the filled columns, ``decode_graphs.READ_ALIGN``, so the rounding costs memory, not time)."""
CAPTURABLE_DECODE_EXPERTS = "batched_mm"
"""transformers' experts kernel for the decode step of a fused-experts MoE on CUDA outside bfloat16. The
default ``grouped_mm`` copies a host tensor there (torch's grouped_mm outside bf16), and ``eager`` loops over
the experts the batch hit, so neither can be captured as a CUDA graph; ``batched_mm`` (one bmm over every
(token, expert) pair, no data-dependent shape) can, at little cost for decode's few tokens. Probed on the
H200 (torch 2.11, transformers 5.17): float32 grouped_mm and eager fail capture, batched_mm captures;
bfloat16 grouped_mm captures, so bf16 keeps it (it does not gather one weight copy per pair)."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _StopStrings:
    """SGLang's stop-string check: after each token, decode the last (longest stop in tokens + 1)
    tokens and look for every stop string in that text (``schedule_batch.py``, ``tail_str``)."""

    def __init__(self, tokenizer, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.window = 1 + max(len(tokenizer.encode(s, add_special_tokens=False)) for s in stops)

    def match(self, output_ids: list[int]) -> str | None:
        tail = self.tokenizer.decode(output_ids[-self.window :])
        return next((s for s in self.stops if s in tail), None)


class EarlyDelivery:
    """Parts of one decode batch (the rows of each merged generate call) and where their results go."""

    def __init__(self, parts: Sequence[Sequence[int]], callback: Callable[[int, list[GenResult]], None]) -> None:
        self.parts = [list(p) for p in parts]
        self.callback = callback
        """``callback(part, results)``, called on the decode thread once per part delivered early."""
        self.delivered = [False] * len(self.parts)

    def deliver_done(self, active: list[bool], results_of: Callable[[list[int]], list[GenResult]]) -> None:
        for k, rows in enumerate(self.parts):
            if not self.delivered[k] and not any(active[b] for b in rows):
                self.delivered[k] = True
                self.callback(k, results_of(rows))


class _StopStringRows:
    """Stop-string matching of the rows that have stop strings, on the host, a few steps behind the
    device: :meth:`scan` feeds each row's new tokens to its matcher one at a time (so the match is
    found on the exact token that completes it, as SGLang's per-step check does) and cuts the row
    there. A stop token on that same token wins, as it is checked first in SGLang too."""

    def __init__(self, tokenizer, row_params: Sequence[SamplingParams]) -> None:
        self.matchers = {b: _StopStrings(tokenizer, p.stop) for b, p in enumerate(row_params) if p.stop}
        self.outputs: dict[int, list[int]] = {b: [] for b in self.matchers}
        self.open = set(self.matchers)
        self.matched: dict[int, str] = {}

    def scan(self, batch: DecodeBatch, steps: int) -> None:
        """Match the tokens of the first ``steps`` steps not scanned yet (one host read of the rows)."""
        if not self.open:
            return
        rows = sorted(self.open)
        index = torch.tensor(rows, device=batch.tokens.device)
        tokens = batch.tokens[index, :steps].tolist()
        lengths, finish = batch.lengths[index].tolist(), batch.finish[index].tolist()
        for b, row_tokens, length, code in zip(rows, tokens, lengths, finish, strict=False):
            output = self.outputs[b]
            for s in range(len(output), length):
                output.append(row_tokens[s])
                matched = self.matchers[b].match(output)
                if matched is not None:
                    if s < length - 1 or code != Finish.STOP_TOKEN:
                        batch.cut(b, s + 1)
                        self.matched[b] = matched
                    code = Finish.STOP_STRING
                    break
            if code != Finish.RUNNING:
                self.open.discard(b)


def _decode_experts_implementation(model, device: torch.device) -> str | None:
    """:data:`CAPTURABLE_DECODE_EXPERTS` where the decode step of an MoE would not capture with the model's own
    experts kernel (CUDA outside bfloat16), else None (also for transformers without selectable kernels)."""
    kernel = getattr(model.config, "_experts_implementation", None)
    if device.type != "cuda" or model.dtype == torch.bfloat16 or not hasattr(model, "set_experts_implementation"):
        return None
    return CAPTURABLE_DECODE_EXPERTS if kernel != CAPTURABLE_DECODE_EXPERTS else None


def _eos_token_ids(model, tokenizer) -> set[int]:
    """EOS ids as SGLang collects them: the generation config's (which falls back to config.json's)
    plus the tokenizer's ``eos_token_id`` when the directory has a tokenizer."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class EmbeddedEngine:
    """A transformers causal LM in eval mode behind the engine contract's generate and weight loading."""

    def __init__(
        self, model_path: str | Path, *, seed: int = 0, dtype: str = "float32", device: str | torch.device = "cpu"
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(
                f"dtype ({dtype!r}) must be one of {sorted(DTYPES)} because the embedded engine "
                "computes in one of those; set model.dtype accordingly"
            )
        model_path = Path(model_path)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if self.device.index is None:  # "cuda": the current device, named, so set_device can take it
                self.device = torch.device("cuda", torch.cuda.current_device())
            # What names no device acts on the current one: CUDA graph capture's side stream, empty_cache,
            # cuBLAS workspaces. Without this, rank 1's engine on cuda:1 made its capture stream on cuda:0,
            # and the 2-GPU rollout took 2.8x one GPU's (benchmarks/results/weak_scaling_h200x2.json).
            torch.cuda.set_device(self.device)
        # SDPA-based attention that takes the static cache's ready boolean masks (see static_cache.py).
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype], attn_implementation=ATTENTION)
            .to(self.device)  # type: ignore[arg-type]  # transformers' wrapped .to hides the device overload
            .eval()
            .requires_grad_(False)
        )
        fuse_rms_norms(self.model)
        self.tokenizer = (
            AutoTokenizer.from_pretrained(model_path) if (model_path / "tokenizer_config.json").exists() else None
        )
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self.vocab_size: int = self.model.get_output_embeddings().weight.shape[0]
        self.max_positions: int | None = getattr(self.model.config, "max_position_embeddings", None)
        self._params = dict(self.model.named_parameters())
        # Persistent buffers are checkpoint tensors the trainer sends as well (GLM-4.5's routing correction bias).
        saved = self.model.state_dict()
        self._saved_buffers = {name: b for name, b in self.model.named_buffers() if name in saved}
        # Names that alias a parameter listed under another name (tied lm_head -> embed_tokens).
        param_at = {t.data_ptr(): name for name, t in self._params.items()}
        self._aliases = {
            name: param_at[t.data_ptr()]
            for name, t in self.model.state_dict().items()
            if name not in self._params and t.data_ptr() in param_at
        }
        # transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns until 5.40).
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        decoder_params = inspect.signature(self.model.get_decoder().forward).parameters
        self._decoder_cache_kwarg = "cache" if "cache" in decoder_params else "past_key_values"
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self._rng = torch.Generator().manual_seed(seed)
        self._warm = WarmBatches(self.device)
        """Recent calls' decode buffers and captured steps by shape, reused by calls of the same shape."""
        self.router_recorder = RouterRecorder.attach(self.model)
        """Records every forwarded token's experts (MoE models; None for dense ones), see routing_record."""
        self._decode_experts = (
            None if self.router_recorder is None else _decode_experts_implementation(self.model, self.device)
        )
        """The experts kernel the decode step switches to (None: the load-time one, also for prefill)."""
        self._prefill_experts: torch.Tensor | None = None
        self._host_weights: list[torch.Tensor] | None = None
        """Pinned host copies of the weights while offloaded (allocated at the first offload, then reused)."""

    # ---- generation -------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: Mapping[str, Any] | Sequence[Any],
        return_logprob: bool = True,
        rids: list[str] | None = None,
        *,
        request: RequestHandle | None = None,
        control: DecodeControl | None = None,
        early: EarlyDelivery | None = None,
    ) -> list[GenResult]:
        """Sample ``n`` responses per prompt; results are prompt-major (all samples of prompt 0 first).

        ``request`` (its rows' rids and abort flags) and ``control`` (the pause gate) come from the
        async backend; called directly, the request cannot be aborted or paused. ``early`` (the async
        backend's merged calls) hands each part of the batch its results as soon as all its rows are
        done, at the host looks, while the rest decodes on; the return value still holds every row.
        """
        params = per_prompt_params(len(input_ids), sampling_params)
        self.check_prompts(input_ids, params)
        rids = rids if rids is not None else [uuid.uuid4().hex for _ in input_ids]
        if len(rids) != len(input_ids):
            raise ValueError(f"rids ({len(rids)} ids) must have one id per prompt ({len(input_ids)}); pass None or fix")
        request = request if request is not None else RequestHandle(row_rids(rids, params))
        control = control if control is not None else DecodeControl()
        rows = [(i, j) for i, p in enumerate(params) for j in range(p.n)]

        def results_of(batch: DecodeBatch, steps: int, stop_strings: dict[int, str], subset: Sequence[int]):
            return self._results(batch, steps, stop_strings, subset, input_ids, params, rows, request, return_logprob)

        with control.running():
            batch, steps, stop_strings = self._decode(input_ids, params, rows, request, control, early, results_of)
        return results_of(batch, steps, stop_strings, range(len(rows)))

    def _results(
        self,
        batch: DecodeBatch,
        steps: int,
        stop_strings: dict[int, str],
        subset: Sequence[int],
        input_ids: list[list[int]],
        params: list[SamplingParams],
        rows: Sequence[tuple[int, int]],
        request: RequestHandle,
        return_logprob: bool,
    ) -> list[GenResult]:
        """The results of the finished rows ``subset`` (one host read of their buffers)."""
        index = torch.tensor(list(subset), device=self.device, dtype=torch.long)
        tokens, logprobs = batch.tokens[index, :steps].tolist(), batch.logprobs[index, :steps].tolist()
        lengths, finish = batch.lengths[index].tolist(), batch.finish[index].tolist()
        results: list[GenResult] = []
        for k, b in enumerate(subset):
            i = rows[b][0]
            output_ids = tokens[k][: lengths[k]]
            results.append(
                {
                    "rid": request.row_rids[b],
                    "output_ids": output_ids,
                    "output_logprobs": logprobs[k][: lengths[k]] if return_logprob else None,
                    "finish_reason": self._finish_reason(finish[k], output_ids, params[i], stop_strings.get(b)),
                    "prompt_tokens": len(input_ids[i]),
                    "completion_tokens": lengths[k],
                    "weight_version": self.weight_version,
                }
            )
        if self.router_recorder:
            experts = self._routed_experts(batch, input_ids, [rows[b] for b in subset], lengths, list(subset))
            for result, row_experts in zip(results, experts, strict=True):
                result["routed_experts"] = row_experts
        if batch.kept_ids is not None:
            for k, b in enumerate(subset):
                if bool(batch.sampling.filters[b]):
                    results[k]["kept_ids"] = encode_kept_ids(batch.kept_ids[b, : lengths[k]])
        return results

    def _routed_experts(
        self,
        batch: DecodeBatch,
        prompts: list[list[int]],
        rows: Sequence[tuple[int, int]],
        lengths: list[int],
        batch_rows: list[int],
    ) -> list[RoutedExperts]:
        """Per row, SGLang's ``routed_experts`` (with its topk): the prompt's tokens (from the prefill, whose
        prompts start at the first column) then the output tokens that were forwarded (all but the last)."""
        assert self._prefill_experts is not None and batch.routed_experts is not None  # a MoE records them
        width = max(len(p) for p in prompts)
        prefill = self._prefill_experts.reshape(len(prompts), width, *self._prefill_experts.shape[1:])
        out = []
        for (i, _), length, b in zip(rows, lengths, batch_rows, strict=True):
            forwarded = len(prompts[i]) + length - 1
            row = torch.cat([prefill[i, : len(prompts[i])], batch.routed_experts[b, : max(length - 1, 0)]])
            out.append(encode(row[:forwarded]))
        return out

    @staticmethod
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

    @property
    def decode_step_captured(self) -> bool:
        """The last generate's decode step ran as a CUDA graph (False on CPU or if capture failed)."""
        last = self._warm.last
        return last is not None and last.captured

    def check_prompts(self, input_ids: list[list[int]], params: list[SamplingParams]) -> None:
        for i, (prompt, p) in enumerate(zip(input_ids, params, strict=False)):
            if not prompt or min(prompt) < 0 or max(prompt) >= self.vocab_size:
                raise ValueError(
                    f"input_ids[{i}] must be a non-empty list of token ids in [0, {self.vocab_size}) "
                    "because those are the model's vocabulary; check the tokenizer"
                )
            if self.max_positions is not None and len(prompt) + p.max_new_tokens > self.max_positions:
                raise ValueError(
                    f"prompt length + max_new_tokens ({len(prompt)} + {p.max_new_tokens}) must be <= "
                    f"{self.max_positions} because that is the model's max_position_embeddings; "
                    "shorten the prompt or lower max_new_tokens"
                )
            if p.stop and self.tokenizer is None:
                raise ValueError(
                    f"sampling_params.stop ({list(p.stop)}) needs a tokenizer in the model directory "
                    "because stop strings are matched on decoded text; add one or use stop_token_ids"
                )

    def _row_key(self, params: SamplingParams, prompt: list[int], sample_index: int) -> int:
        if params.sampling_seed is not None:
            return row_key(params.sample_seed(prompt, sample_index))
        return row_key(int(torch.randint(0, 2**62, (1,), generator=self._rng)))

    def _forward(self, input_ids, attention_mask, position_ids, cache: StaticKVCache) -> torch.Tensor:
        """The one model call (prefill and decode): last position's logits in fp32, K/V into ``cache``."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def score_tokens(
        self, input_ids: list[list[int]], starts: list[int], temperature: float = 1.0
    ) -> list[list[float]]:
        """Each sequence's log-probs of its tokens from ``starts[i]`` on, given the tokens before them:
        ``log_softmax(logits / temperature)`` in fp32 over the whole vocabulary (a teacher scoring a student's
        responses). One prefill per sequence, through the generation path's attention, so nothing is cached."""
        if len(starts) != len(input_ids):
            raise ValueError(f"starts ({len(starts)}) must have one entry per sequence ({len(input_ids)})")
        out = []
        for ids, start in zip(input_ids, starts, strict=True):
            if not 1 <= start <= len(ids):
                raise ValueError(f"start ({start}) must be in [1, {len(ids)}] because token 0 has no context")
            self.check_prompts([ids], [SamplingParams.from_dict({"max_new_tokens": 1})])
            tokens = torch.tensor([ids], device=self.device)
            mask = torch.ones_like(tokens)
            cache = StaticKVCache(1, len(ids), self.device)
            cache.columns = torch.arange(len(ids), device=self.device)
            positions = torch.arange(len(ids), device=self.device)[None]
            context: contextlib.AbstractContextManager = contextlib.nullcontext()
            if self.router_recorder is not None:
                self._prefill_experts = self.router_recorder.prefill_buffer(tokens.numel(), self.device)
                context = self.router_recorder.writing(self._prefill_experts)
            with context:
                hidden = self.model.get_decoder()(
                    input_ids=tokens,
                    attention_mask=prefill_mask(mask),
                    position_ids=positions,
                    use_cache=True,
                    **{self._decoder_cache_kwarg: cache},
                ).last_hidden_state
            logits = self.model.get_output_embeddings()(hidden[0, start - 1 : len(ids) - 1]).float() / temperature
            targets = tokens[0, start:, None]
            out.append(torch.log_softmax(logits, dim=-1).gather(-1, targets)[:, 0].tolist())
        return out

    def _prefill_forward(
        self, ids, attention_mask, positions, cache: StaticKVCache, last: torch.Tensor
    ) -> torch.Tensor:
        """The prefill's model call: K/V into ``cache``, fp32 logits at each prompt's last position ``last``
        ([P]); the LM head sees only those rows (a right-padded batch has no common last column)."""
        decoder = self.model.get_decoder()
        hidden = decoder(
            input_ids=ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=True,
            **{self._decoder_cache_kwarg: cache},
        ).last_hidden_state
        rows = torch.arange(ids.shape[0], device=ids.device)
        return self.model.get_output_embeddings()(hidden[rows, last][:, None])[:, -1].float()

    def _prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, StaticKVCache, torch.Tensor]:
        """Prefill distinct prompts once, right-padded so every prompt starts at column 0 (the attention
        kernel then splits its keys into the same blocks as the trainer does: bitwise equal log-probs,
        rlrun.attention_kernel); returns (next-token logits per prompt, their cache, the [P, W] prompt mask)."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)
        mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts], device=self.device)
        positions = torch.arange(width, device=self.device).expand(len(prompts), width)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        cache = StaticKVCache(len(prompts), width, self.device)
        cache.columns = torch.arange(width, device=self.device)
        if self.router_recorder is None:
            return self._prefill_forward(ids, prefill_mask(mask), positions, cache, last), cache, mask
        self._prefill_experts = self.router_recorder.prefill_buffer(ids.numel(), self.device)
        with self.router_recorder.writing(self._prefill_experts):
            return self._prefill_forward(ids, prefill_mask(mask), positions, cache, last), cache, mask

    def _decode_step(self, batch: DecodeBatch, length: int) -> None:
        """One decode step on the batch's buffers only (the part that is captured as a CUDA graph), reading the
        first ``length`` cache columns."""
        batch.cache.read_len = length
        mask = batch.mask[..., :length]
        with self._decode_experts_kernel():
            if self.router_recorder is None:
                logits = self._forward(batch.input_ids, mask, batch.positions, batch.cache)
            else:
                assert batch.routed_experts is not None  # allocated with the recorder
                with self.router_recorder.writing(batch.routed_experts, batch.step):
                    logits = self._forward(batch.input_ids, mask, batch.positions, batch.cache)
        batch.advance()
        batch.record(logits)

    @contextlib.contextmanager
    def _decode_experts_kernel(self) -> Iterator[None]:
        """The decode step's experts kernel (:data:`CAPTURABLE_DECODE_EXPERTS`) while it runs; prefill keeps
        the load-time one, whose memory does not grow with one weight copy per (token, expert) pair."""
        if self._decode_experts is None:
            yield
            return
        prefill_kernel = self.model.config._experts_implementation
        self.model.set_experts_implementation(self._decode_experts)
        try:
            yield
        finally:
            self.model.set_experts_implementation(prefill_kernel)

    def _batch_for(self, shape: BatchShape, sampling: SamplingTensors) -> WarmBatch:
        """The decode buffers and captured steps for ``shape``: a recent call's when one matches."""

        def make() -> WarmBatch:
            batch = DecodeBatch.allocate(shape, sampling, self.device)
            if self.router_recorder is not None:
                batch.routed_experts = self.router_recorder.decode_buffer(shape.num_rows, shape.max_len, self.device)
            return WarmBatch(batch, self._decode_step, self.device)

        return self._warm.get(shape, make)

    def _decode(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        rows: Sequence[tuple[int, int]],
        request: RequestHandle,
        control: DecodeControl,
        early: EarlyDelivery | None = None,
        results_of: Callable | None = None,
    ) -> tuple[DecodeBatch, int, dict[int, str]]:
        """Run the batch to its end; returns (its buffers, steps recorded, stop strings matched by row)."""
        max_steps = max(p.max_new_tokens for p in params)
        row_params = [params[i] for i, _ in rows]
        prompt_of_row = torch.tensor([i for i, _ in rows], device=self.device)
        logits, prefill, prompt_mask = self._prefill(prompts)
        sampling = SamplingTensors.of(
            row_params, [self._row_key(params[i], prompts[i], j) for i, j in rows], self.vocab_size, self.device
        )
        stop_ids = self._stop_id_matrix(row_params)
        shape = BatchShape(
            num_rows=row_bucket(len(rows)),
            max_len=_round_up(prefill.max_len + max_steps, LEN_ALIGN),
            stop_width=_round_up(stop_ids.shape[1], 8),
            sample=sampling.sample,
            filter=sampling.filter,
            kept_width=min(KEPT_SET_WIDTH, self.vocab_size) if sampling.sample and sampling.filter else 0,
        )
        warm = self._batch_for(shape, sampling.padded(shape.num_rows))
        batch = warm.batch
        max_new = torch.tensor([p.max_new_tokens for p in row_params], device=self.device)
        batch.load(prefill, prompt_mask, prompt_of_row, max_new, stop_ids, sampling)
        stop_strings, aborted, steps = _StopStringRows(self.tokenizer, row_params), [False] * len(rows), 0
        while steps < max_steps:
            if control.paused:  # queued steps finish before a load may touch the weights
                self.synchronize()
            control.checkpoint(request)
            if request.aborted != aborted:
                aborted = list(request.aborted)
                batch.end_rows(torch.tensor(aborted, device=self.device), Finish.ABORT)
                if all(aborted):
                    break
            if steps == 0:
                batch.record(logits[torch.nn.functional.pad(prompt_of_row, (0, shape.num_rows - len(rows)))])
            else:  # forward ``steps`` attends up to column (prompt length + steps - 1) of each row
                warm.run(read_len(prefill.max_len + steps, shape.max_len))
            steps += 1
            if steps % SYNC_EVERY == 0:
                stop_strings.scan(batch, steps)
                if early is not None:
                    assert results_of is not None  # passed with early
                    done = functools.partial(results_of, batch, steps, stop_strings.matched)
                    early.deliver_done(batch.active.tolist(), done)
                if not batch.active.any():
                    break
        stop_strings.scan(batch, steps)
        return batch, steps, stop_strings.matched

    def _stop_id_matrix(self, row_params: Sequence[SamplingParams]) -> torch.Tensor:
        """[B, S] stop token ids per row, padded with -1 (never a token id)."""
        per_row = [[] if p.ignore_eos else sorted(self.eos_token_ids | set(p.stop_token_ids)) for p in row_params]
        width = max(1, max(len(r) for r in per_row))
        return torch.tensor([r + [-1] * (width - len(r)) for r in per_row], dtype=torch.long, device=self.device)

    def synchronize(self) -> None:
        """Wait until every queued GPU operation (decode steps, weight copies) has finished."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- weights and memory -----------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full HF-named tensors into the model (cast to its dtype). Every name and shape is
        checked before anything is copied, so a bad bucket leaves the weights untouched."""
        named_tensors = list(named_tensors)
        targets = []
        for name, tensor in named_tensors:
            if name in self._aliases:
                raise ValueError(
                    f"weight {name} must not be sent because it is tied to {self._aliases[name]} in this "
                    f"model; send only {self._aliases[name]} (SGLang ignores it too)"
                )
            # MoE experts arrive under checkpoint names and fill slices of fused parameters.
            target = self._params.get(name, self._saved_buffers.get(name))
            if target is None:
                target = expert_slice(self._params, name)
            if target is None:
                raise ValueError(
                    f"weight {name} must be a parameter of {type(self.model).__name__} because the "
                    "engine loads HF-named full tensors; expected names like "
                    f"{', '.join(list(self._params)[:3])}"
                )
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"shape of weight {name} ({list(tensor.shape)}) must equal the model's "
                    f"{list(target.shape)} because the engine loads full, unsharded tensors"
                )
            targets.append(target)
        # One fused call instead of a Python-level copy_ per tensor (hundreds per bucket for an 8B model).
        torch._foreach_copy_(targets, [t for _, t in named_tensors])

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """The model's parameters by HF name (tied aliases excluded), for checksums."""
        return dict(self._params)

    def offload_weights(self) -> None:
        """Move the weights (parameters and buffers) to host memory and return the GPU memory to the
        driver (no-op on CPU). The captured decode steps read the old weight addresses, so they are dropped
        too. The host copies are pinned buffers allocated once and reused: ``model.to("cpu")`` copied
        into fresh pageable memory every step, and that release and resume took ~0.6 s per colocated step
        on the H200 (benchmarks/results/offload_qwen3-0.6b_h200.json: offload phase minus trainer sleep
        and wake)."""
        if self.device.type != "cuda":
            return
        self._warm.clear()
        tensors = self._weight_tensors()
        if self._host_weights is None:
            self._host_weights = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, tensor in zip(self._host_weights, tensors, strict=False):
            host.copy_(tensor.data, non_blocking=True)
        torch.cuda.synchronize(self.device)  # the copies are done before the device memory is let go
        for host, tensor in zip(self._host_weights, tensors, strict=False):
            tensor.data = host
        torch.cuda.empty_cache()

    def onload_weights(self) -> None:
        if self.device.type != "cuda":
            return
        for tensor in self._weight_tensors():
            tensor.data = tensor.data.to(self.device, non_blocking=True)  # host buffers stay for the next offload

    def _weight_tensors(self) -> list[torch.Tensor]:
        """Every parameter (tied ones once) and buffer of the model, in a fixed order."""
        return list(self.model.parameters()) + list(self.model.buffers())

    def free_cache(self) -> None:
        """Drop the last generate's decode buffers and captured step and return the allocator's cached
        blocks (KV cache, activations) to the driver, so a released engine holds only its CUDA context
        (no-op on CPU)."""
        if self.device.type == "cuda":
            self._warm.clear()  # the decode buffers (KV cache) and the captured steps
            torch.cuda.synchronize(self.device)
            torch._C._cuda_clearCublasWorkspaces()  # cuBLAS keeps its workspaces outside the cache
            torch.cuda.empty_cache()
