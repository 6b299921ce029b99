"""Megatron vs Hugging Face on tiny Llama (tied), Qwen2 (QKV bias) and Qwen3 (QK-norm) models, and on the
``FAMILY_KINDS`` of tests/tiny_models.py: Llama 3.1 RoPE with non-default parameters (untied), linear RoPE
(tied), Qwen2/Qwen3 YaRN, Mistral (explicit head_dim), each with 6 query heads in 3 groups (padded at TP=2).

References: HF transformers fp32 log-probs and entropies, and the safetensors on disk for the export
round trip. Each layout (TP=1, TP=2, PP=2: one layer per stage, the tied embedding split over the first
and last stage) runs once (one spawn) for all three families, and every rank must hold the results. At
TP=2 each ``FAMILY_KINDS`` model then takes one optimizer step (finite loss and gradient norm; the CLI run
of tests/integration/test_family_train_cli.py keeps one of these kinds end to end).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from dist_utils import run_distributed
from tiny_models import FAMILY_KINDS

KINDS = ("llama", "qwen2", "qwen3", *FAMILY_KINDS)
TEMPERATURE = 0.7
pytestmark = pytest.mark.slow


def _one_step(model, tokens: torch.Tensor) -> dict[str, float]:
    """One optimizer step on ``tokens``' rows as samples (4 prompt tokens, the rest the response)."""
    from rlrun.data.batch import collate
    from rlrun.data.sample import Prompt, Sample
    from rlrun.megatron import make_optimizer, train_step

    samples = [
        Sample(
            group_index=i,
            prompt=Prompt(index=i, prompt_ids=row[:4].tolist(), prompt_text=""),
            response_ids=row[4:].tolist(),
            response_text="",
            rollout_logprobs=[0.0] * (len(row) - 4),
            finish_reason="length",
        )
        for i, row in enumerate(tokens)
    ]
    mb = collate(samples, [(-1.0) ** i for i in range(len(samples))], pad_token_id=0)

    def loss_fn(batch, logprobs):
        loss = -(logprobs * batch.advantages * batch.loss_mask).sum()
        return loss, {"loss_sum": loss.detach()}

    optimizer = make_optimizer(model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, clip_grad=1.0)
    return train_step(model, optimizer, [mb], loss_fn, int(mb.loss_mask.sum()), TEMPERATURE)


def _export_sharing(model) -> dict:
    """What the export's two modes hand out against the live parameters: whether the views (``fresh=False``, the weight
    sync's) hold the fresh copies' values, and which tensors of each mode share a parameter's memory."""
    from rlrun.megatron import export_hf_weights

    params = {t.untyped_storage().data_ptr() for t in model.module.parameters()}
    fresh = dict(export_hf_weights(model))
    views = dict(export_hf_weights(model, fresh=False))
    return {
        "views_equal": sorted(n for n, t in views.items() if torch.equal(t, fresh[n])) == sorted(fresh),
        "fresh_shared": sorted(n for n, t in fresh.items() if t.untyped_storage().data_ptr() in params),
        "fresh_contiguous": all(t.is_contiguous() for t in fresh.values()),
        "views_shared": sorted(n for n, t in views.items() if t.untyped_storage().data_ptr() in params),
    }


def _parity_worker(model_dirs: dict[str, str], tp: int, tokens: torch.Tensor, pp: int = 1) -> dict:
    """Per family: log-probs, entropies and the exported HF weights of this rank (at TP=2, for the
    ``FAMILY_KINDS``, the metrics of one training step after them)."""
    from rlrun.megatron import build_model, compute_logprobs, compute_logprobs_and_entropy, export_hf_weights
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp=tp, pp=pp, seed=0)
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)  # CPU inputs: moved by the model
    out = {}
    for kind, hf_dir in model_dirs.items():
        model = build_model(hf_dir, parallel)
        with torch.no_grad():
            logprobs, entropy = compute_logprobs_and_entropy(model, tokens, position_ids, TEMPERATURE)
            plain = compute_logprobs(model, tokens, position_ids, TEMPERATURE)
        out[kind] = {
            "logprobs": logprobs.cpu(),
            "plain": plain.cpu(),
            "entropy": entropy.cpu(),
            "weights": {name: tensor.cpu() for name, tensor in export_hf_weights(model)},
            "sharing": _export_sharing(model),
        }
        if tp == 2 and kind in FAMILY_KINDS:
            out[kind]["step"] = _one_step(model, tokens)
    destroy_distributed()
    return out


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dirs, family_model_dirs) -> dict:
    return {**tiny_model_dirs, **family_model_dirs}


