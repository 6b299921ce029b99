"""``embedded``: a real, pure PyTorch/transformers rollout engine (CPU or one GPU; the default for CI).

It serves the same contract as the SGLang backend with a batched decode loop over static buffers:

1. prefill each *distinct prompt* once (right-padded, so every prompt starts at cache column 0 as each
   sample starts at key 0 in the trainer; only each prompt's last position's logits) into a
   :class:`StaticKVCache`, then copy its KV to the ``n`` samples of its group in a
   preallocated decode cache (:mod:`rlrun.engine.embedded.decode_batch`);
2. decode all samples together, one token per step; a step (forward, sampling with per-row
   counter-based noise, end conditions) touches only device buffers and reads only the filled cache
   columns (rounded up to a bucket), so on GPU it is captured once per bucket as a CUDA graph and
   replayed; recent batch shapes keep their buffers and graphs warm (:mod:`.decode_graphs`); the host
   looks at the state only every ``SYNC_EVERY`` steps;
3. a sample ends on EOS / a stop token (kept in ``output_ids``, as SGLang does), on the token that
   completes a stop string (matched on the host at those looks, a few steps behind the device; the
   extra tokens are cut), at max_new_tokens, or when it is aborted (partial output, as SGLang).

With ``max_running_requests`` the batch holds at most that many samples; the others wait, and each one
takes the slot of a sample that ended at the next host look (continuous batching, :mod:`.decode_run`).
Finished samples that no waiting one replaces ride along until the call ends (their tokens discarded).
This module is synchronous; :mod:`rlrun.engine.embedded.backend` runs it on a thread
behind the worker's event loop and owns abort/pause through a :class:`DecodeControl`.
"""

from __future__ import annotations

import contextlib
import inspect
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlrun.engine.embedded.decode_batch import BatchShape, DecodeBatch
from rlrun.engine.embedded.decode_control import DecodeControl, EarlyDelivery, RequestHandle
from rlrun.engine.embedded.decode_graphs import WarmBatch, WarmBatches
from rlrun.engine.embedded.decode_run import SYNC_EVERY, DecodeRun
from rlrun.engine.embedded.fused_experts import expert_slice
from rlrun.engine.embedded.fused_norm import fuse_residual_norms, fuse_rms_norms
from rlrun.engine.embedded.fused_projections import fuse_projections
from rlrun.engine.embedded.fused_rope import fuse_rotary
from rlrun.engine.embedded.fused_swiglu import fuse_swiglu
from rlrun.engine.embedded.routing_record import RouterRecorder
from rlrun.engine.embedded.session_cache import KeptSession, SessionCache, reusable_columns
from rlrun.engine.embedded.static_cache import (
    ATTENTION,
    ATTENTION_CHUNKED,
    StaticKVCache,
    built_per_forward,
    prefill_mask,
)
from rlrun.engine.sampling import SamplingParams, per_prompt_params, row_key, row_rids
from rlrun.engine.types import DEFAULT_WEIGHT_VERSION, GenResult
from rlrun.kernels.triton_support import triton_available

