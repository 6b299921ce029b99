"""The batched sampler against the formulas it implements: counter-based uniform noise, draws that
follow softmax(logits / T) after top-k filtering, log-probs taken before filtering, greedy argmax."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from interpreted import needs_triton, run_interpreted
from rlrun.engine.sampling import SamplingParams, SamplingTensors, filter_probs, row_key, sample_tokens, uniform_noise

NUM_ROWS = 20_000


def test_uniform_noise_is_a_pure_uniform_function_of_key_and_step():
    keys = torch.tensor([row_key(k * 0x9E3779B97F4A7C15) for k in range(NUM_ROWS)])
    u = uniform_noise(keys, torch.tensor([3]))
    assert torch.equal(u, uniform_noise(keys.clone(), torch.tensor([3])))  # no hidden state
    assert torch.equal(u[5:9], uniform_noise(keys[5:9], torch.tensor([3])))  # independent of the batch
    assert not torch.equal(u, uniform_noise(keys, torch.tensor([4])))
    assert 0 <= u.min() and u.max() < 1
    counts = torch.histc(u, bins=10, min=0, max=1)
    expected = NUM_ROWS / 10
    assert ((counts - expected).abs() < 5 * expected**0.5).all()  # 5 sigma per bin
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]) < 0.03  # neighbouring keys unrelated


def _tensors(params: SamplingParams, vocab: int) -> SamplingTensors:
    keys = [row_key(params.sample_seed([7], j)) for j in range(NUM_ROWS)]
    return SamplingTensors.of([params] * NUM_ROWS, keys, vocab, torch.device("cpu"))


def test_draws_follow_the_filtered_tempered_softmax_and_logprobs_precede_filtering():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    temperature = 0.7
    tempered = torch.softmax(logits / temperature, dim=-1)
    for top_k, want in ((-1, tempered), (2, torch.cat([tempered[:2] / tempered[:2].sum(), torch.zeros(3)]))):
        params = SamplingParams(temperature=temperature, top_k=top_k, sampling_seed=5)
        tokens, logprobs = sample_tokens(logits.expand(NUM_ROWS, -1), _tensors(params, 5), torch.tensor([0]))
        freq = torch.bincount(tokens, minlength=5) / NUM_ROWS
        sigma = (want * (1 - want) / NUM_ROWS).sqrt()
        assert ((freq - want).abs() <= 5 * sigma + 1e-9).all(), (top_k, freq, want)
        torch.testing.assert_close(logprobs, torch.log(tempered)[tokens], rtol=0, atol=1e-6)


def test_greedy_rows_take_the_first_argmax_next_to_sampled_rows():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [0.0, 3.0, 3.0, 1.0]])
    rows = [SamplingParams.from_dict({"temperature": 0}), SamplingParams(temperature=1.0, sampling_seed=1)]
    tensors = SamplingTensors.of(rows, [1, 2], 4, torch.device("cpu"))
    assert (tensors.sample, tensors.filter) == (True, False)
    draws = {int(sample_tokens(logits, tensors, torch.tensor([s]))[0][0]) for s in range(50)}
    assert draws == {1}
    tokens, logprobs = sample_tokens(logits, tensors, torch.tensor([0]))
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1))


def test_a_row_draws_the_same_whatever_the_filters_of_the_other_rows():
    """An unfiltered row next to a top-p row draws what it draws alone, and a top-p row what it draws next to
    greedy rows only: the batch's static choices (``sample``, ``filter``) never change a row's draw."""
    logits = torch.randn(3, 600, generator=torch.Generator().manual_seed(0)) * 3
    plain, top_p = SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9, top_k=700)
    greedy = SamplingParams.from_dict({"temperature": 0})

    def draws(rows: list[SamplingParams], keys: list[int], index: list[int]) -> list[list[int]]:
        tensors = SamplingTensors.of(rows, keys, 600, torch.device("cpu"))
        return [sample_tokens(logits[index], tensors, torch.tensor([s]))[0].tolist() for s in range(200)]

    mixed = draws([plain, top_p, greedy], [11, 22, 33], [0, 1, 2])
    assert [d[0] for d in mixed] == [d[0] for d in draws([plain], [11], [0])]
    assert [d[1] for d in mixed] == [d[1] for d in draws([greedy, top_p], [33, 22], [2, 1])] and len(
        {d[1] for d in mixed}
    ) > 1
    kept = torch.empty(1, 512, dtype=torch.long)
    tensors = SamplingTensors.of([top_p], [22], 600, torch.device("cpu"))
    sample_tokens(logits[1:2], tensors, torch.tensor([0]), kept)
    probs = torch.softmax(logits[1] / 0.8, -1)
    survivors = filter_probs(probs[None], [top_p])[0].nonzero().flatten()
    assert set(kept[0][kept[0] >= 0].tolist()) == set(survivors.tolist())  # top-k 700 is capped at 512


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_decode_steps_sampler_shortcuts_are_bitwise_the_paths_they_replace(device):
    """bf16 logits straight into the temperature division against a ``.float()`` copy first, the tabulated noise
    (``DecodeBatch.noise``) against hashing it per step, and no full-vocabulary draw (every drawing row filters)
    against computing it: same tokens, log-probs and kept sets, bitwise."""
    vocab, rows = 4096, 48
    filtering = SamplingParams(temperature=1.0, top_p=0.95, sampling_seed=1)
    params = [filtering if b % 3 else SamplingParams(top_k=1) for b in range(rows)]  # filtering and greedy rows
    keys = torch.tensor([row_key(filtering.sample_seed([b], 0)) for b in range(rows)], device=device)
    tensors = SamplingTensors.of(params, keys.tolist(), vocab, torch.device(device))
    assert tensors.filter and not tensors.unfiltered
    logits = (3 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))).bfloat16().to(device)
    step = torch.arange(rows, device=device) % 5
    table = uniform_noise(keys[:, None], torch.arange(8, device=device)[None])
    assert torch.equal(table[torch.arange(rows, device=device), step], uniform_noise(keys, step))
    kept_new, kept_old = (torch.empty(rows, 512, dtype=torch.long, device=device) for _ in range(2))
    new = sample_tokens(logits, tensors, step, kept_new, table[torch.arange(rows, device=device), step])
    old = sample_tokens(logits.float(), dataclasses.replace(tensors, unfiltered=True), step, kept_old)
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1]) and torch.equal(kept_new, kept_old)
    assert new[1].dtype == torch.float32 and len(set(new[0].tolist())) > 10  # draws, not one token


@needs_triton
def test_the_greedy_kernel_under_tritons_interpreter():
    """The all-greedy decode step's one launch (on CUDA: tests/gpu/test_triton_kernels_gpu.py)."""
    run_interpreted("greedy_kernel_interpreted.py")
