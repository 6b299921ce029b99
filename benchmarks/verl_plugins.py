"""What benchmarks/verl_grpo.py loads into verl's processes: a packed-sequence attention, a vectorised
log-prob, a generic prompt builder, fixed-length SGLang responses, a shorter wait for the rollout and the
benchmark's reward.

verl_grpo.py names this module in ``VERL_USE_EXTERNAL_MODULES``, which makes ``import verl`` import it in every
process verl starts (its Ray workers inherit the variable), and in ``actor_rollout_ref.model.external_lib``.

Attention. verl's fast path for its FSDP trainer is ``use_remove_padding`` with ``flash_attention_2``: every
micro-batch is one packed row, and FlashAttention's varlen kernel attends within each sample (transformers
derives the sample bounds from ``position_ids`` restarting at 0). The ``flash-attn`` package has no wheel for
the GPU machine's torch 2.11 / CUDA 13 (PyPI ships only its source), and SDPA on a packed row attends under a
``[T, T]`` block-diagonal mask: all of ``T^2``, ~32x the work of 32 samples of 640 tokens. So importing this
module registers ``torch_packed_varlen`` with transformers' attention interfaces: the same FlashAttention-2
varlen kernel, as torch builds it in (``aten._flash_attention_forward``, with torch's flash backward; grouped
KV heads native), called once per layer with the bounds read off ``position_ids``. It is what rlrun's
``flash_varlen`` packed attention calls (rlrun/megatron/attention.py).

Log-probs. verl's trainer turns a packed row's logits ``[T, vocab]`` into log-probs with flash-attn's Triton
cross-entropy kernel (``verl.utils.torch_functional.logprobs_from_logits``). Without the flash-attn package it
falls back to ``logprobs_from_logits_v2``, which loops over the rows in Python: one ``log_softmax`` and
``gather`` per token, ~20k launches each way per micro-batch. On the H200 that fallback made verl's
``update_actor`` 16-20 s a step at 0.6B (2% MFU; 2026-12-02, before this patch). So the fallback is replaced by
what the flash-attn kernel computes: the label's log-softmax in fp32 (``cross_entropy`` on fp32 logits), in one
call.

Prompt tokens. verl's agent loop tokenizes prompts with a "Continuous Token" builder picked by the
config's ``model_type``; for ``qwen3`` it is the ChatML one, which needs ``<|im_end|>`` and a one-token
newline in the tokenizer (it inserts that newline between turns). The benchmark's word tokenizer has
neither, so ``qwen3`` is mapped to verl's generic builder, which renders the chat template and nothing
else: for one user turn (single-turn GRPO) the two give the same ids, here the prompt's 128 words.

Fixed length. verl's ``rollout.ignore_eos`` reaches its vLLM server's sampling parameters but not its SGLang
server's (verl 0.9.1, ``SGLangHttpServer.generate``), so SGLang would stop a response at the EOS id (about
once in 150k tokens of the random model: some steps would miss 512 x 128 tokens). The server class gets
the same default as the vLLM one the moment its module is imported, through an import hook, since Ray
re-imports the module in the server's own process.

Rollout wait. verl's sync trainer (v1, its default) starts a rollout and then polls its replay buffer until
every trajectory is in, sleeping ``poll_interval`` between looks: 2 s, a constructor default that no config key
reaches. So its ``gen`` phase is a whole number of polls (4.02 s in every timed step of the first H200 run,
2026-12-02, for a rollout that rlrun's SGLang engine does in 2.2 s): up to 2 s of each step is sleep, the same at
any model size. ``VERL_BENCH_REPLAY_POLL_S`` (verl_grpo.py's ``--replay-poll-s``) sets the interval of every
replay buffer the trainer builds; unset, verl's own.

Reward. ``compute_score`` is verl's custom reward hook; it gets the decoded response. The benchmark's
tokenizer maps id ``i`` to the word ``w<i>`` (rlrun.tools.bench.step.write_word_tokenizer), so the ids are read
back from the words and scored with rlrun's ``even_fraction``, the reward rlrun and TRL use. verl decodes
with ``skip_special_tokens``: sampled ids 0 and 1 (``<pad>``, ``<eos>``; 2 of 151936) are dropped.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

import torch

ATTENTION = "torch_packed_varlen"
"""The ``attn_implementation`` name verl_grpo.py sets (``actor_rollout_ref.model.override_config``); without
"flash" in it, since transformers takes any such name for a flash-attn package or hub kernel to import."""


_bounds_of: list = [None, None, 0]
"""The last row's ``[position_ids, cu_seqlens, max_len]``: every layer of one forward gets the same
``position_ids`` tensor, so the bounds (and the host sync their maximum costs) are found once per forward."""


def _sample_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` (int32, on the device) and the longest sample of one packed row whose positions restart
    at 0 for each sample (verl's ``use_remove_padding`` row)."""
    if _bounds_of[0] is not position_ids:
        positions = position_ids.reshape(-1)
        starts = torch.nonzero(positions == 0).reshape(-1)
        end = torch.tensor([positions.numel()], device=positions.device)
        bounds = torch.cat([starts, end]).to(torch.int32)
        _bounds_of[:] = [position_ids, bounds, int((bounds[1:] - bounds[:-1]).max())]
    return _bounds_of[1], _bounds_of[2]


