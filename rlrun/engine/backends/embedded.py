"""``embedded``: a real, pure PyTorch/transformers rollout engine (CPU or one GPU; the default for CI).

It serves the same contract as the SGLang backend with a plain batched decode loop:

1. prefill each *distinct prompt* once (left-padded, explicit position_ids, only the last position's
   logits), then copy its KV cache to the ``n`` samples of its group;
2. decode all samples together, one token per step, each sample drawing from its own generator;
3. a sample ends on EOS / a stop token (kept in ``output_ids``, as SGLang does), on the token that
   completes a stop string, at max_new_tokens, or when it is aborted (partial output, as SGLang).

Finished samples keep riding along in the batch (their extra tokens are discarded), which keeps
the loop simple; fine for short RL responses, wasteful for long tails of very different lengths.
This module is synchronous; :mod:`rlrun.engine.backends.embedded_backend` runs it on a thread
behind the worker's event loop and owns abort/pause through a :class:`DecodeControl`.
"""

from __future__ import annotations

import dataclasses
import inspect
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from rlrun.engine.backends.decode_control import DecodeControl, RequestHandle
from rlrun.engine.sampling import SamplingParams, per_prompt_params, row_rids, sample_tokens
from rlrun.engine.types import DEFAULT_WEIGHT_VERSION, FinishReason, GenResult

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ABORTED: FinishReason = {"type": "abort", "message": "Aborted"}


