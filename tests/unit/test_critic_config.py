"""The critic config file: overrides land on a copy of the actor's settings; every mistake fails at load
with the key, the file and the fix."""

from __future__ import annotations

import pytest

from minimal_config import write_config
from rlrun.config import load_config, read_config
from rlrun.config.load import ConfigError
from rlrun.preflight import preflight
from rlrun.preflight.critic import load_critic_config

PPO = "algorithm:\n  advantage_estimator: ppo\ncritic:\n  config: {critic}\noptimizer:\n  lr: 2.0e-5\n"


def checked(run, overrides=()):
    """What ``rlrun config validate`` / ``train`` do: load, then the preflight (which reads the critic's file)."""
    return preflight(read_config(run, overrides))


def write(tmp_path, critic_yaml: str, run_yaml: str = PPO):
    critic = tmp_path / "critic.yaml"
    critic.write_text(critic_yaml)
    run = write_config(tmp_path / "run.yaml", run_yaml.format(critic=critic))
    return run, critic


@pytest.mark.parametrize(
    "overrides",
    [
        "    overrides:\n      optimizer.lr: 1.0e-3\n      model.path: /elsewhere\n",
        "    overrides:\n      optimizer:\n        lr: 1.0e-3\n      model:\n        path: /elsewhere\n",
    ],
)
def test_overrides_apply_to_a_copy_of_the_actor(tmp_path, overrides):
    run, _ = write(tmp_path, "models:\n  - role: actor\n  - role: critic\n" + overrides)
    cfg = load_config(run)
    critic = load_critic_config(cfg)
    assert critic.optimizer.lr == 1e-3 and critic.model.path == "/elsewhere"
    assert critic.optimizer.clip_grad == cfg.optimizer.clip_grad and critic.parallel == cfg.parallel
    assert cfg.optimizer.lr == 2e-5 and cfg.model.path != "/elsewhere"  # the actor keeps its own settings


def test_critic_without_overrides_is_the_actor_copy(tmp_path):
    run, _ = write(tmp_path, "models:\n  - role: critic\n")
    cfg = load_config(run)
    critic = load_critic_config(cfg)
    assert (critic.model, critic.optimizer, critic.parallel) == (cfg.model, cfg.optimizer, cfg.parallel)


@pytest.mark.parametrize(
    "critic_yaml, expected",
    [
        (
            "models:\n  - role: critic\n    overrides:\n      parallel.tp: 2\n",
            "the critic's parallel layout (tp=2 pp=1) must equal the actor's (tp=1 pp=1) because the critic shares",
        ),
        ("models:\n  - role: critic\n  - role: critic\n", "roles (['critic', 'critic']) must be one 'critic'"),
        ("models:\n  - role: reward\n", "roles (['reward']) must be one 'critic'"),
        (
            "models:\n  - role: critic\n    overrides:\n      rollout.temperature: 0.5\n",
            "critic overrides (['rollout.temperature']) must be under model, optimizer, parallel",
        ),
        (
            "models:\n  - role: actor\n    overrides:\n      optimizer.lr: 1.0\n  - role: critic\n",
            "actor overrides ({'optimizer.lr': 1.0}) must be empty because the actor is the run config itself",
        ),
        (
            "models:\n  - role: critic\n    overrides:\n      optimizer.lr: -1\n",
            "critic override optimizer.lr (-1) is invalid: Input should be greater than 0",
        ),
        ("models:\n  - role: critic\n    lr: 1\n", "entry keys (['lr']) must be role or overrides"),
        ("critic: {}\n", "must hold 'models:', a list of {role, overrides} entries"),
    ],
)
def test_bad_critic_files_fail_at_preflight(tmp_path, critic_yaml, expected):
    run, critic = write(tmp_path, critic_yaml)
    with pytest.raises(ConfigError) as info:
        checked(run)
    message = str(info.value)
    lines = [line for line in message.splitlines() if line.startswith(f"{run}:4: ")]  # the critic.config line
    assert len(lines) == 1 and expected in lines[0] and f"critic.config ('{critic}')" in lines[0], message


def test_ppo_needs_a_critic_and_a_critic_needs_ppo(tmp_path):
    run = write_config(tmp_path / "run.yaml", "algorithm:\n  advantage_estimator: ppo\n")
    with pytest.raises(ConfigError, match=r"advantage_estimator \(ppo\) must come with .*critic.config"):
        checked(run)
    _, critic = write(tmp_path, "models:\n  - role: critic\n")
    write_config(run, f"critic:\n  config: {critic}\n")
    with pytest.raises(ConfigError, match=r"critic.config \('.*'\) must be unset for advantage_estimator grpo"):
        checked(run)
    with pytest.raises(ConfigError, match=r"critic.config \(/no/such.yaml\) must name an existing file"):
        checked(run, ["algorithm.advantage_estimator=ppo", "critic.config=/no/such.yaml"])


def test_the_actors_lora_is_not_the_critics(tmp_path):
    run, critic_path = write(tmp_path, "models:\n  - role: critic\n", PPO + "model:\n  lora:\n    rank: 4\n")
    cfg = load_config(run)
    assert cfg.model.lora is not None and load_critic_config(cfg).model.lora is None  # the critic trains it all
    critic_path.write_text("models:\n  - role: critic\n    overrides:\n      model.lora.rank: 8\n")
    with pytest.raises(ConfigError, match=r"critic overrides \(\['model.lora.rank'\]\) must not set model.lora"):
        checked(run)
