"""One Megatron train step: layout invariance (TP, DP, PP, micro-batch split) and an HF + torch AdamW reference.

All runs take the same global batch and the same loss, -(logprobs * advantages * mask).sum() over the
global token count; gradient clipping is active (clip below the gradient norm) so a wrong gradient
scale shows in the updated weights as well as in the reported norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dist_utils import run_distributed

TEMPERATURE = 0.8
OPTIM = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6, clip_grad=0.5)
pytestmark = pytest.mark.slow


@dataclass
class MicroBatch:
    tokens: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor

    def rows(self, start: int, stop: int, device: torch.device | None = None) -> MicroBatch:
        fields = (self.tokens, self.position_ids, self.loss_mask, self.advantages)
        return MicroBatch(*(t[start:stop].to(device) for t in fields))


def pg_loss(batch: MicroBatch, logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss_sum = -(logprobs * batch.advantages * batch.loss_mask).sum()
    return loss_sum, {"tokens": batch.loss_mask.sum(), "logprob_sum": (logprobs * batch.loss_mask).sum().detach()}


def make_batch(vocab_size: int, rows: int = 4, seq: int = 12) -> MicroBatch:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab_size, (rows, seq), generator=gen)
    mask = (torch.rand(rows, seq - 1, generator=gen) < 0.7).float()
    mask[:, :3] = 0  # a "prompt" that is never trained on
    advantages = torch.randn(rows, 1, generator=gen).expand(rows, seq - 1).contiguous()
    return MicroBatch(tokens, torch.arange(seq).expand(rows, seq), mask, advantages)


RAGGED = ((0, 2, -1), (2, 3, -1), (3, 4, None))
"""Micro-batches of 2, 1 and 1 rows of ``make_batch``'s 4 rows, the first two cut one token shorter (those
rows' last target is not trained on): consecutive micro-batches differ in shape."""


def _cut(local: MicroBatch, plan: int | tuple) -> list[MicroBatch]:
    """``plan`` equal micro-batches, or one per (start row, stop row, sequence end) triple of ``plan``
    (cutting the tokens and the per-position fields at the same ``end`` drops the same trailing targets)."""
    rows = local.tokens.shape[0]
    if isinstance(plan, int):
        plan = tuple((i * rows // plan, (i + 1) * rows // plan, None) for i in range(plan))
    cut = [local.rows(start, stop) for start, stop, _ in plan]
    assert all(not mb.loss_mask[:, end:].any() for mb, (_, _, end) in zip(cut, plan, strict=False) if end), (
        "cut a trained target"
    )
    return [
        MicroBatch(mb.tokens[:, :end], mb.position_ids[:, :end], mb.loss_mask[:, :end], mb.advantages[:, :end])
        for mb, (_, _, end) in zip(cut, plan, strict=False)
    ]


def _train_worker(
    hf_dir: str, tp: int, batch: MicroBatch, micro_batch_plans: list, dtype: str, pp: int = 1
) -> list[dict]:
    """For each entry of ``micro_batch_plans`` (see ``_cut``): a fresh model, one train_step over this DP
    rank's rows cut into micro-batches that way, then the exported weights."""
    from rlrun.megatron import build_model, export_hf_weights, make_optimizer, train_step
    from rlrun.megatron.train import optimizer_parts
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp=tp, pp=pp, seed=0)
    rows = batch.tokens.shape[0] // parallel.dp_size
    local = batch.rows(parallel.dp_rank * rows, (parallel.dp_rank + 1) * rows, parallel.device)
    num_global_tokens = int(batch.loss_mask.sum())
    results = []
    for plan in micro_batch_plans:
        model = build_model(hf_dir, parallel, dtype=dtype)
        optimizer = make_optimizer(model, **OPTIM)
        micro_batches = _cut(local, plan)
        stats = train_step(model, optimizer, micro_batches, pg_loss, num_global_tokens, TEMPERATURE)
        adam = [o.optimizer for o in optimizer_parts(optimizer)]
        fused = all(g["fused"] and not g["foreach"] for a in adam for g in a.param_groups)
        results.append({"stats": stats, "weights": {k: v.cpu() for k, v in export_hf_weights(model)}, "fused": fused})
    destroy_distributed()
    return results


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["llama"])


@pytest.fixture(scope="module")
def batch(llama_dir) -> MicroBatch:
    from rlrun.megatron.hf_config import ModelArch

    return make_batch(ModelArch.from_hf_dir(llama_dir).vocab_size)


@pytest.fixture(scope="module")
def single_rank(llama_dir, batch) -> list[dict]:
    """TP=1, DP=1: one micro-batch, then two."""
    return run_distributed(_train_worker, 1, llama_dir, 1, batch, [1, 2], "float32")


def _assert_same_step(got: dict, want: dict, weight_atol: float = 2e-6) -> None:
    for key, value in want["stats"].items():
        assert got["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert set(got["weights"]) == set(want["weights"])
    for name, tensor in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=0, atol=weight_atol, msg=name)