@dataclasses.dataclass
class _Rows:
    """Decode state of B rows (row = one sample): tokens/logprobs are [B, steps], padded past ``lengths``."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor
    active: torch.Tensor
    finish: list[FinishReason | None]

    @classmethod
    def empty(cls, num_rows: int, max_steps: int, device: torch.device) -> _Rows:
        return cls(tokens=torch.zeros(num_rows, max_steps, dtype=torch.long, device=device),
                   logprobs=torch.zeros(num_rows, max_steps, dtype=torch.float32, device=device),
                   lengths=torch.zeros(num_rows, dtype=torch.long, device=device),
                   active=torch.ones(num_rows, dtype=torch.bool, device=device), finish=[None] * num_rows)

    def end(self, rows: torch.Tensor, reason: FinishReason | list[FinishReason]) -> None:
        """Finish the still-active rows in the bool mask ``rows`` (one reason, or one per row index)."""
        rows = rows & self.active
        for b in rows.nonzero().flatten().tolist():
            self.finish[b] = reason if isinstance(reason, dict) else reason[b]
        self.active &= ~rows


class _StopStrings:
    """SGLang's stop-string check: after each token, decode the last (longest stop in tokens + 1)
    tokens and look for every stop string in that text (``schedule_batch.py``, ``tail_str``)."""

    def __init__(self, tokenizer, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.window = 1 + max(len(tokenizer.encode(s, add_special_tokens=False)) for s in stops)

    def match(self, output_ids: list[int]) -> str | None:
        tail = self.tokenizer.decode(output_ids[-self.window:])
        return next((s for s in self.stops if s in tail), None)


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

    def __init__(self, model_path: str | Path, *, seed: int = 0, dtype: str = "float32",
                 device: str | torch.device = "cpu") -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype ({dtype!r}) must be one of {sorted(DTYPES)} because the embedded engine "
                             "computes in one of those; set model.dtype accordingly")
        model_path = Path(model_path)
        self.device = torch.device(device)
        self.model = (AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype]).to(self.device)
                      .eval().requires_grad_(False))
        self.tokenizer = (AutoTokenizer.from_pretrained(model_path)
                          if (model_path / "tokenizer_config.json").exists() else None)
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self.vocab_size: int = self.model.get_output_embeddings().weight.shape[0]
        self.max_positions: int | None = getattr(self.model.config, "max_position_embeddings", None)
        self._params = dict(self.model.named_parameters())
        # Names that alias a parameter listed under another name (tied lm_head -> embed_tokens).
        param_at = {t.data_ptr(): name for name, t in self._params.items()}
        self._aliases = {name: param_at[t.data_ptr()] for name, t in self.model.state_dict().items()
                         if name not in self._params and t.data_ptr() in param_at}
        # transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns until 5.40).
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self._rng = torch.Generator().manual_seed(seed)

    # ---- generation -------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, input_ids: list[list[int]], sampling_params: Mapping[str, Any] | Sequence[Any],
                 return_logprob: bool = True, rids: list[str] | None = None, *,
                 request: RequestHandle | None = None, control: DecodeControl | None = None) -> list[GenResult]:
        """Sample ``n`` responses per prompt; results are prompt-major (all samples of prompt 0 first).

        ``request`` (its rows' rids and abort flags) and ``control`` (the pause gate) come from the
        async backend; called directly, the request cannot be aborted or paused.
        """
        params = per_prompt_params(len(input_ids), sampling_params)
        self._check_prompts(input_ids, params)
        rids = rids if rids is not None else [uuid.uuid4().hex for _ in input_ids]
        if len(rids) != len(input_ids):
            raise ValueError(f"rids ({len(rids)} ids) must have one id per prompt ({len(input_ids)}); pass None or fix")
        request = request if request is not None else RequestHandle(row_rids(rids, params))
        control = control if control is not None else DecodeControl()
        rows = [(i, j) for i, p in enumerate(params) for j in range(p.n)]
        with control.running():
            state = self._decode(input_ids, params, rows, request, control)
        tokens, logprobs, lengths = state.tokens.tolist(), state.logprobs.tolist(), state.lengths.tolist()
        return [{
            "rid": request.row_rids[b],
            "output_ids": tokens[b][:lengths[b]],
            "output_logprobs": logprobs[b][:lengths[b]] if return_logprob else None,
            "finish_reason": state.finish[b],
            "prompt_tokens": len(input_ids[i]),
            "completion_tokens": lengths[b],
            "weight_version": self.weight_version,
        } for b, (i, _) in enumerate(rows)]

    def _check_prompts(self, input_ids: list[list[int]], params: list[SamplingParams]) -> None:
        for i, (prompt, p) in enumerate(zip(input_ids, params)):
            if not prompt or min(prompt) < 0 or max(prompt) >= self.vocab_size:
                raise ValueError(f"input_ids[{i}] must be a non-empty list of token ids in [0, {self.vocab_size}) "
                                 "because those are the model's vocabulary; check the tokenizer")
            if self.max_positions is not None and len(prompt) + p.max_new_tokens > self.max_positions:
                raise ValueError(f"prompt length + max_new_tokens ({len(prompt)} + {p.max_new_tokens}) must be <= "
                                 f"{self.max_positions} because that is the model's max_position_embeddings; "
                                 "shorten the prompt or lower max_new_tokens")
            if p.stop and self.tokenizer is None:
                raise ValueError(f"sampling_params.stop ({list(p.stop)}) needs a tokenizer in the model directory "
                                 "because stop strings are matched on decoded text; add one or use stop_token_ids")

    def _generator(self, params: SamplingParams, prompt: list[int], sample_index: int) -> torch.Generator:
        if params.sampling_seed is not None:
            seed = params.sample_seed(prompt, sample_index)
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        return torch.Generator(device=self.device).manual_seed(seed)

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{self._cache_kwarg: cache})
        return out.logits[:, -1].float()

    def _prefill(self, prompts: list[list[int]], prompt_of_row: torch.Tensor):
        """Prefill distinct prompts once, left-padded so every prompt ends at the last column; returns
        (next-token logits per row, the cache with each prompt's KV copied to its rows, mask, next position)."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, positions, cache)[prompt_of_row]
        cache.batch_select_indices(prompt_of_row)  # share each prompt's KV across its samples
        return logits, cache, mask[prompt_of_row], positions[prompt_of_row, -1] + 1

    def _decode(self, prompts: list[list[int]], params: list[SamplingParams], rows: Sequence[tuple[int, int]],
                request: RequestHandle, control: DecodeControl) -> _Rows:
        num_rows, max_steps = len(rows), max(p.max_new_tokens for p in params)
        row_params = [params[i] for i, _ in rows]
        generators = [self._generator(params[i], prompts[i], j) for i, j in rows]
        prompt_of_row = torch.tensor([i for i, _ in rows], device=self.device)
        logits, cache, mask, next_position = self._prefill(prompts, prompt_of_row)
        state = _Rows.empty(num_rows, max_steps, self.device)
        max_new = torch.tensor([p.max_new_tokens for p in row_params], device=self.device)
        length_reasons = [{"type": "length", "length": p.max_new_tokens} for p in row_params]
        stop_ids = self._stop_id_matrix(row_params)
        stop_strings = {b: _StopStrings(self.tokenizer, p.stop) for b, p in enumerate(row_params) if p.stop}
        outputs: dict[int, list[int]] = {b: [] for b in stop_strings}  # token lists of rows that match text
        for step in range(max_steps):
            control.checkpoint(request)
            if any(request.aborted):
                state.end(torch.tensor(request.aborted, device=self.device), ABORTED)
            if not state.active.any():
                break
            token, logprob = sample_tokens(logits, row_params, generators)
            state.tokens[:, step], state.logprobs[:, step] = token, logprob
            state.lengths += state.active
            matched = (token[:, None] == stop_ids) & (stop_ids >= 0)
            state.end(matched.any(-1), [{"type": "stop", "matched": t} for t in token.tolist()])
            self._match_stop_strings(state, stop_strings, outputs, token)
            state.end(state.lengths >= max_new, length_reasons)
            if not state.active.any():
                break
            mask = torch.cat([mask, torch.ones(num_rows, 1, dtype=mask.dtype, device=self.device)], dim=1)
            logits = self._forward(token[:, None], mask, next_position[:, None], cache)
            next_position = next_position + 1
        return state

    @staticmethod
    def _match_stop_strings(state: _Rows, stop_strings: dict[int, _StopStrings], outputs: dict[int, list[int]],
                            token: torch.Tensor) -> None:
        if not stop_strings:
            return
        active, tokens = state.active.tolist(), token.tolist()
        for b, matcher in stop_strings.items():
            if not active[b]:
                continue
            outputs[b].append(tokens[b])
            matched = matcher.match(outputs[b])
            if matched is not None:
                state.finish[b] = {"type": "stop", "matched": matched}
                state.active[b] = False

    def _stop_id_matrix(self, row_params: Sequence[SamplingParams]) -> torch.Tensor:
        """[B, S] stop token ids per row, padded with -1 (never a token id)."""
        per_row = [[] if p.ignore_eos else sorted(self.eos_token_ids | set(p.stop_token_ids)) for p in row_params]
        width = max(1, max(len(r) for r in per_row))
        return torch.tensor([r + [-1] * (width - len(r)) for r in per_row], dtype=torch.long, device=self.device)

    # ---- weights and memory -----------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full HF-named tensors into the model (cast to its dtype). Every name and shape is
        checked before anything is copied, so a bad bucket leaves the weights untouched."""
        named_tensors = list(named_tensors)
        for name, tensor in named_tensors:
            if name in self._aliases:
                raise ValueError(f"weight {name} must not be sent because it is tied to {self._aliases[name]} in this "
                                 f"model; send only {self._aliases[name]} (SGLang ignores it too)")
            if name not in self._params:
                raise ValueError(f"weight {name} must be a parameter of {type(self.model).__name__} because the "
                                 "engine loads HF-named full tensors; expected names like "
                                 f"{', '.join(list(self._params)[:3])}")
            if tuple(tensor.shape) != tuple(self._params[name].shape):
                raise ValueError(f"shape of weight {name} ({list(tensor.shape)}) must equal the model's "
                                 f"{list(self._params[name].shape)} because the engine loads full, unsharded tensors")
        for name, tensor in named_tensors:
            self._params[name].copy_(tensor)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """The model's parameters by HF name (tied aliases excluded), for checksums."""
        return dict(self._params)

    def offload_weights(self) -> None:
        """Move the weights to host memory and return the GPU memory to the driver (no-op on CPU)."""
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def onload_weights(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)

    def free_cache(self) -> None:
        """Return the allocator's cached blocks (the last generate's KV cache and activations) to the
        driver, so a released engine holds only its CUDA context (no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch._C._cuda_clearCublasWorkspaces()  # cuBLAS keeps its workspaces outside the cache
            torch.cuda.empty_cache()
