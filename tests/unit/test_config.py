"""load_config: YAML + --set overrides -> RunConfig, and one-line errors that name file:line and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from minimal_config import REQUIRED, write_config
from rlrun.config import ConfigError, RunConfig, dump_config, load_config, read_config
from rlrun.config.schema import REQUIRED_KEYS, required_message

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    """``text`` as run.yaml over a base file of the required keys (its own lines unchanged)."""
    return write_config(tmp_path / "run.yaml", text)


def error_of(path: Path, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "# c\nrollout:\n  max_new_tokens: lots\n",
            ":3: rollout.max_new_tokens ('lots') must be a valid integer, unable to parse string as an integer",
        ),
        ("rollout:\n  top_p: 1\n  temperature: -1\n", ":3: rollout.temperature (-1) must be greater than 0"),
        ("model:\n  dtype: fp16\n", ":2: model.dtype ('fp16') must be 'float32' or 'bfloat16'"),
        ("rollout:\n  temprature: 0.5\n", ":2: unknown key 'rollout.temprature' (did you mean 'temperature'?)"),
        ("modle:\n  path: x\n", ":1: unknown key 'modle' (did you mean 'model'?)"),
        ("data:\n  zzz: 1\n", ":2: unknown key 'data.zzz' (allowed: path, split, prompt_key, label_key,"),
        ("train: 5\n", ":1: train (5) must be a valid dictionary or instance of TrainConfig"),
        # cross-field (model validator): points at the key the validator names, not just the section
        (
            "debug:\n  load_rollout_data: runs/x\n  rollout_only: true\n",
            ":3: debug.rollout_only (true) must be false when debug.load_rollout_data is set",
        ),
        (
            "rollout:\n  temperature: 1\n  temperature: 2\n",
            ":3: duplicate key 'rollout.temperature' (first set on line 2)",
        ),
        ("model:\n  path: x\nrollout:\n\ttemperature: 1\n", ":4: invalid YAML: found character '\\t' that cannot"),
        ("- 1\n", ":1: the config must be a mapping of sections"),
    ],
)
def test_file_errors_are_one_line_with_file_and_line(tmp_path, text, expected):
    path = write(tmp_path, text)
    message = error_of(path)
    assert "\n" not in message
    assert message.startswith(f"{path}{expected}")


def test_every_problem_is_reported_once_per_line_in_file_order(tmp_path):
    path = write(tmp_path, "rollout:\n  temprature: 0.5\n  max_new_tokens: 0\nmodel:\n  dtype: fp16\n")
    lines = error_of(path).splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == [f"{path}:2", f"{path}:3", f"{path}:5"]


def test_reward_spec_is_checked_by_the_preflight(tmp_path):
    from rlrun.preflight import preflight

    path = write(tmp_path, "rollout:\n  reward: no_such_module_xyz:score\n")
    with pytest.raises(ConfigError) as info:
        preflight(read_config(path))
    message = str(info.value)
    assert message.startswith(f"{path}:2: rollout.reward: reward 'no_such_module_xyz:score': module")
    assert "fn(sample: Sample) -> float" in message


def test_missing_file(tmp_path):
    message = error_of(tmp_path / "nope.yaml")
    assert message.startswith(f"{tmp_path / 'nope.yaml'}: config file not found")


@pytest.mark.parametrize(
    "override, expected",
    [
        ("rollout.temperature=0.5", ("rollout", "temperature", 0.5)),
        ("rollout.max_new_tokens=16", ("rollout", "max_new_tokens", 16)),
        ("optimizer.lr=3e-6", ("optimizer", "lr", 3e-6)),
        ("data.shuffle=false", ("data", "shuffle", False)),
        ("data.system_prompt=null", ("data", "system_prompt", None)),
        ("data.system_prompt=Be brief: answer.", ("data", "system_prompt", "Be brief: answer.")),
        ("model.path=/models/x", ("model", "path", "/models/x")),
        ("checkpoint.dir=", ("checkpoint", "dir", None)),
    ],
)
def test_overrides_parse_yaml_scalars(tmp_path, override, expected):
    cfg = load_config(write(tmp_path, "data:\n  system_prompt: hello\n"), [override])
    section, field, value = expected
    assert getattr(getattr(cfg, section), field) == value


def test_override_wins_over_file_and_is_named_in_errors(tmp_path):
    path = write(tmp_path, "rollout:\n  temperature: 0.5\n")
    assert load_config(path, ["rollout.temperature=0.9"]).rollout.temperature == 0.9
    message = error_of(path, ("rollout.temperature=-2",))
    assert message == "--set rollout.temperature=-2: rollout.temperature (-2) must be greater than 0"


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "rollout.temprature=1",
            "--set rollout.temprature=1: unknown key 'rollout.temprature' (did you mean 'temperature'?)",
        ),
        ("roll.temperature=1", "--set roll.temperature=1: unknown key 'roll' (did you mean 'rollout'?)"),
        ("model.path.x=1", "--set model.path.x=1: 'model.path' is a value, not a section; set 'model.path=...'"),
        (
            "rollout.temperature",
            "--set rollout.temperature: expected dotted.key=value, e.g. --set rollout.temperature=0.7",
        ),
        (
            "eval.interval=5",
            "--set eval.interval=5: eval.interval (5) must be 0 when eval.datasets is empty because there "
            "is nothing to evaluate; add eval.datasets: [{name: ..., path: ...}] or set eval.interval: 0",
        ),
    ],
)
def test_bad_overrides(tmp_path, override, expected):
    assert error_of(write(tmp_path, "rollout:\n  top_p: 1\n"), (override,)) == expected


def test_empty_file_names_the_required_keys(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    expected = sorted(f"{path}: {required_message(key)}" for key in REQUIRED_KEYS)
    assert sorted(error_of(path).splitlines()) == expected
    assert required_message("model.path") == "model.path is required: set it to a Hugging Face directory or hub id"
    path.write_text("model:\n  path: m\ndata:\n  path: d.jsonl\nrollout:\n  temperature: 0.5\n")
    assert error_of(path) == f"{path}:5: {required_message('rollout.reward')}"  # the rollout section's line


def test_an_agent_whose_return_is_the_reward_needs_no_reward(tmp_path):
    path = write(tmp_path, "rollout:\n  agent: examples/openai_agent/agent.py:agent\n")
    assert load_config(path, ["rollout.reward=null"]).rollout.reward is None
    message = error_of(path, ("rollout.reward=null", "rollout.agent_scores=false"))
    assert message == f"--set rollout.reward=null: {required_message('rollout.reward')}"


def test_required_keys_alone_give_defaults_and_dump_round_trips(tmp_path):
    cfg = load_config(write(tmp_path, ""))
    assert cfg == RunConfig.model_validate({**REQUIRED, "logging": {"run_dir": "runs/run"}})  # runs/<file's stem>
    assert cfg.rollout.temperature == 1.0 and cfg.data.shuffle  # every other key its default
    cfg = load_config(
        write(tmp_path, "rollout:\n  temperature: 0.7\noptimizer:\n  lr: 1.0e-6\n"),
        ["data.system_prompt=Be brief.", "train.num_steps=3"],
    )
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(dump_config(cfg))
    assert load_config(dumped) == cfg
    assert cfg.logging.run_dir == "runs/run" and cfg.train.num_steps == 3


def test_quickstart_config_matches_the_measured_recipe():
    cfg = load_config(REPO / "configs" / "quickstart.yaml")
    r = cfg.rollout
    assert (r.prompts_per_step, r.samples_per_prompt, r.max_new_tokens, r.temperature) == (4, 8, 8, 1.0)
    assert (cfg.optimizer.lr, cfg.optimizer.clip_grad, r.reward) == (1e-5, 1.0, "first_number")
    assert 40 <= cfg.train.num_steps <= 60
    assert cfg.data.system_prompt is None and cfg.model.path == ".cache/models/SmolLM2-135M-Instruct"
    assert cfg.logging.run_dir == "runs/quickstart"


def test_colocate_turns_both_offloads_on_unless_set(tmp_path):
    path = write(tmp_path, "offload:\n  colocate: true\n")
    offload = load_config(path).offload
    assert (offload.train, offload.rollout) == (True, True)
    assert load_config(path, ["offload.rollout=false"]).offload.rollout is False
    assert load_config(write(tmp_path, "{}\n")).offload.train is False


def test_more_updates_per_rollout_than_groups_is_refused_by_name(tmp_path):
    path = write(tmp_path, "rollout:\n  prompts_per_step: 2\n")
    with pytest.raises(ConfigError, match=r"train.updates_per_rollout \(3\) must be <= rollout.prompts_per_step \(2\)"):
        load_config(path, ["train.updates_per_rollout=3"])
    assert load_config(path, ["train.updates_per_rollout=2", "train.epochs_per_rollout=2"]).train.updates_per_step == 4


def test_context_parallelism_refuses_a_kernel_it_would_not_run(tmp_path):
    path = write(tmp_path, "parallel:\n  cp: 2\n")
    for kernel in ("flash_varlen", "cudnn_per_sample"):
        with pytest.raises(ConfigError, match=rf"model.packed_attention \({kernel}\) would have no effect"):
            load_config(path, [f"model.packed_attention={kernel}"])
    assert load_config(path, ["model.packed_attention=auto"]).parallel.cp == 2


def test_sync_interval_refuses_an_old_actor_that_changes_nothing_and_a_gate_that_cannot_hold(tmp_path):
    path = write(tmp_path, "{}\n")
    with pytest.raises(ConfigError, match=r"keep_old_actor \(true\) has no effect with engine.sync_interval 1"):
        load_config(path, ["algorithm.keep_old_actor=true"])
    with pytest.raises(ConfigError, match=r"max_logprob_gap \(1e-06\) must be unset with engine.sync_interval 2"):
        load_config(path, ["engine.sync_interval=2", "algorithm.max_logprob_gap=1e-6"])
    cfg = load_config(
        path, ["engine.sync_interval=2", "algorithm.max_logprob_gap=1e-6", "algorithm.keep_old_actor=true"]
    )
    assert cfg.engine.sync_interval == 2
    with pytest.raises(ConfigError, match=r"engine.max_restarts \(1\) must be 0 with engine.sync_interval 2"):
        load_config(path, ["engine.sync_interval=2", "engine.max_restarts=1"])


def test_partial_rollout_refuses_the_on_policy_gate(tmp_path):
    """Carried groups are sampled by earlier weights: the gate would stop the first step that trains one
    (tests/integration/test_metrics_glossary.py's partial-rollout run measured a gap of 0.26-0.33 there)."""
    path = write(tmp_path, "{}\n")
    partial = ["rollout.partial_rollout=true", "rollout.over_sampling_prompts=8"]
    with pytest.raises(ConfigError, match=r"max_logprob_gap \(0.0001\) must be unset with rollout.partial_rollout"):
        load_config(path, [*partial, "algorithm.max_logprob_gap=1e-4"])
    assert load_config(path, partial).algorithm.max_logprob_gap is None


def test_sync_is_due_every_interval_steps():
    from rlrun.trainer.loop import sync_due

    assert [s for s in range(6) if sync_due(1, s, trained=True)] == [0, 1, 2, 3, 4, 5]
    assert not sync_due(1, 3, trained=False)  # nothing changed since the last sync
    assert [s for s in range(6) if sync_due(3, s, trained=False)] == [2, 5]  # earlier steps may have trained


def test_sync_interval_needs_checkpoints_at_sync_steps(tmp_path):
    path = write(tmp_path, "{}\n")
    with pytest.raises(ConfigError, match=r"checkpoint.save_interval \(5\) must be a multiple of engine.sync_interval"):
        load_config(path, ["engine.sync_interval=2", "checkpoint.save_interval=5"])
    assert load_config(path, ["engine.sync_interval=2", "checkpoint.save_interval=4"]).checkpoint.save_interval == 4


def test_lora_config_and_its_refusals(tmp_path):
    cfg = load_config(REPO / "configs" / "quickstart_lora.yaml")
    lora = cfg.model.lora
    assert lora is not None and (lora.rank, lora.scale, len(lora.target_modules)) == (16, 2.0, 7)
    assert cfg.algorithm.uses_ref and cfg.algorithm.ref.path is None  # the reference: adapters off
    assert load_config(write(tmp_path, "{}\n")).model.lora is None
    assert load_config(write(tmp_path, "{}\n"), ["model.lora.rank=8"]).model.lora.rank == 8  # --set turns it on
    path = write(tmp_path, "model:\n  lora:\n    rank: 4\n")
    for override, key in (("algorithm.ref.path=/x", "path"), ("algorithm.ref.update_interval=5", "update_interval")):
        with pytest.raises(ConfigError, match=rf"algorithm.ref.{key} \(.*\) must be unset with model.lora"):
            load_config(path, [override, "algorithm.kl.loss_coef=0.1"])
    with pytest.raises(ConfigError, match="must list distinct projections"):
        load_config(path, ["model.lora.target_modules=[q_proj, q_proj]"])
    with pytest.raises(ConfigError, match="target_modules"):
        load_config(path, ["model.lora.target_modules=[qkv]"])


def test_a_bare_yaml_off_is_the_tis_mode_off(tmp_path):
    run = write_config(tmp_path / "run.yaml", "algorithm:\n  tis:\n    mode: off\n")
    assert load_config(run).algorithm.tis.mode == "off"
    assert load_config(run, ["algorithm.tis.mode=off"]).algorithm.tis.mode == "off"
    with pytest.raises(ConfigError, match=r"algorithm.tis.mode \(True\) must be 'off', 'clip' or 'mask'"):
        load_config(run, ["algorithm.tis.mode=on"])
