"""Streaming rounds: one engine call per group, the batch closed as soon as enough groups are kept.

Used when ``rollout.abort_surplus`` or ``rollout.partial_rollout`` is on (single-turn generation,
``engine.tp`` 1). Within a round every rank sends one generate call per group from a thread (the
embedded engine merges calls that arrive together into one decode batch and answers each call when its
own rows are done; SGLang batches them continuously), scores each group as it finishes, and all ranks
meet every ``TICK_S``::

    every rank:  finished groups since the last tick, and how many are still generating ──gather──> rank 0
    rank 0:      filter them; kept >= prompts_per_step -> "abort"; nothing generating -> "end"; else "go"
    every rank:  "abort": engine.abort(abort_all) and wait for the in-flight calls to return their partial
                 output; then the last finished groups and the aborted ones ──gather──> rank 0

Aborted groups are discarded (``abort_surplus``) or carried into the next step (``partial_rollout``):
their finished samples stay, the unfinished ones continue from prompt + the tokens they have, with the
room left of ``max_new_tokens``, under whatever weights the engine then holds (slime's
``--partial-rollout``). A continued sample records its tokens per weight version (``Sample.weight_spans``).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from rlrun.config.schema import RolloutConfig
from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.driver import _kept_ids, _routed_experts, generate_samples, sampling_params

if TYPE_CHECKING:
    from rlrun.rollout.tally import RoundTally

TICK_S = 0.05
"""How often the ranks meet while groups generate (one small gather and scatter of control data)."""
_CONTINUE_SEED_STRIDE = 1_000_003


@dataclass
class GroupJob:
    """One group to generate on a rank: a fresh prompt, or a group carried from the last step."""

    prompt: Prompt
    carried: list[Sample] | None = None
    """The carried group's samples (finished ones and aborted partial ones); None for a fresh prompt."""


@dataclass
class GroupOutcome:
    """A group as it came back from the engine: all samples finished, or some aborted (partial)."""

    samples: list[Sample]
    aborted: bool


def is_unfinished(sample: Sample) -> bool:
    return sample.finish_reason == "abort"


def continue_samples(
    engine, job: GroupJob, r: RolloutConfig, seed: int, tokenizer, rid: str
) -> tuple[list[Sample], bool]:
    """The carried group with its unfinished samples continued from prompt + their tokens so far."""
    samples = continue_unfinished(engine, job.carried, r, seed, tokenizer, rid)
    return samples, any(is_unfinished(s) for s in samples)


def continue_unfinished(
    engine, samples: list[Sample], r: RolloutConfig, seed: int, tokenizer, rid: str
) -> list[Sample]:
    """``samples`` with the unfinished ones (finish_reason "abort") continued from prompt + their tokens so far,
    with the room left of ``max_new_tokens``, in one engine call (sample k seeded from ``seed`` and k); used by
    partial rollout's carried groups and by rollouts continued across a weight update (rlrun/rollout/segments.py)."""
    todo = [k for k, s in enumerate(samples) if is_unfinished(s)]
    base = sampling_params(r, seed)
    inputs, params = [], []
    for k in todo:
        old = samples[k]
        room = r.max_new_tokens - len(old.response_ids)
        inputs.append(old.prompt.prompt_ids + old.response_ids)
        params.append(
            {**base, "n": 1, "max_new_tokens": max(room, 1), "sampling_seed": seed + _CONTINUE_SEED_STRIDE * k}
        )
    results = engine.generate(inputs, params, return_logprob=True, rids=[f"{rid}-c{k}" for k in todo]) if todo else []
    out = list(samples)
    for k, result in zip(todo, results, strict=True):
        out[k] = _extend(samples[k], result, tokenizer, r.skip_special_tokens)
    return out


def _extend(old: Sample, result: dict, tokenizer, skip_special_tokens: bool) -> Sample:
    new_ids = list(result["output_ids"])
    version = str(result.get("weight_version", ""))
    spans = list(old.weight_spans or [(old.weight_version, len(old.response_ids))])
    spans = [(v, n) for v, n in spans if n] + ([(version, len(new_ids))] if new_ids else [])
    response_ids = old.response_ids + new_ids
    return Sample(
        group_index=old.group_index,
        prompt=old.prompt,
        response_ids=response_ids,
        response_text=tokenizer.decode(response_ids, skip_special_tokens=skip_special_tokens),
        rollout_logprobs=old.rollout_logprobs + list(result["output_logprobs"]),
        finish_reason=result["finish_reason"]["type"],
        weight_version=version,
        carried_tokens=len(old.response_ids),
        weight_spans=spans if len({v for v, _ in spans}) > 1 or old.carried_tokens else None,
        # The continuation's prefill re-routed prompt + carried tokens: its experts cover the whole sequence.
        routed_experts=_routed_experts(result, len(old.prompt.prompt_ids) + len(old.response_ids)),
        kept_ids=_concat_kept(old.kept_ids, _kept_ids(result), len(old.response_ids)),
    )


def _concat_kept(old, new, num_old: int):
    """Top-p kept sets of the carried tokens then the continuation's (-1 padded to one width)."""
    if old is None or new is None:
        return new if num_old == 0 else None  # a filter-free call on either side: no replay for the sample
    import torch

    width = max(old.shape[1], new.shape[1])
    pad = [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in (old, new)]
    return torch.cat(pad)


