"""``rlrun bench step`` variants (rlrun/tools/bench/step.py Variant) and their names in benchmarks/peer_step.py.

References: the config schema (load_config parses what run_config writes), the offload fields the loop
reads, and the round trip label -> parse_variant -> flags.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from rlrun.config import load_config
from rlrun.tools.bench.engines import SGLANG_SERVER_ARGS
from rlrun.tools.bench.step import RESIDENT_SGLANG_MEM_FRACTION, StepSettings, Variant, run_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from peer_step import parse_variant, variant_flags  # noqa: E402


@pytest.mark.parametrize("backend", ["embedded", "sglang"])
@pytest.mark.parametrize(
    "variant",
    [
        Variant(),
        Variant(offload=False),
        Variant(teardown_nccl=False),
        Variant(release_cache="always"),
        Variant(optimizer_copy="with_weights"),
        Variant(packed_attention="flash_varlen"),
        Variant(packed_attention="per_sample"),
        Variant(lora_rank=8),
        Variant(recompute="selective", optimizer_offload=True),
        Variant(lm_head="chunked_kept"),
        Variant(offload=False, lm_head="logits"),
    ],
)
def test_run_config_applies_the_variant(tmp_path, backend, variant):
    config = run_config(
        StepSettings(backend=backend), tmp_path / "inputs", tmp_path / "run", "float32", variant, profile_step=3
    )
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    cfg = load_config(path)
    assert (cfg.offload.train, cfg.offload.rollout) == (variant.offload, variant.offload)
    assert cfg.offload.teardown_nccl is variant.teardown_nccl
    assert cfg.offload.release_cache == variant.release_cache
    assert cfg.offload.optimizer_copy == variant.optimizer_copy
    assert variant.label(backend).endswith("_copywithweights") == (variant.optimizer_copy == "with_weights")
    assert variant.label(backend).endswith("_releasecache") == (variant.release_cache == "always")
    assert cfg.model.packed_attention == variant.packed_attention
    assert cfg.model.lm_head == variant.lm_head
    assert variant.label(backend).endswith("_headkept") == (variant.lm_head == "chunked_kept")
    lora = cfg.model.lora
    if variant.lora_rank is None:
        assert lora is None
    else:
        assert (lora.rank, lora.alpha) == (8, 16.0)
    assert variant.label(backend).endswith("_lora8") == (variant.lora_rank == 8)
    assert cfg.train.recompute == variant.recompute
    assert cfg.optimizer.cpu_offload is cfg.optimizer.use_distributed_optimizer is variant.optimizer_offload
    assert cfg.offload.reloadable_backends == (("nccl",) if variant.offload and variant.teardown_nccl else ())
    assert tuple(cfg.logging.profile_steps) == (3,)
    if backend == "sglang":
        fraction = SGLANG_SERVER_ARGS["mem_fraction_static"] if variant.offload else RESIDENT_SGLANG_MEM_FRACTION
        assert cfg.engine.server_args["mem_fraction_static"] == fraction
        assert str(fraction) in variant.engine_memory(backend)
    assert SGLANG_SERVER_ARGS["mem_fraction_static"] == 0.3  # the shared default is copied, never changed


def test_run_config_splits_the_rollout_into_updates(tmp_path):
    settings = StepSettings(updates_per_rollout=4)
    config = run_config(settings, tmp_path / "inputs", tmp_path / "run", "float32")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    cfg = load_config(path)
    assert cfg.train.updates_per_rollout == 4
    assert cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt == 4 * 32  # 32 samples per update


@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("teardown", [True, False])
@pytest.mark.parametrize("attention", ["auto", "per_sample", "chunked_varlen", "flash_varlen"])
@pytest.mark.parametrize("recompute, optimizer_offload", [("none", False), ("full", True)])
@pytest.mark.parametrize("release_cache, optimizer_copy", [("when_needed", "overlapped"), ("always", "with_weights")])
@pytest.mark.parametrize("lm_head", ["chunked", "chunked_kept"])
def test_variant_names_round_trip(
    offload, teardown, attention, recompute, optimizer_offload, release_cache, optimizer_copy, lm_head
):
    variant = Variant(
        offload,
        teardown,
        attention,
        recompute,
        optimizer_offload,
        release_cache=release_cache,
        optimizer_copy=optimizer_copy,
        lm_head=lm_head,
    )
    label = variant.label("sglang")
    assert parse_variant(label) == ("sglang", variant)
    flags = variant_flags("sglang", variant)
    assert flags[flags.index("--offload") + 1] == ("on" if offload else "off")
    assert flags[flags.index("--teardown-nccl") + 1] == ("on" if teardown else "off")
    assert flags[flags.index("--release-cache") + 1] == release_cache
    assert flags[flags.index("--optimizer-copy") + 1] == optimizer_copy
    assert flags[flags.index("--packed-attention") + 1] == attention
    assert flags[flags.index("--recompute") + 1] == recompute
    assert flags[flags.index("--optimizer-offload") + 1] == ("on" if optimizer_offload else "off")
    assert flags[flags.index("--lm-head") + 1] == lm_head


@pytest.mark.parametrize(
    "spec",
    [
        "sglang_fast",
        "sglang_keepnccl_resident",
        "sglang_varlen_keepnccl",
        "sglang_persample_varlen",
        "sglang_headkept_varlen",
    ],
)
def test_unknown_or_misordered_variants_are_refused(spec):
    with pytest.raises(SystemExit, match="must"):
        parse_variant(spec)


def test_reused_trl_result_must_have_run_the_same_work(tmp_path):
    import dataclasses
    import json

    from peer_step import reused_result

    settings = StepSettings(shape="tiny", prompts=2)
    path = tmp_path / "trl.json"
    with pytest.raises(SystemExit, match="run without"):
        reused_result(path, settings, "--reuse-trl")
    record = {"settings": {**dataclasses.asdict(settings), "backend": "trl"}, "median_step_s": 3.0}
    path.write_text(json.dumps(record))
    assert reused_result(path, settings, "--reuse-trl") == {**record, "reused_from": str(path)}
    with pytest.raises(SystemExit, match="must match"):
        reused_result(path, dataclasses.replace(settings, prompts=4), "--reuse-trl")


def test_medians_leave_out_the_warmup_and_the_profiled_step(tmp_path):
    from rlrun.tools.bench.step import WARMUP_STEPS, summarise
    from rlrun.tools.bench.trace_ops import PhaseProfile

    settings = StepSettings(shape="tiny", prompts=2, samples=4, new_tokens=6, steps=6)
    step_s = [40.0, 20.0, 3.0, 5.0, 90.0, 4.0]  # one-time costs in 0 and 1, the profiler's in 4
    rows = [
        {
            "step": i,
            "time/step_s": s,
            "time/wall_step_s": s + 0.25,
            "time/rollout_s": s / 2,
            "time/train_s": s / 2,
            "rollout/response_len_mean": 6.0,
            "offload/trainer_sleep_s": s / 10,
            "memory/rollout/trainer_gb": 1.0 + i / 10,
        }
        for i, s in enumerate(step_s)
    ]
    profile = PhaseProfile(phase="train", step=4, trace="t.json", phase_us=1.0, device_us=0.0, ops=[], kernels=[])
    result = summarise(rows, settings, "cpu", "float32", tmp_path / "sglang", Variant(), profile)
    assert WARMUP_STEPS == 2 and result.warmup_steps == 2
    assert [r.profiled for r in result.steps] == [False] * 4 + [True, False]
    assert result.median_step_s == 4.0  # median of 3, 5 and 4
    assert result.median_wall_s == 4.25
    assert result.median_offload == {"trainer_sleep_s": 0.4}
    assert result.median_phases_s == {"rollout": 2.0, "train": 2.0}
    assert result.trainer_rollout_gb == 1.5  # the largest step's residual memory while the engine generates


def test_cli_refuses_prompts_that_ranks_cannot_share(tmp_path):
    """``rlrun bench step --ranks`` checks the split before anything starts, naming the flag's values."""
    from typer.testing import CliRunner

    from rlrun.cli import app

    result = CliRunner().invoke(
        app, ["bench", "step", "--shape", "tiny", "--prompts", "3", "--ranks", "2", "--work", str(tmp_path)]
    )
    text = " ".join(result.output.replace("│", " ").split())  # rich's error box, unwrapped
    assert result.exit_code == 2 and "prompts (3) must be a multiple of ranks (2)" in text, result.output
    assert not any(tmp_path.iterdir())  # nothing was written