def test_step_matches_hf_and_torch_adamw(single_rank, llama_dir, batch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    logp = torch.log_softmax(model(batch.tokens).logits[:, :-1] / TEMPERATURE, dim=-1)
    logprobs = logp.gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    loss_sum, metrics = pg_loss(batch, logprobs)
    num_tokens = batch.loss_mask.sum()
    (loss_sum / num_tokens).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["clip_grad"])
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=OPTIM["lr"],
        betas=OPTIM["betas"],
        eps=OPTIM["eps"],
        weight_decay=OPTIM["weight_decay"],
    ).step()

    got = single_rank[0]
    assert got["fused"]  # rlrun steps torch's fused Adam kernel (fuse_adam); the reference is torch's default
    assert grad_norm > OPTIM["clip_grad"]  # clipping is active, so its scale is tested too
    assert got["stats"]["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-5)
    assert got["stats"]["loss"] == pytest.approx((loss_sum / num_tokens).item(), rel=1e-5)
    assert got["stats"]["tokens"] == num_tokens.item()
    assert got["stats"]["logprob_sum"] == pytest.approx(metrics["logprob_sum"].item(), rel=1e-5)
    reference = model.state_dict()
    assert set(got["weights"]) == {n for n in reference if n != "lm_head.weight"}  # tied
    for name, tensor in got["weights"].items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=2e-6, msg=name)


def test_two_micro_batches_match_one(single_rank):
    one, two = single_rank
    _assert_same_step(two, one)


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_two_ranks_match_one(tp, single_rank, llama_dir, batch):
    """TP=2 (same rows, sharded model) and DP=2 (rows split, replicated model) vs TP=1, DP=1."""
    for rank_result in run_distributed(_train_worker, 2, llama_dir, tp, batch, [1], "float32", all_ranks=True):
        _assert_same_step(rank_result[0], single_rank[0])


@pytest.mark.parametrize(
    "world_size, tp, pp, plan", [(2, 1, 2, RAGGED), (4, 2, 2, RAGGED), (4, 1, 2, 2)], ids=["pp2", "tp2pp2", "dp2pp2"]
)
def test_pipeline_matches_one(world_size, tp, pp, plan, single_rank, llama_dir, batch):
    """PP=2 (1F1B over micro-batches of different shapes; tied embeddings split over the first and last
    stage), TP2 x PP2 and DP2 x PP2 (two rows per replica, one per micro-batch) vs TP=1, one micro-batch:
    same loss, metrics, grad norm and updated weights on every rank."""
    ranks = run_distributed(_train_worker, world_size, llama_dir, tp, batch, [plan], "float32", pp, all_ranks=True)
    for rank_result in ranks:
        _assert_same_step(rank_result[0], single_rank[0])


def test_bf16_step_tracks_fp32(single_rank, llama_dir, batch):
    """bf16 parameters with fp32 main weights (Megatron's Float16Optimizer) take nearly the fp32 step.

    Only matrices are compared by update direction: a 1e-3 step on a norm weight near 1.0 is below
    bf16's resolution there (2**-7), so the bf16 copy of a norm does not move.
    """
    (bf16,) = run_distributed(_train_worker, 1, llama_dir, 1, batch, [1], "bfloat16")
    fp32 = single_rank[0]
    assert bf16["stats"]["grad_norm"] == pytest.approx(fp32["stats"]["grad_norm"], rel=0.02)
    assert bf16["stats"]["loss"] == pytest.approx(fp32["stats"]["loss"], abs=0.02)
    initial = load_file(Path(llama_dir) / "model.safetensors")
    for name, tensor in fp32["weights"].items():
        assert bf16["weights"][name].dtype == torch.bfloat16
        torch.testing.assert_close(bf16["weights"][name].float(), tensor, rtol=0.02, atol=2e-3, msg=name)
        if tensor.ndim == 2:
            fp32_step = (tensor - initial[name]).flatten()
            bf16_step = (bf16["weights"][name].float() - initial[name].bfloat16().float()).flatten()
            assert torch.cosine_similarity(fp32_step, bf16_step, dim=0) > 0.95, name


