"""TP=2 on models with 3 key/value groups x 3 query heads (SmolLM2's layout), which need inert head padding.

References: HF transformers fp32 log-probs, the safetensors on disk (export round trip), and the same
two optimizer steps at TP=1, where 3 groups need no padding. The inert groups' Megatron parameters are
checked to be exactly zero after both steps, with weight decay on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_megatron_train import OPTIM, MicroBatch, make_batch, pg_loss

from dist_utils import run_distributed

KINDS = ("llama", "qwen2", "qwen3")  # tied embeddings, QKV bias, QK-norm
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 8
TEMPERATURE = 0.8
WEIGHT_ATOL = 1e-5
"""1% of one Adam step (lr 1e-3): a weight whose gradient is near Adam's eps (1e-6) moves by lr * g / (|g| + eps),
which turns TP=1 vs TP=2 rounding of g into a few 1e-6 here; a wrong gradient moves weights by ~lr."""
pytestmark = pytest.mark.slow


def _make_model(kind: str, out_dir: Path) -> Path:
    """A tiny random model of ``kind`` with 9 heads in 3 groups, every parameter perturbed away from 0 and 1."""
    from tiny_models import make_tiny_model

    overrides = {
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_size": NUM_HEADS * HEAD_DIM,
    }
    return make_tiny_model(kind, out_dir, tie=kind == "llama", seed=1, config_overrides=overrides)


def _gather_attention(model) -> dict[str, torch.Tensor]:
    """The full (all TP shards, padding included) Megatron q/k/v and o_proj tensors of every layer."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from rlrun.megatron.tp_layout import Partition

    full = {}
    for name, param in model.module.named_parameters():
        if "linear_qkv" in name or "linear_proj" in name:
            shards = [torch.empty_like(param) for _ in range(model.parallel.tp_size)]
            dist.all_gather(shards, param.detach().contiguous(), group=mpu.get_tensor_model_parallel_group())
            full[name] = Partition.of(param).unshard(shards).cpu()
    return full


def _padded_worker(model_dirs: dict[str, str], tp: int, tokens: torch.Tensor, batch: MicroBatch) -> dict:
    """Per family: log-probs, exported weights, then two train steps on the whole batch (DP=1)."""
    from rlrun.megatron import build_model, compute_logprobs, export_hf_weights, make_optimizer, train_step
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp=tp, pp=1, seed=0)
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    num_tokens = int(batch.loss_mask.sum())
    out = {}
    for kind, hf_dir in model_dirs.items():
        model = build_model(hf_dir, parallel)
        with torch.no_grad():
            logprobs = compute_logprobs(model, tokens, position_ids, TEMPERATURE).cpu()
        result = {"logprobs": logprobs, "steps": [], "weights": [{k: v.cpu() for k, v in export_hf_weights(model)}]}
        optimizer = make_optimizer(model, **OPTIM)
        for _ in range(2):
            result["steps"].append(train_step(model, optimizer, [batch], pg_loss, num_tokens, TEMPERATURE))
            result["weights"].append({k: v.cpu() for k, v in export_hf_weights(model)})
        result["attention"] = _gather_attention(model)
        out[kind] = result
    destroy_distributed()
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("padded_heads")
    return {kind: str(_make_model(kind, root / kind)) for kind in KINDS}


@pytest.fixture(scope="module")
def tokens(model_dirs) -> torch.Tensor:
    from rlrun.megatron.hf_config import ModelArch

    vocab_size = ModelArch.from_hf_dir(model_dirs["llama"]).vocab_size
    tokens = torch.randint(0, vocab_size, (3, 10), generator=torch.Generator().manual_seed(5))
    tokens[0, -1] = vocab_size - 1
    return tokens


@pytest.fixture(scope="module")
def batch(model_dirs) -> MicroBatch:
    from rlrun.megatron.hf_config import ModelArch

    return make_batch(ModelArch.from_hf_dir(model_dirs["llama"]).vocab_size)


@pytest.fixture(scope="module")
def tp1(model_dirs, tokens, batch) -> dict:
    return run_distributed(_padded_worker, 1, model_dirs, 1, tokens, batch)


@pytest.fixture(scope="module")
def tp2(model_dirs, tokens, batch) -> list[dict]:
    return run_distributed(_padded_worker, 2, model_dirs, 2, tokens, batch, all_ranks=True)


@pytest.mark.parametrize("kind", KINDS)
def test_padded_logprobs_match_hf(kind, tp2, model_dirs, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs[kind], dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens).logits[:, :-1] / TEMPERATURE, dim=-1)
    reference = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    for rank_result in tp2:
        torch.testing.assert_close(rank_result[kind]["logprobs"], reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_padded_export_round_trips_exactly(kind, tp2, model_dirs):
    on_disk = load_file(Path(model_dirs[kind]) / "model.safetensors")
    for rank_result in tp2:
        exported = rank_result[kind]["weights"][0]
        assert set(exported) == set(on_disk)
        for name, tensor in on_disk.items():
            assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("kind", KINDS)
def test_padded_tp2_steps_match_unpadded_tp1(kind, tp1, tp2):
    want = tp1[kind]
    for rank_result in tp2:
        got = rank_result[kind]
        for step, (got_stats, want_stats) in enumerate(zip(got["steps"], want["steps"], strict=True)):
            for key, value in want_stats.items():
                assert got_stats[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
        for got_weights, want_weights in zip(got["weights"][1:], want["weights"][1:], strict=True):
            assert set(got_weights) == set(want_weights)
            for name, tensor in want_weights.items():
                torch.testing.assert_close(got_weights[name], tensor, rtol=0, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_inert_heads_stay_exactly_zero_after_two_steps(kind, tp1, tp2):
    """Megatron's layout at TP=2: 4 groups of [3 q heads, k, v] rows (the 4th inert), o_proj columns in q
    head order (heads 9..11 inert). TP=1 has exactly the HF shapes (no padding)."""
    rows_per_group = (NUM_HEADS // NUM_KV_HEADS + 2) * HEAD_DIM
    for name, tensor in tp1[kind]["attention"].items():
        dim = 1 if "linear_proj" in name else 0
        assert tensor.shape[dim] == (NUM_HEADS * HEAD_DIM if dim else NUM_KV_HEADS * rows_per_group), name
    for rank_result in tp2:
        attention = rank_result[kind]["attention"]
        assert any(name.endswith("linear_qkv.bias") for name in attention) == (kind == "qwen2")
        for name, tensor in attention.items():
            if "linear_proj" in name:
                real, inert = tensor[:, : NUM_HEADS * HEAD_DIM], tensor[:, NUM_HEADS * HEAD_DIM :]
                assert inert.shape[1] == 3 * HEAD_DIM, name
            else:
                real, inert = tensor[: NUM_KV_HEADS * rows_per_group], tensor[NUM_KV_HEADS * rows_per_group :]
                assert inert.shape[0] == rows_per_group, name
            assert torch.count_nonzero(inert) == 0, name
            torch.testing.assert_close(real, tp1[kind]["attention"][name], rtol=0, atol=WEIGHT_ATOL, msg=name)