@pytest.fixture(scope="module")
def tokens(tiny_model_dirs) -> torch.Tensor:
    """Random ids over the whole HF vocabulary, so the last (padding-adjacent) ids are exercised."""
    vocab_size = json.loads((tiny_model_dirs["llama"] / "config.json").read_text())["vocab_size"]
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab_size, (3, 10), generator=generator)
    tokens[0, -1] = vocab_size - 1
    return tokens


@pytest.fixture(scope="module", params=[(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def megatron_run(request, model_dirs, tokens):
    tp, pp = request.param
    dirs = {kind: str(model_dirs[kind]) for kind in KINDS}
    return tp, run_distributed(_parity_worker, tp * pp, dirs, tp, tokens, pp, all_ranks=True)


def _hf_reference(hf_dir, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens).logits[:, :-1].float() / TEMPERATURE, dim=-1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_and_entropy_match_hf(kind, megatron_run, model_dirs, tokens):
    _, ranks = megatron_run
    ref_logprobs, ref_entropy = _hf_reference(model_dirs[kind], tokens)
    for result in ranks:
        got = result[kind]
        assert got["logprobs"].shape == (tokens.shape[0], tokens.shape[1] - 1)
        torch.testing.assert_close(got["logprobs"], ref_logprobs, rtol=0, atol=1e-5)
        torch.testing.assert_close(got["plain"], got["logprobs"], rtol=0, atol=0)
        torch.testing.assert_close(got["entropy"], ref_entropy, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_export_round_trips_exactly(kind, megatron_run, model_dirs):
    _, ranks = megatron_run
    on_disk = load_file(model_dirs[kind] / "model.safetensors")
    for result in ranks:
        exported = result[kind]["weights"]
        assert set(exported) == set(on_disk)
        for name, tensor in on_disk.items():
            assert exported[name].dtype == tensor.dtype, name
            assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("kind", KINDS)
def test_the_sync_export_views_the_live_weights_and_the_fresh_one_copies_them(kind, megatron_run):
    """The weight sync's export (``fresh=False``) hands out the parameters themselves where nothing is gathered (TP=1:
    the embedding, norms, MLP and output weights), so its bucket packing is their only copy; the default export's
    tensors never share a parameter's memory, so a caller may keep them across an update. Both hold the same values."""
    tp, ranks = megatron_run
    for result in ranks:
        sharing = result[kind]["sharing"]
        assert sharing["views_equal"]
        assert sharing["fresh_shared"] == [] and sharing["fresh_contiguous"]
        if tp == 1 and len(ranks) == 1:
            assert "model.embed_tokens.weight" in sharing["views_shared"]
            assert any(name.endswith("mlp.down_proj.weight") for name in sharing["views_shared"])
        elif tp == 2:  # every weight is gathered or (norms) copied whole: nothing to view
            assert not any(name.endswith("mlp.down_proj.weight") for name in sharing["views_shared"])


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_a_training_step_at_tp2_is_finite(kind, megatron_run):
    tp, ranks = megatron_run
    if tp != 2:
        pytest.skip("the training step runs in the TP=2 layout")
    for result in ranks:
        step = result[kind]["step"]
        assert math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0, step
    assert ranks[0][kind]["step"] == ranks[1][kind]["step"]  # train_step's metrics are the same on every rank


def _packed_pipeline_worker(hf_dir: str, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """PP=2 log-probs of ``first`` and ``second`` packed into one row (positions restart at the second)."""
    from rlrun.megatron import build_model, compute_logprobs
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp=1, pp=2, seed=0)
    model = build_model(hf_dir, parallel)
    tokens = torch.cat([first, second])[None]
    position_ids = torch.cat([torch.arange(len(first)), torch.arange(len(second))])[None]
    with torch.no_grad():
        logprobs = compute_logprobs(model, tokens, position_ids, TEMPERATURE).cpu()
    destroy_distributed()
    return logprobs


def test_packed_pipeline_logprobs_match_hf(tiny_model_dirs, tokens):
    """Two samples packed into one row at PP=2: the thd layout crosses the stage boundary intact."""
    first, second = tokens[0], tokens[1, :7]
    ranks = run_distributed(_packed_pipeline_worker, 2, str(tiny_model_dirs["llama"]), first, second, all_ranks=True)
    ref_first, _ = _hf_reference(tiny_model_dirs["llama"], first[None])
    ref_second, _ = _hf_reference(tiny_model_dirs["llama"], second[None])
    boundary = len(first) - 1  # predicts the second sample's first token from the first sample: not a target
    for got in ranks:
        torch.testing.assert_close(got[:, :boundary], ref_first, rtol=0, atol=1e-5)
        torch.testing.assert_close(got[:, boundary + 1 :], ref_second, rtol=0, atol=1e-5)