def _grad_buffer_worker(hf_dir: str, distributed_optimizer: bool) -> dict:
    """Build the model with a ``grad_buffer_region`` that records what torch allocates inside it: which of DDP's
    gradient buffers (and parameter buffers) were allocated there, and whether a step still trains."""
    import contextlib

    from rlrun.megatron import build_model, make_optimizer, train_step
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    allocated: list[int] = []
    entered = []

    @contextlib.contextmanager
    def recording_region():
        entered.append(True)
        zeros, empty = torch.zeros, torch.empty

        def record(fn):
            def alloc(*args, **kwargs):
                out = fn(*args, **kwargs)
                allocated.append(out.data_ptr())
                return out

            return alloc

        torch.zeros, torch.empty = record(zeros), record(empty)
        try:
            yield
        finally:
            torch.zeros, torch.empty = zeros, empty

    parallel = init_distributed(tp=1, pp=1, seed=0)
    model = build_model(
        hf_dir,
        parallel,
        dtype="float32",
        distributed_optimizer=distributed_optimizer,
        grad_buffer_region=recording_region,
    )
    buffers = model.ddp.buffers
    grads_inside = [b.grad_data.data_ptr() in allocated for b in buffers]
    params_inside = [b.param_data is not None and b.param_data.data_ptr() in allocated for b in buffers]
    optimizer = make_optimizer(model, **OPTIM)
    batch = make_batch(model.arch.vocab_size)
    stats = train_step(model, optimizer, [batch], pg_loss, int(batch.loss_mask.sum()), TEMPERATURE)
    destroy_distributed()
    return {"entered": len(entered), "grads_inside": grads_inside, "params_inside": params_inside, "stats": stats}


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_gradient_buffers_go_to_the_region_given(llama_dir, distributed_optimizer):
    """The gradient buffers are allocated in ``grad_buffer_region`` (the offloader's region without a host copy),
    except with the distributed optimizer, whose buffer constructor also allocates the weights' bf16 copy."""
    out = run_distributed(_grad_buffer_worker, 1, llama_dir, distributed_optimizer)
    assert out["grads_inside"], out
    if distributed_optimizer:
        assert out["entered"] == 0 and not any(out["grads_inside"]), out
    else:
        assert out["entered"] == 1 and all(out["grads_inside"]) and not any(out["params_inside"]), out
    assert out["stats"]["grad_norm"] > 0


def _flat_state_worker(hf_dir: str, dtype: str, distributed_optimizer: bool) -> dict:
    """Three steps with the optimizer's state in a FlatOptimizerState whose buffers are poisoned (NaN) after each
    save to the host, as a paused scratch region comes back, and reloaded; one moment replaced by a new tensor
    between steps (as a checkpoint load does); against the same three steps without it."""
    import contextlib

    from rlrun.megatron import build_model, export_hf_weights, make_optimizer, train_step
    from rlrun.megatron.train import optimizer_parts
    from rlrun.runtime.dist import destroy_distributed, init_distributed
    from rlrun.trainer.optimizer_state import FlatOptimizerState

    parallel = init_distributed(tp=1, pp=1, seed=0)
    out = {}
    for flat in (False, True):
        model = build_model(hf_dir, parallel, dtype=dtype, distributed_optimizer=distributed_optimizer)
        model_ptrs = [p.data_ptr() for p in model.ddp.parameters()]
        optimizer = make_optimizer(model, **OPTIM)
        batch = make_batch(model.arch.vocab_size)
        state = None
        if flat:
            state = FlatOptimizerState(optimizer, model.ddp.parameters(), contextlib.nullcontext)
            optimizer.step = state.stepping(optimizer.step)  # as the offloader wraps it
            built_nbytes = state.nbytes
        stats = []
        for step in range(3):
            stats.append(train_step(model, optimizer, [batch], pg_loss, int(batch.loss_mask.sum()), TEMPERATURE))
            if state is None:
                continue
            if step == 0:
                first_step_nbytes = state.nbytes  # the moments placed by the step itself, before any save
            if step == 1:
                inner = optimizer_parts(optimizer)[0].optimizer
                param = inner.param_groups[0]["params"][0]
                inner.state[param]["exp_avg"] = inner.state[param]["exp_avg"].clone()
            state.save_to_host()
            for tensor in state.tensors():
                tensor.fill_(float("nan"))
            state.load_from_host()
            state.wait()
        numel = sum(p.numel() for p in model.ddp.parameters())
        out[flat] = {
            "stats": stats,
            "weights": {k: v.cpu() for k, v in export_hf_weights(model)},
            "nbytes": state.nbytes if state else None,
            "built_nbytes": built_nbytes if state else None,
            "first_step_nbytes": first_step_nbytes if state else None,
            "numel": numel,
            "model_params_kept": model_ptrs == [p.data_ptr() for p in model.ddp.parameters()],
        }
    destroy_distributed()
    return out


@pytest.mark.parametrize(
    "dtype,distributed_optimizer", [("bfloat16", False), ("float32", False), ("bfloat16", True), ("float32", True)]
)
def test_flat_optimizer_state_survives_sleeps_bit_for_bit(llama_dir, dtype, distributed_optimizer):
    """The offloader's FlatOptimizerState holds the fp32 main weights (bf16 models) from the start and both Adam
    moments from the first step, 4 + 8 bytes a parameter (8 for fp32 models, whose optimizer steps the model's own
    weights, left in place), and three
    steps through its host copy, with its device buffers wiped at every sleep, equal three plain steps."""
    out = run_distributed(_flat_state_worker, 1, llama_dir, dtype, distributed_optimizer)
    plain, flat = out[False], out[True]
    assert flat["nbytes"] == flat["numel"] * (12 if dtype == "bfloat16" else 8), flat
    assert flat["built_nbytes"] == flat["numel"] * (4 if dtype == "bfloat16" else 0), flat  # moments at the first step
    assert flat["first_step_nbytes"] == flat["nbytes"], flat
    assert flat["model_params_kept"]
    assert flat["stats"] == plain["stats"]
    for name, tensor in plain["weights"].items():
        assert torch.equal(flat["weights"][name], tensor), name
