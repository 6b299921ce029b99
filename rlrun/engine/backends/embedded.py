"""``embedded``: a real, pure PyTorch/transformers rollout engine (CPU now; the default for CI).

It serves the same contract as the SGLang backend with a plain batched decode loop:

1. prefill each *distinct prompt* once (left-padded, explicit position_ids, only the last position's
   logits), then copy its KV cache to the ``n`` samples of its group;
2. decode all samples together, one token per step, each sample drawing from its own generator;
3. a sample ends on EOS / a stop token (kept in ``output_ids``, as SGLang does) or at max_new_tokens.

Finished samples keep riding along in the batch (their extra tokens are discarded), which keeps
the loop simple; fine for short RL responses, wasteful for long tails of very different lengths.
"""

from __future__ import annotations

import dataclasses
import inspect
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from rlrun.engine.payload import deserialize_flattened_bucket
from rlrun.engine.sampling import SamplingParams, sample_tokens
from rlrun.engine.types import DEFAULT_WEIGHT_VERSION, GenResult

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class _Decoded:
    """Decode output for B rows (row = one sample): tokens/logprobs are [B, steps], padded past ``lengths``."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor
    matched: torch.Tensor
    """The stop token that ended each row, or -1 if it ran to max_new_tokens."""


def _eos_token_ids(model_path: Path, model) -> set[int]:
    """EOS ids as SGLang collects them: the generation config's (which falls back to config.json's)
    plus the tokenizer's ``eos_token_id`` when the directory has a tokenizer."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if (model_path / "tokenizer_config.json").exists():
        tokenizer_eos = AutoTokenizer.from_pretrained(model_path).eos_token_id
        if tokenizer_eos is not None:
            ids.add(tokenizer_eos)
    return ids


