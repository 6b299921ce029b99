"""Megatron vs Hugging Face on tiny random Qwen3-MoE (4 experts, top-2, QK-norm), Qwen2-MoE (QKV bias, a
gated shared expert) and GLM-4.5 MoE (sigmoid routing with a correction bias and scaling factor, an ungated
shared expert, a dense first layer, partial rotary, QKV bias, QK-norm; plain and group-limited routing) and
DeepSeek-V3 (multi-latent attention with interleaved YaRN RoPE, or without a query latent and with half-split
RoPE as ``deepseek_v3_lite``; GLM's router with groups) models, fp32.

References: HF transformers' log-probs and entropies, and the safetensors on disk for the export round
trip. Layouts: EP=1 (one rank), EP=2 (two ranks, two experts each, the all-gather token dispatcher),
expert-TP=2 (every expert's weights split over two ranks) and PP=2 (one MoE layer per stage). TP > 1 is
refused for MoE models (see ``moe_config_kwargs``). Each layout runs once (one spawn) for both families
and every rank must hold the results. Conversion: ``rlrun convert`` hf -> mcore -> hf, and a Megatron
checkpoint saved at EP=2 loaded at EP=1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dist_utils import run_distributed

TEMPERATURE = 0.7
KINDS = (
    "qwen3_moe",
    "qwen2_moe",
    "qwen3_moe_dense0",
    "glm4_moe",
    "glm4_moe_grouped",
    "deepseek_v3",
    "deepseek_v3_lite",
)
"""``qwen3_moe_dense0``: layer 0 a dense MLP (``mlp_only_layers: [0]``), layer 1 MoE. ``glm4_moe``: layer 0
dense (``first_k_dense_replace: 1``); ``glm4_moe_grouped``: the same with 8 experts in 4 groups, top-4 from
the best 2 groups. ``deepseek_v3``: layer 0 dense, 8 experts in 4 groups, top-4 from the best 2;
``deepseek_v3_lite``: the same with ``q_lora_rank: null`` (Moonlight) and ``rope_interleave: false``."""
NUM_EXPERTS = {"glm4_moe_grouped": 8, "deepseek_v3": 8, "deepseek_v3_lite": 8}
"""Routed experts per MoE layer where not 4."""
GROUPED = {"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4}
LITE = {"q_lora_rank": None, "rope_interleave": False}
LAYOUTS = {"ep1": (1, 1, 1, 1), "ep2": (1, 2, 1, 1), "etp2": (1, 1, 2, 1), "pp2": (1, 1, 1, 2)}  # (tp, ep, etp, pp)
pytestmark = pytest.mark.slow


def _parity_worker(hf_dirs: dict[str, str], tp: int, ep: int, etp: int, pp: int, tokens: torch.Tensor) -> dict:
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp=tp, pp=pp, seed=0, ep=ep, etp=etp)
    out = {kind: _family_results(hf_dir, parallel, tokens) for kind, hf_dir in hf_dirs.items()}
    destroy_distributed()
    return out


def _family_results(hf_dir: str, parallel, tokens: torch.Tensor) -> dict:
    from rlrun.megatron import build_model, compute_logprobs_and_entropy, export_hf_weights

    model = build_model(hf_dir, parallel)
    params = dict(model.module.named_parameters())
    local_experts = sum(".local_experts." in name for name in params)
    fc1_rows = {
        int(name.split(".")[2]): param.shape[0]
        for name, param in params.items()
        if name.endswith("local_experts.0.linear_fc1.weight")
    }  # per local layer with experts
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        logprobs, entropy = compute_logprobs_and_entropy(model, tokens, position_ids, TEMPERATURE)
    weights = {name: tensor.cpu() for name, tensor in export_hf_weights(model)}
    return {
        "logprobs": logprobs.cpu(),
        "entropy": entropy.cpu(),
        "weights": weights,
        "local_expert_params": local_experts,
        "fc1_rows": fc1_rows,
    }


@pytest.fixture(scope="module")
def tokens(tiny_moe_dir) -> torch.Tensor:
    vocab_size = json.loads((tiny_moe_dir / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, vocab_size, (3, 12), generator=torch.Generator().manual_seed(5))
    tokens[0, -1] = vocab_size - 1
    return tokens


@pytest.fixture(scope="module")
def moe_dirs(tiny_moe_dir, tmp_path_factory) -> dict[str, Path]:
    from tiny_models import make_tiny_model

    return {
        "qwen3_moe": tiny_moe_dir,
        "qwen2_moe": make_tiny_model("qwen2_moe", tmp_path_factory.mktemp("qwen2_moe")),
        "qwen3_moe_dense0": make_tiny_model(
            "qwen3_moe", tmp_path_factory.mktemp("dense0"), config_overrides={"mlp_only_layers": [0]}
        ),
        "glm4_moe": make_tiny_model("glm4_moe", tmp_path_factory.mktemp("glm4_moe")),
        "glm4_moe_grouped": make_tiny_model(
            "glm4_moe", tmp_path_factory.mktemp("glm4_grouped"), config_overrides=GROUPED
        ),
        "deepseek_v3": make_tiny_model("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3")),
        "deepseek_v3_lite": make_tiny_model("deepseek_v3", tmp_path_factory.mktemp("ds_lite"), config_overrides=LITE),
    }


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=list(LAYOUTS))
def megatron_run(request, moe_dirs, tokens):
    tp, ep, etp, pp = LAYOUTS[request.param]
    dirs = {kind: str(path) for kind, path in moe_dirs.items()}
    return request.param, run_distributed(
        _parity_worker, max(tp, ep, etp) * pp, dirs, tp, ep, etp, pp, tokens, all_ranks=True
    )


def _hf_reference(hf_dir: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens).logits[:, :-1].float() / TEMPERATURE, dim=-1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_and_entropy_match_hf(kind, megatron_run, moe_dirs, tokens):
    layout, ranks = megatron_run
    ref_logprobs, ref_entropy = _hf_reference(moe_dirs[kind], tokens)
    _, ep, etp, pp = LAYOUTS[layout]
    sparse = [kind in ("qwen3_moe", "qwen2_moe") or layer == 1 for layer in range(2)]
    num_experts = NUM_EXPERTS.get(kind, 4)
    for rank, result in enumerate(rank[kind] for rank in ranks):
        stage = sparse[rank // (len(ranks) // pp) * (2 // pp) :][: 2 // pp]  # this rank's layers
        assert sorted(result["fc1_rows"]) == [local for local, moe in enumerate(stage) if moe]
        assert result["local_expert_params"] == sum(stage) * 2 * (num_experts // ep)  # layers x (fc1, fc2) x experts
        assert set(result["fc1_rows"].values()) <= {2 * 32 // etp}  # [gate; up] of moe_intermediate_size / etp
        torch.testing.assert_close(result["logprobs"], ref_logprobs, rtol=0, atol=1e-4)
        torch.testing.assert_close(result["entropy"], ref_entropy, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_export_round_trips_exactly(kind, megatron_run, moe_dirs):
    _, ranks = megatron_run
    on_disk = load_file(moe_dirs[kind] / "model.safetensors")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in on_disk  # the per-expert layout
    for result in ranks:
        exported = result[kind]["weights"]
        assert list(exported) == [name for name in exported if name in on_disk] and set(exported) == set(on_disk)
        for name, tensor in on_disk.items():
            assert exported[name].dtype == tensor.dtype, name
            assert torch.equal(exported[name], tensor), name


def _convert_worker(hf_dir: str, out_root: str) -> None:
    from pathlib import Path

    from rlrun.runtime.dist import destroy_distributed, init_distributed
    from rlrun.tools.convert import HfToMcore, McoreToHf
    from rlrun.trainer.checkpoint import ACTOR

    parallel = init_distributed(tp=1, pp=1, seed=0)
    ckpt, hf_out = Path(out_root) / "mcore", Path(out_root) / "hf"
    (ckpt / ACTOR).mkdir(parents=True)
    hf_out.mkdir(parents=True)
    HfToMcore(Path(hf_dir), ckpt, tp=1, pp=1, dtype="float32").run(parallel)
    McoreToHf(ckpt, hf_out, Path(hf_dir), "float32").run(parallel)
    destroy_distributed()


@pytest.mark.parametrize("kind", ["qwen3_moe", "glm4_moe", "deepseek_v3", "deepseek_v3_lite"])
def test_convert_hf_to_mcore_to_hf_is_exact(kind, moe_dirs, tmp_path):
    """``rlrun convert`` hf -> Megatron distributed checkpoint -> hf gives back every tensor bit for bit (GLM-4.5's
    correction bias is a Megatron buffer, saved and loaded with the parameters; the lite DeepSeek's RoPE rows are
    interleaved on the way in and back on the way out)."""
    hf_dir = moe_dirs[kind]
    run_distributed(_convert_worker, 1, str(hf_dir), str(tmp_path))
    want, got = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def _save_worker(hf_dir: str, out: str, ep: int) -> dict[str, torch.Tensor]:
    """Perturb every parameter (each EP rank's experts differently), save a Megatron checkpoint; the HF export."""
    from rlrun.megatron import build_model, export_hf_weights
    from rlrun.megatron.checkpoint import start_save, training_state
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp=1, pp=1, seed=0, ep=ep)
    model = build_model(hf_dir, parallel)
    with torch.no_grad():
        for name, param in model.module.named_parameters():
            param.add_(0.01 * (len(name) + (parallel.ep_rank if ".local_experts." in name else 0)))
    exported = {name: tensor.clone() for name, tensor in export_hf_weights(model)}
    pending = start_save(training_state(model, None, None, with_rng=False), Path(out))
    pending.write()
    pending.finish()
    destroy_distributed()
    return exported


