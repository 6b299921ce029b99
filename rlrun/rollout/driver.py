"""Generate one step's responses on this rank's engine and score them.

Rank 0 assigns whole groups (a prompt and its ``samples_per_prompt`` responses) to ranks, so group
statistics (GRPO advantages) can be computed from gathered groups without ever merging partial ones.
"""

from __future__ import annotations

from typing import Callable

from rlrun.agents.runner import model_name as served_name
from rlrun.agents.runner import run_agents
from rlrun.config.schema import RolloutConfig
from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.multiturn import run_generate_fn


def split_groups(prompts: list[Prompt], num_ranks: int) -> list[list[Prompt]]:
    """Contiguous, near-equal chunks of prompts, one per rank (a rank may get none)."""
    base, extra = divmod(len(prompts), num_ranks)
    chunks, start = [], 0
    for rank in range(num_ranks):
        end = start + base + (1 if rank < extra else 0)
        chunks.append(prompts[start:end])
        start = end
    return chunks


def sampling_params(cfg: RolloutConfig, seed: int) -> dict:
    """The engine-contract sampling params for one step (``sampling_seed`` makes it reproducible)."""
    return {
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "n": cfg.samples_per_prompt,
        "sampling_seed": seed,
        "ignore_eos": cfg.ignore_eos,
        **stop_params(cfg.stop, cfg.stop_token_ids),
    }


def stop_params(stop: list[str] | None, stop_token_ids: list[int] | None) -> dict:
    """The engine's ``stop`` / ``stop_token_ids`` entries, only when set (an unset key keeps the engine's
    default, so a backend or fake without stop support sees the params it always saw)."""
    out: dict = {}
    if stop:
        out["stop"] = list(stop)
    if stop_token_ids:
        out["stop_token_ids"] = list(stop_token_ids)
    return out


def generate_samples(
    engine,
    prompts: list[Prompt],
    cfg: RolloutConfig,
    seed: int,
    tokenizer,
    generate_fn: Callable | None = None,
    max_context_tokens: int | None = None,
    rid: str | None = None,
    agent: Callable | None = None,
    model_name: str = "policy",
) -> list[Sample]:
    """``samples_per_prompt`` responses per prompt, prompt-major: one engine call (its rids prefixed ``rid``
    when given), or the custom multi-turn ``generate_fn`` (:mod:`rlrun.rollout.multiturn`, trajectories
    capped at ``max_context_tokens``) when ``rollout.generate_fn`` is set, or ``samples_per_prompt`` runs of
    ``rollout.agent`` per prompt on an OpenAI-compatible endpoint (:mod:`rlrun.agents.runner`, its model called
    ``model_name``'s directory name)."""
    if not prompts:
        return []
    n = cfg.samples_per_prompt
    if agent is not None:
        sampling = sampling_params(cfg, seed)
        return run_agents(
            agent, engine, prompts, cfg, sampling, seed, tokenizer, max_context_tokens, served_name(model_name)
        )
    if generate_fn is not None:
        return run_generate_fn(
            generate_fn,
            engine,
            prompts,
            n,
            sampling_params(cfg, seed),
            seed,
            tokenizer,
            max_context_tokens,
            skip_special_tokens=cfg.skip_special_tokens,
        )
    rids = {"rids": [f"{rid}-{i}" for i in range(len(prompts))]} if rid else {}  # abortable by the prefix
    results = engine.generate([p.prompt_ids for p in prompts], sampling_params(cfg, seed), return_logprob=True, **rids)
    if len(results) != len(prompts) * n:
        raise RuntimeError(f"engine returned {len(results)} results for {len(prompts)} prompts x n={n}")
    samples = []
    for i, result in enumerate(results):
        prompt = prompts[i // n]
        samples.append(
            Sample(
                group_index=prompt.index,
                prompt=prompt,
                response_ids=list(result["output_ids"]),
                response_text=tokenizer.decode(result["output_ids"], skip_special_tokens=cfg.skip_special_tokens),
                rollout_logprobs=list(result["output_logprobs"]),
                finish_reason=result["finish_reason"]["type"],
                weight_version=str(result.get("weight_version", "")),
                routed_experts=_routed_experts(result, len(prompt.prompt_ids)),
                kept_ids=_kept_ids(result),
            )
        )
    return samples


def _kept_ids(result):
    """The sample's ``[response_len, width]`` kept sets (``Sample.kept_ids``), or None."""
    if "kept_ids" not in result:
        return None
    from rlrun.engine.kept_set import decode_kept_ids

    return decode_kept_ids(result["kept_ids"], len(result["output_ids"]))


def _routed_experts(result, prompt_len: int):
    """The sample's ``[total_length, layers, topk]`` expert ids (``Sample.routed_experts``: the engine's
    ``total_length - 1`` rows, the last repeated for the never-forwarded last token), or None."""
    if "routed_experts" not in result:
        return None
    import torch

    from rlrun.engine.embedded.routing_record import decode

    experts = decode(result["routed_experts"], prompt_len + len(result["output_ids"]))
    return torch.cat([experts, experts[-1:]])


def group_samples(samples: list[Sample], group_size: int) -> list[list[Sample]]:
    """Split a prompt-major sample list into its groups, checking each group is whole."""
    if len(samples) % group_size:
        raise RuntimeError(f"{len(samples)} samples do not form whole groups of {group_size}")
    groups = [samples[i : i + group_size] for i in range(0, len(samples), group_size)]
    for group in groups:
        if len({s.group_index for s in group}) != 1:
            raise RuntimeError("a group mixes samples of different prompts; rollout order was broken")
    return groups