__all__ = ["SYNC_EVERY", "EarlyDelivery", "EmbeddedEngine"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


CAPTURABLE_DECODE_EXPERTS = "batched_mm"
"""transformers' experts kernel for the decode step of a fused-experts MoE on CUDA outside bfloat16. The
default ``grouped_mm`` copies a host tensor there (torch's grouped_mm outside bf16), and ``eager`` loops over
the experts the batch hit, so neither can be captured as a CUDA graph; ``batched_mm`` (one bmm over every
(token, expert) pair, no data-dependent shape) can, at little cost for decode's few tokens. With torch 2.11 and
transformers 5.17, float32 grouped_mm and eager fail capture and batched_mm captures; bfloat16 grouped_mm captures, so
bf16 keeps it (it does not gather one weight copy per pair)."""


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


def _dense_count(name: str, value: int | None, minimum: int, moe: bool, why: str) -> int | None:
    """A server argument that counts something (None: unset), for dense models only."""
    if value is not None and (not isinstance(value, int) or value < minimum or moe):
        raise ValueError(
            f"{name} ({value!r}) must be unset for a MoE model and an integer >= {minimum} otherwise because {why}; "
            "remove it (engine.server_args) or set a count"
        )
    return value


ATTENTION_KERNELS = {"efficient": ATTENTION, "chunked": ATTENTION_CHUNKED}
"""``attention_kernel`` -> the attention function the model is loaded with: the trainer's kernel family
(``BackendSpec.from_config`` through ``rlrun.kernels.attention.engine_kernel_family``: ``chunked`` where the trainer
runs ``chunked_varlen``, as ``auto`` does on CUDA in bfloat16, ``efficient`` otherwise)."""


def _attention_implementation(kernel: str, device: torch.device) -> str:
    if kernel not in ATTENTION_KERNELS or (kernel == "chunked" and (device.type != "cuda" or not triton_available())):
        raise ValueError(
            f"attention_kernel ({kernel!r}) must be one of {sorted(ATTENTION_KERNELS)}, and chunked needs CUDA and "
            f"Triton (device {device}, Triton importable: {triton_available()}) because its kernels are Triton's; "
            "set model.packed_attention to auto or efficient_varlen"
        )
    return ATTENTION_KERNELS[kernel]


class EmbeddedEngine:
    """A transformers causal LM in eval mode behind the engine contract's generate and weight loading."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        seed: int = 0,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        max_running_requests: int | None = None,
        chunked_prefill_size: int | None = None,
        attention_kernel: str = "efficient",
        session_cache_size: int = 0,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(
                f"dtype ({dtype!r}) must be one of {sorted(DTYPES)} because the embedded engine "
                "computes in one of those; set model.dtype accordingly"
            )
        model_path = Path(model_path)
        self.device = torch.device(device)
        attention = _attention_implementation(attention_kernel, self.device)
        if self.device.type == "cuda":
            if self.device.index is None:  # "cuda": the current device, named, so set_device can take it
                self.device = torch.device("cuda", torch.cuda.current_device())
            # What names no device acts on the current one: CUDA graph capture's side stream, empty_cache,
            # cuBLAS workspaces. Without this, rank 1's engine on cuda:1 makes its capture stream on cuda:0,
            # the likely cause of the slow 2-GPU rollout in BENCHMARKS.md, "Multi-GPU" (weak scaling).
            torch.cuda.set_device(self.device)
        # SDPA-based attention that takes the static cache's ready boolean masks (see static_cache.py).
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype], attn_implementation=attention)
            .to(self.device)  # type: ignore[arg-type]  # transformers' wrapped .to hides the device overload
            .eval()
            .requires_grad_(False)
        )
        fuse_rms_norms(self.model)
        fuse_residual_norms(self.model)  # on the shared hidden norms: after fuse_rms_norms
        fuse_rotary(self.model)
        self._slices = fuse_projections(self.model)
        """Checkpoint names of the q/k/v and gate/up weights -> their rows of the fused parameters."""
        fuse_swiglu(self.model)  # on the fused gate/up output: after fuse_projections
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
        moe = self.router_recorder is not None
        self.max_running_requests = _dense_count(
            "max_running_requests",
            max_running_requests,
            1,
            moe,
            "a MoE call records its prompts' experts from one prefill of every row",
        )
        """At most this many samples decode at once, the rest wait for a slot (None: every sample of a call)."""
        self.chunked_prefill_size = _dense_count(
            "chunked_prefill_size",
            chunked_prefill_size,
            2,
            moe,
            "a MoE prefill records its prompts' experts from one forward, and a chunk needs two columns",
        )
        """A prefill forward covers at most this many token slots (prompts x columns; None: one forward)."""
        self.sessions = SessionCache(
            _dense_count(
                "session_cache_size",
                session_cache_size or None,
                1,
                moe,
                "a MoE call records its prompts' experts from a prefill of every prompt token",
            )
            or 0
        )
        """Sessions' K/V kept across calls (:mod:`.session_cache`; off at size 0) and the prefill token counts."""
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
        control = control if control is not None else DecodeControl()
        with control.running():
            return self.decode_run(input_ids, sampling_params, return_logprob, rids, request).run(control, early)

    def decode_run(
        self,
        input_ids: list[list[int]],
        sampling_params: Mapping[str, Any] | Sequence[Any],
        return_logprob: bool = True,
        rids: list[str] | None = None,
        request: RequestHandle | None = None,
    ) -> DecodeRun:
        """One call's decode state, nothing run yet (:meth:`generate` runs it to the end; ``bench rollout
        --profile`` steps it forward by forward). Call under ``torch.inference_mode``."""
        params = per_prompt_params(len(input_ids), sampling_params)
        self.check_prompts(input_ids, params)
        rids = rids if rids is not None else [uuid.uuid4().hex for _ in input_ids]
        if len(rids) != len(input_ids):
            raise ValueError(f"rids ({len(rids)} ids) must have one id per prompt ({len(input_ids)}); pass None or fix")
        request = request if request is not None else RequestHandle(row_rids(rids, params))
        return DecodeRun(self, input_ids, params, request, return_logprob, self.max_running_requests)

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
        """The decode step's model call: last position's logits in the model's dtype (the sampler's temperature
        division widens them to fp32 exactly; a ``.float()`` here wrote a [B, V] fp32 copy every step), K/V into
        ``cache``."""
        with built_per_forward():
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kwarg: cache},
            )
        return out.logits[:, -1]

    @torch.inference_mode()
    def score_tokens(
        self, input_ids: list[list[int]], starts: list[int], temperature: float = 1.0
    ) -> list[list[float]]:
        """Each sequence's log-probs of its tokens from ``starts[i]`` on, given the tokens before them:
        ``log_softmax(logits / temperature)`` in fp32 over the whole vocabulary (a teacher scoring a student's
        responses). One prefill per sequence, through the generation path's attention, so nothing is cached;
        a MoE model's routing is not recorded (nothing reads it)."""
        if len(starts) != len(input_ids):
            raise ValueError(f"starts ({len(starts)}) must have one entry per sequence ({len(input_ids)})")
        out = []
        for ids, start in zip(input_ids, starts, strict=True):
            if not 1 <= start <= len(ids):
                raise ValueError(f"start ({start}) must be in [1, {len(ids)}] because token 0 has no context")
            self.check_prompts([ids], [SamplingParams.from_dict({"max_new_tokens": 1})])
            hidden, _, _ = self._prefill_hidden([ids])
            logits = self.model.get_output_embeddings()(hidden[0, start - 1 : len(ids) - 1]).float() / temperature
            targets = torch.tensor(ids[start:], device=self.device)[:, None]
            out.append(torch.log_softmax(logits, dim=-1).gather(-1, targets)[:, 0].tolist())
        return out

    def _prefill_hidden(
        self, prompts: list[list[int]], kept: Sequence[KeptSession] = (), start: int = 0
    ) -> tuple[torch.Tensor, StaticKVCache, torch.Tensor]:
        """The decoder over ``prompts`` right-padded so every prompt starts at column 0 (the attention kernel then
        splits its keys into the same blocks as the trainer does: bitwise equal log-probs, rlrun.kernels.attention),
        in column chunks (:meth:`prefill_chunks`); returns ([P, W - start, hidden] last hidden states of columns
        ``start`` on, the prompts' K/V cache, the [P, W] prompt mask). With ``start``, columns before it are copied
        from each prompt's ``kept`` session K/V, not forwarded."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)
        mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts], device=self.device)
        positions = torch.arange(width, device=self.device).expand(len(prompts), width)
        cache = StaticKVCache(len(prompts), width, self.device)
        if start:
            for layer, (key, value) in enumerate(zip(kept[0].keys, kept[0].values, strict=True)):
                cache._allocate(key[None], value[None])
                for row, session in enumerate(kept):
                    cache.keys[layer][row, :, :start] = session.keys[layer][:, :start]
                    cache.values[layer][row, :, :start] = session.values[layer][:, :start]
        hidden = []
        for first, stop in self.prefill_chunks(len(prompts), width - start):
            first, stop = first + start, stop + start
            cache.columns = torch.arange(first, stop, device=self.device)
            cache.read_len = stop  # a chunk's queries attend to the columns before it and its own
            with built_per_forward():
                hidden.append(
                    self.model.get_decoder()(
                        input_ids=ids[:, first:stop],
                        attention_mask=prefill_mask(mask, first, stop),
                        position_ids=positions[:, first:stop],
                        use_cache=True,
                        **{self._decoder_cache_kwarg: cache},
                    ).last_hidden_state
                )
        cache.read_len = None
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden, dim=1), cache, mask

    def prefill_chunks(self, prompts: int, width: int) -> list[tuple[int, int]]:
        """The column ranges of a prefill of ``prompts`` right-padded prompts ``width`` wide: one forward, or, with
        ``chunked_prefill_size``, chunks of ``chunked_prefill_size // prompts`` columns (at least 2), so a forward's
        activations and attention mask stay bounded however long the prompts. Each chunk attends to the cache
        columns before it under the same kernel, keys in the same blocks from column 0: on CUDA bitwise the
        one-forward prefill. No chunk is one column wide (the last is merged into the one before): a one-position
        query is read as a decode step, whose mask must be a prefix of the columns, and a padding row's is not."""
        step = width if self.chunked_prefill_size is None else max(2, self.chunked_prefill_size // prompts)
        starts = list(range(0, width, step))
        if len(starts) > 1 and width - starts[-1] < 2:
            starts.pop()
        return list(zip(starts, [*starts[1:], width], strict=True))

    def _prefill(
        self, prompts: list[list[int]], kept: Sequence[KeptSession | None] = ()
    ) -> tuple[torch.Tensor, StaticKVCache, torch.Tensor]:
        """Prefill distinct prompts once (:meth:`_prefill_hidden`), recording a MoE model's routing into
        ``_prefill_experts``; returns (fp32 next-token logits per prompt, their cache, the [P, W] prompt mask).
        The LM head sees only each prompt's last position (a right-padded batch has no common last column).
        ``kept``: each prompt's session K/V that it extends (:mod:`.session_cache`); where every prompt has some,
        the columns all share (:func:`reusable_columns`) are copied, not forwarded."""
        start = reusable_columns(prompts, kept)
        self.sessions.prefill_tokens += sum(len(p) for p in prompts) - start * len(prompts)
        self.sessions.reused_tokens += start * len(prompts)
        context: contextlib.AbstractContextManager = contextlib.nullcontext()
        if self.router_recorder is not None:
            num_tokens = len(prompts) * max(len(p) for p in prompts)
            self._prefill_experts = self.router_recorder.prefill_buffer(num_tokens, self.device)
            context = self.router_recorder.writing(self._prefill_experts)
        with context:
            hidden, cache, mask = self._prefill_hidden(prompts, [k for k in kept if k is not None], start)
        rows = torch.arange(len(prompts), device=self.device)
        last = torch.tensor([len(p) - 1 - start for p in prompts], device=self.device)
        return self.model.get_output_embeddings()(hidden[rows, last][:, None])[:, -1].float(), cache, mask

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

    def _batch_for(self, shape: BatchShape) -> WarmBatch:
        """The decode buffers and captured steps for ``shape``: a recent call's when one matches."""

        def make() -> WarmBatch:
            batch = DecodeBatch.allocate(shape, self.device)
            if self.router_recorder is not None:
                batch.routed_experts = self.router_recorder.decode_buffer(shape.num_rows, shape.max_len, self.device)
            return WarmBatch(batch, self._decode_step, self.device)

        return self._warm.get(shape, make)

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
            # Fused projections and MoE experts arrive under checkpoint names and fill slices of fused parameters.
            target = self._params.get(name, self._saved_buffers.get(name))
            if target is None:
                target = self._projection_slice(name)
            if target is None:
                target = expert_slice(self._params, name)
            if target is None:
                raise ValueError(
                    f"weight {name} must be a parameter of {type(self.model).__name__} because the "
                    "engine loads HF-named full tensors; expected names like "
                    f"{', '.join(list(self.named_parameters())[:3])}"
                )
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"shape of weight {name} ({list(tensor.shape)}) must equal the model's "
                    f"{list(target.shape)} because the engine loads full, unsharded tensors"
                )
            targets.append(target)
        self.sessions.clear()  # their K/V are the old weights'
        # One fused call instead of a Python-level copy_ per tensor (hundreds per bucket for an 8B model).
        torch._foreach_copy_(targets, [t for _, t in named_tensors])

    def _projection_slice(self, name: str) -> torch.Tensor | None:
        """The rows of a fused projection parameter that checkpoint weight ``name`` is (a view, taken now: offload
        replaces the parameter's storage), or None."""
        where = self._slices.get(name)
        return None if where is None else self._params[where.fused][where.rows]

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """The model's parameters by HF name (tied aliases excluded; fused projections as their checkpoint
        weights), for checksums."""
        fused = {where.fused for where in self._slices.values()}
        named = {name: t for name, t in self._params.items() if name not in fused}
        named.update((name, self._projection_slice(name)) for name in self._slices)
        return named

    def offload_weights(self) -> None:
        """Move the weights (parameters and buffers) to host memory and return the GPU memory to the
        driver (no-op on CPU). The captured decode steps read the old weight addresses, so they are dropped
        too. The host copies are pinned buffers allocated once and reused: ``model.to("cpu")`` would copy
        into fresh pageable memory every step, allocated anew and slower to copy to and from (BENCHMARKS.md,
        "rlrun against TRL with transformers `generate`")."""
        self.sessions.clear()
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
        (no-op on CPU, but for the sessions' K/V, dropped everywhere)."""
        self.sessions.clear()
        if self.device.type == "cuda":
            self._warm.clear()  # the decode buffers (KV cache) and the captured steps
            torch.cuda.synchronize(self.device)
            torch._C._cuda_clearCublasWorkspaces()  # cuBLAS keeps its workspaces outside the cache
            torch.cuda.empty_cache()