@pytest.mark.parametrize(
    "flag, choices",
    [("--release-cache", "['when_needed', 'always']"), ("--optimizer-copy", "['overlapped', 'with_weights']")],
)
def test_cli_refuses_an_unknown_offload_choice(tmp_path, flag, choices):
    from typer.testing import CliRunner

    from rlrun.cli import app

    result = CliRunner().invoke(app, ["bench", "step", "--shape", "tiny", flag, "never", "--work", str(tmp_path)])
    text = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2 and f"{flag} (never) must be one of {choices}" in text, text
    assert not any(tmp_path.iterdir())


def test_ratios_pair_each_rlrun_run_with_the_verl_run_that_offloads_alike():
    from peer_step import compare

    def peer(s):
        return {"median_step_s": s}

    def mine(s):
        return {"results": [{"median_step_s": s}]}

    results = {
        "trl": peer(20.0),
        "verl": peer(12.0),
        "verl_resident": peer(6.0),
        "sglang": mine(8.0),
        "sglang_resident": mine(3.0),
        "embedded": mine(10.0),
        "embedded_resident": {"error": "exit 1"},
    }
    ratios = compare(results)
    assert set(ratios) == {"sglang", "sglang_resident", "embedded"}  # peers and failed runs get none
    # the embedded engine has no goal against verl: a speedup, and no verdict (1.2 is short of SGLang's 1.5)
    assert ratios["embedded"]["speedup_vs_verl"] == 1.2 and ratios["embedded"]["meets_goal_vs_verl"] is None
    assert ratios["sglang"]["verl_run"] == "verl" and ratios["sglang"]["speedup_vs_verl"] == 1.5
    assert ratios["sglang"]["meets_goal_vs_verl"] and ratios["sglang"]["speedup_vs_trl"] == 2.5
    assert ratios["sglang_resident"]["verl_run"] == "verl_resident"
    assert ratios["sglang_resident"]["speedup_vs_verl"] == 2.0 and ratios["sglang_resident"]["goal_vs_verl"] == 1.5
    del results["verl_resident"], results["trl"]
    assert "speedup_vs_verl" not in compare(results).get("sglang_resident", {})
    assert "speedup_vs_trl" not in compare(results)["sglang"]


