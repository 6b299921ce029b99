"""Top-p mask replay: the engine records each draw's kept set and reports the log-prob renormalised over it;
the trainer renormalises over the same set. Both against references computed from the kept-token set alone."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlrun.data.batch import collate
from rlrun.data.sample import Prompt, Sample
from rlrun.engine.kept_set import decode_kept_ids, encode_kept_rows
from rlrun.engine.sampling import SamplingParams, SamplingTensors, filter_probs, row_key, sample_tokens
from rlrun.megatron.token_stats import kept_set_logprobs
from rlrun.runtime.dist import free_port

VOCAB, PADDED, TEMPERATURE = 45, 50, 0.7


@pytest.fixture(scope="module")
def group():
    """A real one-rank gloo group: the function all-reduces over the TP group."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def reference(logits: torch.Tensor, targets: torch.Tensor, kept_ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(z / T) over the kept ids only (every other id masked out), at the target."""
    hits = torch.zeros(*logits.shape[:-1], VOCAB, dtype=torch.long)
    keep = hits.scatter_add_(-1, kept_ids.clamp(min=0), (kept_ids >= 0).long()) > 0  # -1 pads add nothing
    z = (logits[..., :VOCAB] / TEMPERATURE).masked_fill(~keep, float("-inf"))
    return torch.log_softmax(z, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def test_trainer_renormalises_over_the_kept_set_values_and_gradients(group):
    gen = torch.Generator().manual_seed(0)
    rows, tokens, width = 2, 7, 6
    logits = torch.randn(rows, tokens, PADDED, generator=gen) * 3
    kept_ids = torch.full((rows, tokens, width), -1)
    targets = torch.empty(rows, tokens, dtype=torch.long)
    for r in range(rows):
        for t in range(tokens):
            size = int(torch.randint(1, width + 1, (1,), generator=gen))
            ids = torch.randperm(VOCAB, generator=gen)[:size]
            kept_ids[r, t, :size] = ids
            targets[r, t] = ids[int(torch.randint(0, size, (1,), generator=gen))]
    ours_in, ref_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours = kept_set_logprobs(ours_in, targets, kept_ids, TEMPERATURE, 0, VOCAB, group)
    want = reference(ref_in, targets, kept_ids)
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-5)
    weights = torch.randn(rows, tokens, generator=gen)
    (ours * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=0, atol=1e-5)
    assert (ours_in.grad[..., VOCAB:] == 0).all()  # padded vocabulary entries get no gradient


def test_a_singleton_kept_set_gives_log_prob_zero(group):
    logits = torch.randn(1, 3, PADDED)
    kept = torch.tensor([[[4, -1], [9, -1], [0, -1]]])
    out = kept_set_logprobs(logits, kept[..., 0], kept, TEMPERATURE, 0, VOCAB, group)
    torch.testing.assert_close(out, torch.zeros(1, 3), rtol=0, atol=1e-6)


@pytest.mark.parametrize("params", [{"top_p": 0.6}, {"top_k": 3}, {"top_p": 0.9, "min_p": 0.05}])
def test_engine_records_the_kept_set_and_its_renormalised_log_prob(params):
    gen = torch.Generator().manual_seed(1)
    rows = 64
    logits = torch.randn(rows, VOCAB, generator=gen) * 2
    row_params = [SamplingParams(temperature=TEMPERATURE, sampling_seed=3, **params)] * rows
    tensors = SamplingTensors.of(row_params, [row_key(b) for b in range(rows)], VOCAB, torch.device("cpu"))
    kept_out = torch.empty(rows, VOCAB, dtype=torch.long)
    tokens, logprobs = sample_tokens(logits, tensors, torch.tensor([0]), kept_out)
    probs = torch.softmax(logits / TEMPERATURE, dim=-1)
    kept_probs = filter_probs(probs, row_params)  # the reference kept set: the filter's survivors
    for b in range(rows):
        ids = kept_out[b][kept_out[b] >= 0]
        assert set(ids.tolist()) == set(kept_probs[b].nonzero().flatten().tolist())
        assert int(tokens[b]) in ids.tolist()
        want = torch.log(probs[b, tokens[b]] / probs[b, ids].sum())
        torch.testing.assert_close(logprobs[b], want, rtol=0, atol=1e-5)


def test_rows_without_a_filter_record_no_kept_set_and_keep_full_log_probs():
    logits = torch.randn(2, VOCAB)
    rows = [
        SamplingParams(temperature=1.0, sampling_seed=1),
        SamplingParams(temperature=1.0, top_p=0.5, sampling_seed=1),
    ]
    tensors = SamplingTensors.of(rows, [1, 2], VOCAB, torch.device("cpu"))
    kept_out = torch.empty(2, 8, dtype=torch.long)
    tokens, logprobs = sample_tokens(logits, tensors, torch.tensor([0]), kept_out)
    assert (kept_out[0] == -1).all() and kept_out[1, 0] >= 0
    torch.testing.assert_close(logprobs[0], torch.log_softmax(logits[0], -1)[tokens[0]])


def test_each_rows_kept_sets_cross_the_wire_as_bytes_trimmed_to_its_own_width():
    import msgpack  # the engine's RPC frames (rlrun/engine/rpc.py)

    kept = torch.full((3, 5, 6), -1, dtype=torch.long)  # the engine's buffer: rows x tokens x kept width
    kept[0, :4, :3] = torch.arange(12).view(4, 3)
    kept[1, :2, 0] = torch.tensor([40, 41])
    kept[1, 3, :6] = 99  # past row 1's two tokens: not its response, so not its width either
    lengths = [4, 2, 0]  # row 2: a response aborted before its first token
    wires = encode_kept_rows(kept, lengths)
    assert [w["width"] for w in wires] == [3, 1, 1]
    frame = msgpack.unpackb(msgpack.packb({"r": wires}, use_bin_type=True), raw=False)["r"]
    assert all(isinstance(w["data"], bytes) for w in frame)
    for k, (wire, n) in enumerate(zip(frame, lengths, strict=True)):
        assert torch.equal(decode_kept_ids(wire, n), kept[k, :n, : wire["width"]].to(torch.int32))
    with pytest.raises(ValueError, match="must hold output tokens x width"):
        decode_kept_ids(frame[0], 5)


def test_kept_sets_travel_to_the_micro_batch_at_their_prediction_positions():
    kept = torch.tensor([[5, 6, -1, -1], [7, -1, -1, -1]], dtype=torch.int32)
    wire = encode_kept_rows(kept[None], [2])[0]
    assert wire["width"] == 2 and torch.equal(decode_kept_ids(wire, 2), kept[:, :2])
    prompt = Prompt(index=0, prompt_ids=[1, 2, 3], prompt_text="")
    with_set = Sample(0, prompt, [5, 7], "", [-0.1, -0.2], "stop", kept_ids=decode_kept_ids(wire, 2))
    without = Sample(0, prompt, [9], "", [-0.3], "stop")
    mb = collate([without, with_set], [1.0, 1.0], pad_token_id=0)
    # without: tokens 0..3 (prediction positions 0..2); with_set: tokens 4..8, its responses predicted at 6, 7
    assert mb.kept_ids.shape == (1, mb.tokens.shape[1] - 1, 2)
    assert mb.kept_ids[0, 6].tolist() == [5, 6] and mb.kept_ids[0, 7].tolist() == [7, -1]
    assert (mb.kept_ids[0, :6] == -1).all() and (mb.kept_ids[0, 8:] == -1).all()
    assert collate([without], [1.0], pad_token_id=0).kept_ids is None