def _load_worker(hf_dir: str, out: str, ep: int) -> dict[str, torch.Tensor]:
    from rlrun.megatron import build_model, export_hf_weights
    from rlrun.megatron.checkpoint import load_weights
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp=1, pp=1, seed=0, ep=ep)
    model = build_model(hf_dir, parallel)
    load_weights(model, Path(out))
    exported = dict(export_hf_weights(model))
    destroy_distributed()
    return exported


def test_checkpoint_saved_at_ep2_loads_at_ep1(tiny_moe_dir, tmp_path):
    """Megatron's distributed checkpoint reshards the experts: saved over two EP ranks, loaded on one layout
    that holds all four experts on each rank, the HF weights are the saved ones bit for bit."""
    saved = run_distributed(_save_worker, 2, str(tiny_moe_dir), str(tmp_path), 2)
    assert not torch.equal(
        saved["model.layers.0.mlp.experts.0.up_proj.weight"],
        load_file(tiny_moe_dir / "model.safetensors")["model.layers.0.mlp.experts.0.up_proj.weight"],
    )
    for loaded in run_distributed(_load_worker, 2, str(tiny_moe_dir), str(tmp_path), 1, all_ranks=True):
        assert loaded.keys() == saved.keys()
        for name, tensor in saved.items():
            assert torch.equal(loaded[name], tensor), name