def test_ratios_pair_each_rlrun_run_with_the_trl_vllm_run_that_offloads_alike():
    from peer_step import compare

    results = {
        "trl_vllm": {"median_step_s": 10.0},
        "trl_vllm_resident": {"median_step_s": 9.0},
        "sglang": {"results": [{"median_step_s": 4.0}]},
        "sglang_resident": {"results": [{"median_step_s": 3.0}]},
    }
    ratios = compare(results)
    assert set(ratios) == {"sglang", "sglang_resident"}
    assert ratios["sglang"]["trl_vllm_run"] == "trl_vllm" and ratios["sglang"]["speedup_vs_trl_vllm"] == 2.5
    assert ratios["sglang_resident"]["trl_vllm_run"] == "trl_vllm_resident"
    assert ratios["sglang_resident"]["speedup_vs_trl_vllm"] == 3.0
    del results["trl_vllm_resident"]
    assert "speedup_vs_trl_vllm" not in compare(results).get("sglang_resident", {})


def test_trl_vllm_config_takes_the_sglang_fraction_of_the_row_it_pairs_with():
    from trl_grpo import VllmMode, vllm_config

    settings = StepSettings(prompt_len=128, new_tokens=512)
    on, off = vllm_config(settings, VllmMode(offload=True)), vllm_config(settings, VllmMode(offload=False))
    assert on["vllm_enable_sleep_mode"] and not off["vllm_enable_sleep_mode"]
    assert on["vllm_gpu_memory_utilization"] == SGLANG_SERVER_ARGS["mem_fraction_static"]
    assert off["vllm_gpu_memory_utilization"] == RESIDENT_SGLANG_MEM_FRACTION
    assert on["vllm_max_model_length"] == 640 and on["generation_kwargs"] == {"min_tokens": 512}
    assert not on["vllm_importance_sampling_correction"]


def test_step_clock_counts_each_phase_without_the_phases_inside_it(monkeypatch):
    from trl_grpo import StepClock

    ticks = iter([0.0, 1.0, 3.0, 7.0, 8.0, 10.0])  # generate [0, 7] holds offload [1, 3]; offload again [8, 10]
    clock = StepClock(on_gpu=False)
    monkeypatch.setattr(clock, "now", lambda: next(ticks))
    with clock.phase("generate"):
        clock.timed("offload", lambda: None)()
    with clock.phase("offload"):
        pass
    assert clock.phases == {"generate": 5.0, "offload": 4.0}


def test_the_step_cell_shows_rlruns_wall_clock_next_to_its_phases():
    from peer_step import step_cell

    assert step_cell({"median_step_s": 3.712, "median_wall_s": 3.7251}) == "3.71 (wall 3.73)"
    assert step_cell({"median_step_s": 5.4086}) == "5.41"  # a peer's own whole-step timer


def test_the_gap_cell_shows_rlruns_largest_log_prob_gap_and_nothing_for_a_peer():
    from peer_step import gap_cell

    assert gap_cell({"max_logprob_gap": 1.234e-7}) == "1.2e-07"
    assert gap_cell({"max_logprob_gap": None}) == gap_cell({"median_step_s": 5.4}) == ""


def test_verl_overrides_go_to_every_run_or_to_the_variant_named():
    from peer_step import verl_overrides

    items = ["a.b=1", "verl_resident:actor.len=10240", "verl:c=x:y", "path=/tmp/x:y"]
    assert verl_overrides(items, "verl_resident") == ["a.b=1", "actor.len=10240", "path=/tmp/x:y"]
    assert verl_overrides(items, "verl") == ["a.b=1", "c=x:y", "path=/tmp/x:y"]
    with pytest.raises(SystemExit, match="'verl_resdent' is not a verl variant"):
        verl_overrides(["verl_resdent:actor.len=1"], "verl")