def flash_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``[1, heads, T, dim]`` in, ``[1, T, heads, dim]`` out.
    Only packed rows (batch 1, no padding mask, ``position_ids`` given): what verl's trainer sends."""
    position_ids = kwargs.get("position_ids")
    if query.shape[0] != 1 or attention_mask is not None or position_ids is None:
        raise ValueError(
            f"attn_implementation {ATTENTION} needs one packed row with position_ids and no attention mask "
            f"(got batch {query.shape[0]}, mask {attention_mask is not None}) because it attends within the "
            "samples that position_ids bound; set actor_rollout_ref.model.use_remove_padding=True"
        )
    bounds, max_len = _sample_bounds(position_ids)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # the kernel's [T, heads, dim]
    out = causal_varlen(q, k, v, bounds, max_len, dropout if module.training else 0.0, scaling)
    return out.unsqueeze(0), None


def causal_varlen(q, k, v, bounds: torch.Tensor, max_len: int, dropout: float, scale: float | None) -> torch.Tensor:
    """FlashAttention-2's causal varlen kernel on ``[T, heads, dim]`` rows bounded by ``bounds`` (CUDA, bf16)."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, bounds, bounds, max_len, max_len, dropout, True, False, scale=scale
    )[0]


def logprobs_of_labels(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each label's log-probability under ``logits`` (``[..., vocab]``), in fp32 as flash-attn's cross-entropy
    kernel returns it."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return -torch.nn.functional.cross_entropy(flat, labels.reshape(-1), reduction="none").view(labels.shape)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(ATTENTION, flash_varlen_attention)
    # the mask FlashAttention gets: none for a packed row without padding
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, flash_attention_mask)

    from verl.utils.tokenizer import continuous_token_wiring as wiring

    wiring._MODEL_TYPE_TO_FAMILY["qwen3"] = wiring.ContinuousTokenModelFamily.DEFAULT

    from verl.utils import torch_functional

    if not torch_functional.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE:  # logprobs_from_logits looks the name up per call
        torch_functional.logprobs_from_logits_v2 = logprobs_of_labels

    for name, patch in AFTER_IMPORT.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


REPLAY_POLL_ENV = "VERL_BENCH_REPLAY_POLL_S"
"""Set by verl_grpo.py (its REPLAY_POLL_ENV, the same name): the seconds between the replay buffer's looks."""


def _poll_replay_buffer(module) -> None:
    """Every ``ReplayBuffer`` (and subclass) built afterwards polls every ``$VERL_BENCH_REPLAY_POLL_S`` seconds,
    read when it is built; unset, verl's interval stays."""
    buffer = module.ReplayBuffer
    init = buffer.__init__

    def init_with_poll(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seconds = os.environ.get(REPLAY_POLL_ENV)
        if seconds is not None:
            print(f"[verl_plugins] {type(self).__name__} polls every {seconds} s (verl's: {self.poll_interval} s)")
            self.poll_interval = float(seconds)

    buffer.__init__ = init_with_poll


def _pass_ignore_eos(module) -> None:
    """``SGLangHttpServer.generate`` with ``ignore_eos`` defaulting to ``rollout.ignore_eos``, as verl's vLLM
    server sets it."""
    server = module.SGLangHttpServer
    generate = server.generate

    async def generate_with_ignore_eos(self, prompt_ids, sampling_params, *args, **kwargs):
        sampling_params = {"ignore_eos": self.config.get("ignore_eos", False), **sampling_params}
        return await generate(self, prompt_ids, sampling_params, *args, **kwargs)

    server.generate = generate_with_ignore_eos


SGLANG_SERVER = "verl.workers.rollout.sglang_rollout.async_sglang_server"
REPLAY_BUFFER = "verl.trainer.ppo.v1.replay_buffer"
AFTER_IMPORT = {SGLANG_SERVER: _pass_ignore_eos, REPLAY_BUFFER: _poll_replay_buffer}
"""verl's modules this file patches, each with its patch, run right after the module executes (Ray re-imports
them in each worker process)."""


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs a module's patch from :data:`AFTER_IMPORT` right after the module is executed."""

    def find_spec(self, name, path, target=None):
        if name not in AFTER_IMPORT:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            AFTER_IMPORT[name](module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def compute_score(data_source, solution_str: str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's ``custom_reward_function`` signature: the fraction of even ids in the response."""
    from rlrun.tools.bench.step import even_fraction

    return even_fraction([int(word[1:]) for word in solution_str.split()])


_register()