def carry_to_state(carry: list[list[Sample]]) -> list[list[dict]]:
    """The carried groups as plain data (dicts of lists, strings, numbers and tensors): a checkpoint
    loads it with ``torch.load(weights_only=True)``, never unpickling a class."""
    return [[dataclasses.asdict(s) for s in group] for group in carry]


def carry_from_state(state: list[list[dict]]) -> list[list[Sample]]:
    """The inverse of :func:`carry_to_state`."""
    return [[Sample.from_dict(row) for row in group] for group in state]


class GroupStream:
    """One rank's share of a streaming round: a thread per group, finished groups queued as they come."""

    def __init__(self, engine, r: RolloutConfig, seed: int, tokenizer, score: Callable[[list[Sample]], None]) -> None:
        self.engine = engine
        self.done: queue.Queue[GroupOutcome] = queue.Queue()
        self.num_open = 0
        """Groups started and not yet back (finished, aborted or failed)."""
        self.error: str | None = None
        """The first group failure (engine or reward), as a message; the round then fails on every rank."""
        self._start = (r, seed, tokenizer, score)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def add(self, jobs: list[GroupJob]) -> None:
        """Start generating ``jobs``, one thread (and engine call) per group."""
        with self._lock:
            self.num_open += len(jobs)
        for job in jobs:
            k = len(self._threads)
            rid = f"g{job.prompt.index}-{k}"
            thread = threading.Thread(target=self._run, args=(job, *self._start, rid), name=f"rollout-{rid}")
            thread.start()
            self._threads.append(thread)

    def _run(self, job: GroupJob, r: RolloutConfig, seed: int, tokenizer, score, rid: str) -> None:
        try:
            if job.carried is None:
                samples = generate_samples(self.engine, [job.prompt], r, seed, tokenizer, rid=rid)
                aborted = any(is_unfinished(s) for s in samples)
            else:
                samples, aborted = continue_samples(self.engine, job, r, seed, tokenizer, rid)
            if not aborted:
                score(samples)
        except BaseException as exc:  # noqa: BLE001 - handed to every rank at the next tick, which all raise
            self.error = f"group of prompt {job.prompt.index}: {type(exc).__name__}: {exc}"
        else:
            self.done.put(GroupOutcome(samples, aborted))
        finally:
            with self._lock:
                self.num_open -= 1

    def take_done(self, wait_s: float) -> list[GroupOutcome]:
        """The groups finished since the last call, after waiting up to ``wait_s`` for the first one."""
        out = []
        try:
            out.append(self.done.get(timeout=wait_s))
        except queue.Empty:
            pass
        while True:
            try:
                out.append(self.done.get_nowait())
            except queue.Empty:
                return out

    def abort_and_drain(self) -> tuple[list[GroupOutcome], float]:
        """Abort everything in flight, wait for every call to return; (what is left, seconds waited)."""
        start = time.perf_counter()
        # An abort flags only the requests the engine holds: a call whose request arrives after it (its
        # thread was slow to start) would run to its end. So abort again at every tick until all returned.
        for thread in self._threads:
            while thread.is_alive():
                self.engine.abort(abort_all=True)
                thread.join(TICK_S)
        return self.take_done(0), time.perf_counter() - start

    def close(self) -> None:
        """Wait for every group's thread (failures travel as ``error``, so every rank raises together)."""
        for thread in self._threads:
            thread.join()


def partial_rollout_metrics(
    tally: RoundTally, samples: list[Sample], carry: list[list[Sample]], partial: bool
) -> dict[str, float]:
    """Streaming rounds' metrics (docs/metrics.md): aborts, the carry and the batch's staleness."""
    staleness = [_version_number(s.weight_version) - _version_number(s.first_weight_version) for s in samples]
    carried_out = [s for g in carry for s in g]
    metrics = {
        "rollout/aborted_groups": len(tally.aborted),
        "rollout/aborted_tokens": sum(len(s.response_ids) for g in tally.aborted for s in g),
        "rollout/abort_wait_s": tally.abort_wait_s,
    }
    if partial:
        metrics.update(
            {
                "rollout/carried_groups": len(carry),
                "rollout/carried_partial_samples": sum(s.finish_reason == "abort" for s in carried_out),
                "rollout/carried_samples": sum(s.carried_tokens > 0 for s in samples),
                "rollout/tokens_saved": sum(s.carried_tokens for s in samples),
                "rollout/staleness_mean": sum(staleness) / max(len(staleness), 1),
                "rollout/staleness_max": max(staleness, default=0),
            }
        )
    return metrics


def _version_number(version: str) -> int:
    """Weight versions are sync counts; the engine's initial ``default`` is 0."""
    return int(version) if version.isdigit() else 0


def mask_older_weights(sample: Sample) -> int:
    """Zero the loss mask of the response tokens generated by older weights than the sample's last tokens
    (``rollout.partial_rollout_mask_offpolicy``); returns how many were masked."""
    if not sample.weight_spans:
        return 0
    mask = list(sample.loss_mask or [1] * len(sample.response_ids))
    start = masked = 0
    for version, num_tokens in sample.weight_spans:
        if version != sample.weight_version:
            masked += sum(mask[start : start + num_tokens])
            mask[start : start + num_tokens] = [0] * num_tokens
        start += num_tokens
    sample.loss_mask = mask
    return masked