class EmbeddedEngine:
    """A transformers causal LM in eval mode behind the engine contract's generate/update calls."""

    def __init__(self, model_path: str | Path, *, seed: int = 0, dtype: str = "float32") -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype ({dtype!r}) must be one of {sorted(DTYPES)} because the embedded engine "
                             "computes in one of those; set --dtype accordingly")
        model_path = Path(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype]).eval().requires_grad_(False)
        self.eos_token_ids = _eos_token_ids(model_path, self.model)
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
    def generate(self, input_ids: list[list[int]], sampling_params: dict | list[dict],
                 return_logprob: bool = True, rids: list[str] | None = None) -> list[GenResult]:
        """Sample ``n`` responses per prompt; results are prompt-major (all samples of prompt 0 first)."""
        params = self._per_prompt_params(input_ids, sampling_params)
        rids = rids if rids is not None else [uuid.uuid4().hex for _ in input_ids]
        if len(rids) != len(input_ids):
            raise ValueError(f"rids ({len(rids)} ids) must have one id per prompt ({len(input_ids)}); pass None or fix")
        rows = [(i, j) for i, p in enumerate(params) for j in range(p.n)]
        decoded = self._decode(input_ids, params, rows)
        results: list[GenResult] = []
        for b, (i, j) in enumerate(rows):
            length, matched = int(decoded.lengths[b]), int(decoded.matched[b])
            results.append({
                "rid": rids[i] if params[i].n == 1 else f"{rids[i]}-{j}",
                "output_ids": decoded.tokens[b, :length].tolist(),
                "output_logprobs": decoded.logprobs[b, :length].tolist() if return_logprob else None,
                "finish_reason": ({"type": "stop", "matched": matched} if matched >= 0
                                  else {"type": "length", "length": params[i].max_new_tokens}),
                "prompt_tokens": len(input_ids[i]),
                "completion_tokens": length,
                "weight_version": self.weight_version,
            })
        return results

    def _per_prompt_params(self, input_ids: list[list[int]], sampling_params: dict | list[dict]) -> list[SamplingParams]:
        if not input_ids:
            raise ValueError("input_ids (empty) must hold at least one prompt")
        if isinstance(sampling_params, dict):
            sampling_params = [sampling_params] * len(input_ids)
        if len(sampling_params) != len(input_ids):
            raise ValueError(f"sampling_params ({len(sampling_params)} dicts) must be one dict or one per prompt "
                             f"({len(input_ids)})")
        params = [SamplingParams.from_dict(sp) for sp in sampling_params]
        for i, (prompt, p) in enumerate(zip(input_ids, params)):
            if not prompt or min(prompt) < 0 or max(prompt) >= self.vocab_size:
                raise ValueError(f"input_ids[{i}] must be a non-empty list of token ids in [0, {self.vocab_size}) "
                                 "because those are the model's vocabulary; check the tokenizer")
            if self.max_positions is not None and len(prompt) + p.max_new_tokens > self.max_positions:
                raise ValueError(f"prompt length + max_new_tokens ({len(prompt)} + {p.max_new_tokens}) must be <= "
                                 f"{self.max_positions} because that is the model's max_position_embeddings; "
                                 "shorten the prompt or lower max_new_tokens")
        return params

    def _generator(self, params: SamplingParams, prompt: list[int], sample_index: int) -> torch.Generator:
        if params.sampling_seed is not None:
            seed = params.sample_seed(prompt, sample_index)
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        return torch.Generator().manual_seed(seed)

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{self._cache_kwarg: cache})
        return out.logits[:, -1].float()

    def _decode(self, prompts: list[list[int]], params: list[SamplingParams],
                rows: Sequence[tuple[int, int]]) -> _Decoded:
        num_rows, max_steps = len(rows), max(p.max_new_tokens for p in params)
        row_params = [params[i] for i, _ in rows]
        generators = [self._generator(params[i], prompts[i], j) for i, j in rows]
        prompt_of_row = torch.tensor([i for i, _ in rows])

        # Prefill distinct prompts once, left-padded so every prompt ends at the last column.
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, positions, cache)[prompt_of_row]
        cache.batch_select_indices(prompt_of_row)  # share each prompt's KV across its samples
        mask, next_position = mask[prompt_of_row], positions[prompt_of_row, -1] + 1

        tokens = torch.zeros(num_rows, max_steps, dtype=torch.long)
        logprobs = torch.zeros(num_rows, max_steps, dtype=torch.float32)
        lengths = torch.zeros(num_rows, dtype=torch.long)
        matched = torch.full((num_rows,), -1, dtype=torch.long)
        max_new = torch.tensor([p.max_new_tokens for p in row_params])
        stop_ids = self._stop_id_matrix(row_params)
        active = torch.ones(num_rows, dtype=torch.bool)
        for step in range(max_steps):
            token, logprob = sample_tokens(logits, row_params, generators)
            tokens[:, step], logprobs[:, step] = token, logprob
            lengths += active
            stopped = active & (token[:, None] == stop_ids).any(-1)
            matched[stopped] = token[stopped]
            active &= ~stopped & (lengths < max_new)
            if not active.any():
                break
            mask = torch.cat([mask, torch.ones(num_rows, 1, dtype=mask.dtype)], dim=1)
            logits = self._forward(token[:, None], mask, next_position[:, None], cache)
            next_position = next_position + 1
        return _Decoded(tokens, logprobs, lengths, matched)

    def _stop_id_matrix(self, row_params: Sequence[SamplingParams]) -> torch.Tensor:
        """[B, S] stop token ids per row, padded with -1 (never a token id)."""
        per_row = [[] if p.ignore_eos else sorted(self.eos_token_ids | set(p.stop_token_ids)) for p in row_params]
        width = max(1, max(len(r) for r in per_row))
        return torch.tensor([r + [-1] * (width - len(r)) for r in per_row], dtype=torch.long)

    # ---- weights ----------------------------------------------------------------------------------

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

    # ---- the worker's backend interface (see rlrun.engine.backends) -------------------------------

    def update_weights_from_tensor(self, payloads: list[bytes], load_format: str, weight_version: str | None) -> None:
        if load_format != "flattened_bucket":
            raise ValueError(f"load_format ({load_format!r}) must be 'flattened_bucket' because that is the only "
                             "payload format the embedded engine reads; build payloads with serialize_flattened_bucket")
        if len(payloads) != 1:
            raise ValueError(f"serialized_named_tensors ({len(payloads)} payloads) must hold one payload per engine "
                             "TP rank, and the embedded engine has tp_size 1")
        self.load_weights(deserialize_flattened_bucket(payloads[0]))
        if weight_version is not None:
            self.weight_version = weight_version

    def begin_weight_update(self) -> None:
        """Nothing to prepare: weights are plain tensors updated in place."""

    def end_weight_update(self) -> None:
        """Nothing to finalize (no packed or quantized weights to rebuild)."""

    def flush_cache(self) -> None:
        """No prefix cache survives a generate call, so there is nothing to flush."""

    def release_memory_occupation(self, tags: list[str]) -> None:
        """Bookkeeping only: CPU memory is not offloaded (the worker enforces the contract's rules)."""

    def resume_memory_occupation(self, tags: list[str]) -> None:
        """Bookkeeping only, as for release."""

    def shutdown(self) -> None:
        """Nothing to tear down beyond the process itself."""
