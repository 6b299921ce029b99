"""Trainer sleep/wake (torch_memory_saver) and embedded-engine release on a real GPU.

References are independent of the code under test: the driver's free-memory count
(``torch.cuda.mem_get_info``) for what was given back, and a clone taken before sleep for contents.
"""

from __future__ import annotations

import contextlib
import math
import time
import types

import pytest
import torch

from adamw_twins import assert_same_as_plain_adamw
from dist_utils import run_distributed
from policy_rows import policy_loss, random_rows

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

GIB = 2**30


def used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


class _NoEngine:
    process = None


def test_trainer_sleep_frees_region_and_wake_restores_contents():
    from rlrun.config.schema import OffloadConfig
    from rlrun.trainer.offload import Offloader

    offloader = Offloader(OffloadConfig(train=True, rollout=False), _NoEngine(), torch.device("cuda", 0))
    with offloader.trainer_region():
        weights = torch.randn(GIB // 4, device="cuda")  # 1 GiB of fp32
    reference = weights.cpu()
    awake = used_bytes()
    offloader.trainer_sleep()
    asleep = used_bytes()
    assert awake - asleep >= 0.95 * GIB, f"sleep gave back {(awake - asleep) / GIB:.3f} GiB of 1 GiB"
    offloader.trainer_wake()
    assert used_bytes() - asleep >= 0.95 * GIB
    torch.testing.assert_close(weights.cpu(), reference, rtol=0, atol=0)
    metrics = offloader.step_metrics()
    assert metrics["offload/trainer_sleep_gb"] >= 0.95 * GIB / 1e9
    assert metrics["offload/trainer_wake_s"] > 0


@pytest.mark.parametrize("release_cache", ["when_needed", "always"])
def test_a_sleep_keeps_the_activation_cache_where_the_last_rollout_fits(release_cache):
    """``offload.release_cache``: the first sleep, before any rollout was measured, returns torch's cached blocks;
    once a rollout took 1 GiB on the device (the engine's part, here an allocation of this process), the next sleep
    keeps them with ``when_needed`` (the device has room for 1.1 GiB + the margin) and returns them with
    ``always``; the region's contents come back either way."""
    from rlrun.config.schema import OffloadConfig
    from rlrun.trainer.offload import Offloader, default_pool_gb

    device = torch.device("cuda", 0)
    cfg = OffloadConfig(train=True, rollout=False, release_cache=release_cache)
    offloader = Offloader(cfg, _NoEngine(), device)
    with offloader.trainer_region():
        weights = torch.randn(GIB // 4, device="cuda")
    reference = weights.cpu()

    def train_then_sleep() -> tuple[float, dict[str, float]]:
        activations = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
        del activations  # cached in the default pool, as a train phase leaves them
        offloader.enter("rollout")
        return default_pool_gb(device, other_pools=True)[1], offloader.step_metrics()

    cached_first, first = train_then_sleep()
    engine = torch.empty(GIB, dtype=torch.uint8, device="cuda")  # what the rollout takes on
    offloader.enter("train")
    growth = offloader.step_metrics()["offload/engine_growth_gb"]
    del engine
    cached_second, second = train_then_sleep()
    offloader.enter("train")
    assert torch.equal(weights.cpu(), reference)
    assert first["offload/trainer_cache_kept"] == 0 and cached_first < 0.5, (cached_first, first)
    assert 0.9 * GIB / 1e9 <= growth <= 1.2 * GIB / 1e9, growth
    if release_cache == "when_needed":
        assert second["offload/trainer_cache_kept"] == 1 and cached_second >= 2 * GIB / 1e9, (cached_second, second)
    else:
        assert second["offload/trainer_cache_kept"] == 0 and cached_second < 0.5, (cached_second, second)


def test_embedded_engine_release_returns_weights_and_cache(tmp_path):
    from rlrun.engine.embedded.engine import EmbeddedEngine
    from rlrun.tools.bench.shapes import get_shape, write_random_model

    # What earlier tests in this process left in torch's allocator (the sleep test above keeps its 1 GiB
    # trainer-region pool) is not the engine's: the release is measured against it.
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_reserved()
    model_dir = write_random_model(get_shape("qwen3-0.6b"), tmp_path / "m", torch.bfloat16, "cuda")
    engine = EmbeddedEngine(model_dir, dtype="bfloat16", device="cuda")
    before = {name: t.detach().cpu().clone() for name, t in list(engine.named_parameters().items())[:3]}
    weight_bytes = sum(t.numel() * t.element_size() for t in engine.named_parameters().values())
    prompts, params, rids = [[5, 6, 7]] * 8, {"max_new_tokens": 64, "temperature": 1.0}, [f"r{i}" for i in range(8)]
    engine.generate(prompts, params, True, rids)
    engine.offload_weights()
    engine.free_cache()
    # Nothing of the engine's stays in torch's allocator: a KV cache kept alive past the release (a reference
    # cycle through the warm batch, as there once was) would hold its segment here, and the driver-level check
    # below could not see it, because it would be in the baseline too.
    kept = torch.cuda.memory_reserved() - baseline
    assert kept < 8 * 2**20, f"{kept} bytes still reserved"
    # The first cycle loads kernels and library handles the process keeps (157 MB on the H200 with
    # torch 2.11, outside torch's allocator, and the same after a second cycle), so the release is
    # measured from the second cycle on: what a colocated step sees every step.
    released = used_bytes()
    engine.onload_weights()
    for name, tensor in before.items():
        torch.testing.assert_close(engine.named_parameters()[name].cpu(), tensor, rtol=0, atol=0)
    engine.generate(prompts, params, True, rids)
    assert used_bytes() - released >= weight_bytes
    engine.offload_weights()
    engine.free_cache()
    kept = torch.cuda.memory_reserved() - baseline
    assert kept < 8 * 2**20, f"{kept} bytes still reserved"
    assert used_bytes() - released < 8 * 2**20, "released engine still holds device memory"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_embedded_engine_on_a_second_gpu_captures_its_decode_step_there(tmp_path):
    """An engine process serves one GPU that need not be cuda:0 (rank r's engine is on cuda:r)."""
    from rlrun.engine.embedded.engine import EmbeddedEngine
    from rlrun.tools.bench.shapes import get_shape, write_random_model

    model_dir = write_random_model(get_shape("tiny"), tmp_path / "m", torch.bfloat16, "cpu")
    greedy = {"max_new_tokens": 16, "temperature": 0.0}
    outputs = {}
    try:
        for device in ("cuda:0", f"cuda:{torch.cuda.device_count() - 1}"):
            engine = EmbeddedEngine(model_dir, dtype="bfloat16", device=device)
            results = engine.generate([[5, 6, 7]] * 4, greedy, True, [f"r{i}" for i in range(4)])
            assert engine.decode_step_captured, f"the decode step on {device} ran eagerly"
            outputs[device] = [r["output_ids"] for r in results]
            del engine
    finally:
        torch.cuda.set_device(0)
    first, second = outputs.values()
    assert first == second


def test_default_pool_counters_equal_the_snapshot_without_a_region():
    """The allocator's counters are the sum of its snapshot over every pool, so where the default pool is the only
    one (no trainer region: the offloader then reads the counters) they are the default pool. Summed over all
    pools because an earlier test in this process may have left a region's pool."""
    from rlrun.trainer.offload import GB, default_pool_gb

    device = torch.device("cuda", torch.cuda.current_device())
    kept = [torch.empty(n, device=device) for n in (1 << 20, 3 << 18, 12345)]
    del kept[1]  # a freed block: reserved stays above allocated
    segments = torch.cuda.memory_snapshot()
    whole = sum(s["allocated_size"] for s in segments), sum(s["total_size"] for s in segments)
    assert default_pool_gb(device, other_pools=False) == (round(whole[0] / GB, 3), round(whole[1] / GB, 3))


def _state_volume_worker(hf_dir: str) -> dict:
    """A Qwen3-0.6B-shaped Megatron model and its optimizer built in the offloader's region as the actor does, two
    steps, then a sleep and a wake: how much came back against what the state is."""
    from rlrun.config.schema import OffloadConfig
    from rlrun.megatron import build_model, make_optimizer, train_step
    from rlrun.runtime.dist import init_distributed
    from rlrun.trainer.offload import Offloader

    parallel = init_distributed(tp=1, pp=1, seed=0)
    offloader = Offloader(OffloadConfig(train=True, teardown_nccl=False), _NoEngine(), parallel.device)
    with offloader.trainer_region():  # as Actor.build
        model = build_model(hf_dir, parallel, dtype="bfloat16", grad_buffer_region=offloader.scratch_region)
    with offloader.optimizer_region(host_adam=False):
        optimizer = make_optimizer(model, lr=1e-5, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, clip_grad=1.0)
    offloader.offload_optimizer_state(optimizer, model.ddp.parameters())
    (state,) = offloader._optimizer_states
    rows, seq = 8, 256
    gen = torch.Generator().manual_seed(0)
    batch = random_rows(rows, seq, 1000, parallel.device, gen)
    for _ in range(2):
        train_step(model, optimizer, [batch], policy_loss, rows * (seq - 1), temperature=1.0)
    before = [t.cpu() for t in state.tensors()]
    offloader.trainer_sleep()
    offloader.trainer_wake()
    copying = state._copy is not None  # the copy back was queued on the side stream, not done by the saver
    # asked once awake: the saver exits the process when asked for the host copy of paused memory that has none
    saver = offloader._saver
    weight = next(model.ddp.parameters())
    backed_up = {
        "weight": saver.get_cpu_backup(weight.data) is not None,  # kept between sleeps (retain_cpu_backup)
        "grad_buffers": [saver.get_cpu_backup(b.grad_data) is not None for b in model.ddp.buffers],
        "optimizer_state": saver.get_cpu_backup(state.tensors()[0]) is not None,
    }
    state.wait()
    restored = [torch.equal(t.cpu(), b) for t, b in zip(state.tensors(), before, strict=True)]
    params = sum(p.numel() for p in model.ddp.parameters())
    # bf16 weight 2 + fp32 gradient buffer 4 + fp32 main weight 4 + Adam's two fp32 moments 8 bytes a parameter
    # come back (the gradient buffers' pages without their contents)
    wake_gb = offloader.step_metrics()["offload/trainer_wake_gb"]
    loss_after_wake = train_step(model, optimizer, [batch], policy_loss, rows * (seq - 1), temperature=1.0)["loss"]
    return {
        "wake_gb": wake_gb,
        "state_gb": params * 18 / 1e9,
        "state_nbytes": state.nbytes,
        "params": params,
        "backed_up": backed_up,
        "copying": copying,
        "restored": restored,
        "loss": loss_after_wake,
    }


def test_the_trainer_region_holds_the_state_and_nothing_more(tmp_path):
    """What a wake maps back is the trainer's state: no optimizer temporaries left in a region (torch's foreach
    Adam left a square root of the second moments there, 4 bytes a parameter: 13.4 GB moved for the 10.7 GB state
    of a 0.6B model; rlrun.megatron.train.fuse_adam), and the optimizer's part of it comes back through its own
    host copy, bit for bit."""
    from rlrun.tools.bench.shapes import get_shape, write_random_model

    model_dir = write_random_model(get_shape("qwen3-0.6b"), tmp_path / "m", torch.bfloat16, "cuda")
    torch.cuda.empty_cache()
    out = run_distributed(_state_volume_worker, 1, str(model_dir))
    assert out["state_gb"] > 10, out
    assert out["state_gb"] * 0.95 <= out["wake_gb"] <= out["state_gb"] * 1.08 + 0.2, out
    # the weights have the saver's host copy, the gradient buffers (zeroed by every step first) none, the optimizer's
    # main weights and moments (12 bytes a parameter) the FlatOptimizerState's own, copied back on its side stream
    # and equal to what went to sleep, and a step after the wake still trains on finite gradients
    assert out["backed_up"]["weight"] and not any(out["backed_up"]["grad_buffers"]), out
    assert not out["backed_up"]["optimizer_state"] and out["state_nbytes"] == 12 * out["params"], out
    assert out["copying"] and out["restored"] and all(out["restored"]), out
    assert out["backed_up"]["grad_buffers"] and math.isfinite(out["loss"]), out


@pytest.fixture
def flat_states():
    """The FlatOptimizerStates a test makes, their host copies unregistered from CUDA at its end: the offloader's
    live as long as the process, but a test's are freed, and memory freed while registered stays registered, so
    a later test's host copy at the same addresses could not be (cudaErrorHostMemoryAlreadyRegistered)."""
    states: list = []
    yield states
    for state in states:
        state.wait()
    torch.cuda.synchronize()
    for state in states:
        for segment in state._segments:
            for host in segment.host.values():
                assert int(torch.cuda.cudart().cudaHostUnregister(host.data_ptr())) == 0


def _flat_adamw(shapes: list[tuple[int, ...]], device: torch.device, gen: torch.Generator, states: list):
    """AdamW over random parameters of ``shapes`` with its state in a FlatOptimizerState (no model owns the
    parameters: they are its own, as fp32 main weights are; appended to ``states``), its wrapped step, and a plain
    AdamW over clones."""
    from rlrun.trainer.optimizer_state import FlatOptimizerState

    params = [torch.randn(shape, device=device, generator=gen) for shape in shapes]
    twins = [p.clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    reference = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1)
    state = FlatOptimizerState(types.SimpleNamespace(optimizer=optimizer), [], contextlib.nullcontext)
    states.append(state)
    return state, state.stepping(optimizer.step), optimizer, reference


def _wipe_and_load(state) -> None:
    """A sleep and a wake: the host copy saved, the device buffers wiped (NaN: a paused region comes back with
    anything in it), the paced copy back started."""
    state.save_to_host()
    for tensor in state.tensors():
        tensor.fill_(float("nan"))
    state.load_from_host()


def test_the_paced_copy_back_restores_the_state_before_the_step_reads_it(flat_states):
    """AdamW steps through the paced copy back, each step right after the load it reads (so it must wait for the
    whole copy, ~60 pieces), with a sleep and a second load while a copy is under way, equal a plain AdamW bit for
    bit. A save that did not wait would keep the wiped buffers; a step that did not, read them."""
    device = torch.device("cuda", 0)
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = [(96 << 20,), (64 << 20,), (1000, 37), (3,)]  # 640 MB of parameters, 1.9 GB of state
    state, step, optimizer, reference = _flat_adamw(shapes, device, gen, flat_states)
    params = optimizer.param_groups[0]["params"]
    twins = reference.param_groups[0]["params"]
    for index in range(4):
        for param, twin in zip(params, twins, strict=True):
            param.grad = torch.randn(param.shape, device=device, generator=gen)
            twin.grad = param.grad.clone()
        step()
        reference.step()
        _wipe_and_load(state)
        if index == 1:
            _wipe_and_load(state)  # a sleep while the copy back is under way
        if index == 2:
            state.load_from_host()  # a second wake's copy while the first is under way
    state.wait()
    assert_same_as_plain_adamw(state, optimizer, reference)


def _small_copy_latencies_s(state, device: torch.device) -> tuple[list[float], float]:
    """The seconds each of a train loop's small pageable copies to the device (the host waits for it) took while the
    copy back ran, and the copy back's own seconds."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    state.load_from_host()
    copy = state._copy
    latencies = []
    while copy.running() or (copy.last is not None and not copy.last.query()):
        before = time.perf_counter()
        torch.ones(4096).to(device)
        latencies.append(time.perf_counter() - before)
    copy_s = time.perf_counter() - start
    state.wait()
    return latencies, copy_s


def test_a_small_copy_waits_for_a_few_pieces_of_the_copy_back_not_for_all(monkeypatch, flat_states):
    """While the wake's copy back (3.8 GB here) runs, a micro-batch's copy to the device waits behind the pieces queued
    on the copy engine: with ``COPY_PIECES_IN_FLIGHT`` of them a few milliseconds at most, a small part of the whole
    copy. The same copy queued at once is measured too and named in the message (not asserted: how long a copy
    queued behind it waits is the hardware's)."""
    from rlrun.trainer import optimizer_state

    device = torch.device("cuda", 0)
    gen = torch.Generator(device=device).manual_seed(0)
    state, step, optimizer, _ = _flat_adamw([(192 << 20,), (128 << 20,)], device, gen, flat_states)
    for param in optimizer.param_groups[0]["params"]:
        param.grad = torch.randn(param.shape, device=device, generator=gen)
    step()  # the moments: 3.8 GB of state
    state.save_to_host()
    paced, paced_s = _small_copy_latencies_s(state, device)
    monkeypatch.setattr(optimizer_state, "COPY_PIECES_IN_FLIGHT", 1 << 30)
    at_once, at_once_s = _small_copy_latencies_s(state, device)
    report = (
        f"paced: copy {paced_s * 1e3:.1f} ms, {len(paced)} small copies, longest {max(paced, default=0) * 1e3:.2f} ms; "
        f"queued at once: copy {at_once_s * 1e3:.1f} ms, {len(at_once)} small copies, "
        f"longest {max(at_once, default=0) * 1e3:.2f} ms"
    )
    print(report)
    assert len(paced) >= 3 and max(paced) < paced_s / 4, report
