"""The ``algorithm`` config: incompatible combinations fail in the schema or in ``algorithm_problems`` (what
needs rlrun/algo's tables) with the key; hook paths with the key, the path and the expected signature;
per-rank advantages (KL reward, OPD, whitening, custom)."""

import statistics
import textwrap
import threading

import pytest
import torch
import yaml
from pydantic import ValidationError

from minimal_config import run_config
from rlrun.algo.rank_advantages import assign_advantages
from rlrun.algo.validate import algorithm_problems, load_algorithm_hook
from rlrun.config.schema import AlgorithmConfig, CriticConfig, RunConfig
from rlrun.data.batch import MicroBatch


def schema_error(algorithm_yaml: str) -> str:
    """The schema's refusal of an ``algorithm`` section (its own fields' combinations)."""
    with pytest.raises(ValidationError) as info:
        AlgorithmConfig.model_validate(yaml.safe_load(textwrap.dedent(algorithm_yaml)))
    return str(info.value)


def problems_of(algorithm_yaml: str, critic_config: str | None = None) -> list[tuple[str, str]]:
    """``algorithm_problems`` (what needs rlrun/algo's tables) of a run with this ``algorithm`` section."""
    algorithm = AlgorithmConfig.model_validate(yaml.safe_load(textwrap.dedent(algorithm_yaml)))
    return algorithm_problems(RunConfig.model_construct(algorithm=algorithm, critic=CriticConfig(config=critic_config)))


@pytest.mark.parametrize(
    "yaml_text, expected",
    [
        (
            "kl:\n  loss_coef: 0.1\n  reward_coef: 0.1\n",
            "algorithm.kl.reward_coef (0.1) must be 0 when algorithm.kl.loss_coef",
        ),
        (
            "use_rollout_logprobs: true\ntis:\n  mode: clip\n",
            "algorithm.tis.mode (clip) must be off with use_rollout_logprobs",
        ),
        ("ref:\n  update_interval: 5\n", "algorithm.ref must stay unset when no KL term is on"),
        (
            "opd:\n  kl_coef: 0.5\n",
            "algorithm.opd.teacher_path (None) and algorithm.opd.kl_coef (0.5) must be set together",
        ),
        ("loss_type: custom\n", "algorithm.custom_loss (None) must be set exactly when loss_type is custom"),
        (
            "tis:\n  mode: clip\n  clip: 1.0\n  clip_low: 2.0\n",
            "algorithm.tis.clip_low (2.0) must be < algorithm.tis.clip",
        ),
        ("eps_clip_c: 0.5\n", "Input should be greater than 1"),
        ("kl:\n  estimator: k4\n", "Input should be 'k1', 'k2', 'k3' or 'low_var_kl'"),
    ],
)
def test_incompatible_fields_fail_in_the_schema(yaml_text, expected):
    message = schema_error(yaml_text)
    assert expected in message, message


@pytest.mark.parametrize(
    "yaml_text, critic, key, expected",
    [
        (
            "advantage_estimator: reinforce_plus_plus\n",
            None,
            "algorithm.normalize_advantages",
            "algorithm.normalize_advantages (False) must be true for advantage_estimator reinforce_plus_plus",
        ),
        (
            "advantage_estimator: ppo\n",
            None,
            "algorithm.advantage_estimator",
            "algorithm.advantage_estimator (ppo) must come with algorithm.custom_advantage or critic.config",
        ),
        (
            "advantage_estimator: grpo\n",
            "critic.yaml",
            "critic.config",
            "critic.config ('critic.yaml') must be unset for advantage_estimator grpo",
        ),
        (
            "advantage_estimator: {name: reinforce_plus_plus_baseline}\nnormalize_advantages: true\n",
            None,
            None,
            None,
        ),
    ],
)
def test_what_an_estimator_needs_is_checked_with_algos_table(yaml_text, critic, key, expected):
    problems = problems_of(yaml_text, critic)
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0][0] == key and problems[0][1].startswith(expected), problems


@pytest.mark.parametrize(
    "field, signature",
    [
        ("custom_advantage", "fn(cfg: AlgorithmConfig, mb: MicroBatch, kl: Tensor) -> (advantages, returns)"),
        ("rollout_data_postprocess", "fn(cfg: AlgorithmConfig, step: int, micro_batches: list[MicroBatch]) -> None"),
    ],
)
def test_hook_errors_name_key_path_and_signature(tmp_path, field, signature):
    hook = tmp_path / "hooks.py"
    hook.write_text("def one_arg(x):\n    return x\n")

    def error_of(spec: str) -> str:
        with pytest.raises(ValueError) as info:
            load_algorithm_hook(AlgorithmConfig.model_validate({field: spec}), field)
        return str(info.value)

    missing = error_of(f"{tmp_path}/nope.py:f")
    assert f"algorithm.{field} ('{tmp_path}/nope.py:f') must name a function with signature {signature}" in missing
    assert "does not exist" in missing or "not found" in missing
    assert f"signature {signature}, but it takes (x)" in error_of(f"{hook}:one_arg")
    assert error_of(f"{hook}:absent").count("has no attribute 'absent'") == 1


def micro_batch(scores_per_row, lengths, old=None, ref=None, teacher=None):
    mask = torch.zeros(len(lengths), 6)
    scores = torch.zeros(len(lengths), 6)
    for i, ((p, r), s) in enumerate(zip(lengths, scores_per_row, strict=False)):
        mask[i, p : p + r] = 1
        scores[i, p : p + r] = s
    return MicroBatch(
        tokens=torch.zeros(len(lengths), 7, dtype=torch.long),
        position_ids=torch.arange(7).expand(len(lengths), 7),
        loss_mask=mask,
        advantages=scores,
        rollout_logprobs=torch.zeros_like(mask),
        old_logprobs=old,
        ref_logprobs=ref,
        teacher_logprobs=teacher,
    )


def test_kl_reward_and_opd_penalties_on_grpo_advantages():
    gen = torch.Generator().manual_seed(0)
    old, ref, teacher = (-torch.rand(2, 6, generator=gen) for _ in range(3))
    mb = micro_batch([0.5, -1.0], [(1, 3), (0, 5)], old=old, ref=ref, teacher=teacher)
    cfg = AlgorithmConfig(kl={"reward_coef": 0.2, "estimator": "k1"}, opd={"teacher_path": "t", "kl_coef": 0.3})
    metrics = assign_advantages(cfg, [mb], dp_sum=lambda t: t)
    for i, ((p, r), s) in enumerate(zip([(1, 3), (0, 5)], [0.5, -1.0], strict=False)):
        for t in range(6):
            expected = 0.0
            if p <= t < p + r:
                expected = s - 0.2 * (old[i, t] - ref[i, t]).item() - 0.3 * (old[i, t] - teacher[i, t]).item()
            assert mb.advantages[i, t].item() == pytest.approx(expected, abs=1e-6)
    tokens = [(i, t) for i, (p, r) in enumerate([(1, 3), (0, 5)]) for t in range(p, p + r)]
    assert metrics["train/kl_reward"] == pytest.approx(
        sum((old[i, t] - ref[i, t]).item() for i, t in tokens) / 8, rel=1e-5
    )


class ThreadDPSum:
    """A sum over 'ranks' that are threads: every rank calls it in the same order, each call returns
    the sum of all ranks' tensors (what an all-reduce does)."""

    def __init__(self, num_ranks: int) -> None:
        self.barrier = threading.Barrier(num_ranks)
        self.slots: list[torch.Tensor | None] = [None] * num_ranks

    def for_rank(self, rank: int):
        def dp_sum(tensor: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            total = sum(self.slots)
            self.barrier.wait()  # nobody overwrites a slot before everyone has read it
            return total

        return dp_sum


def test_reinforce_plus_plus_whitens_over_all_ranks():
    """Two ranks' advantages are whitened with the statistics of their union."""
    mbs = [micro_batch([1.0, 0.0], [(0, 3), (2, 2)]), micro_batch([2.0], [(1, 4)])]
    cfg = AlgorithmConfig(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, gamma=0.5)
    reduce = ThreadDPSum(2)
    threads = [
        threading.Thread(target=assign_advantages, args=(cfg, [mb], reduce.for_rank(rank)))
        for rank, mb in enumerate(mbs)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    # independent reference: returns by hand (gamma 0.5, score on the last token), then whitened together
    raw = {0: [0.25, 0.5, 1.0], 1: [0.0, 0.0], 2: [0.25, 0.5, 1.0, 2.0]}
    union = [v for row in raw.values() for v in row]
    mean, std = statistics.mean(union), statistics.stdev(union)
    got = [mbs[0].advantages[0, 0:3], mbs[0].advantages[1, 2:4], mbs[1].advantages[0, 1:5]]
    for row, values in zip(raw.values(), got, strict=False):
        assert values.tolist() == pytest.approx([(v - mean) / std for v in row], abs=1e-5)


def test_custom_advantage_must_return_advantages_and_returns(tmp_path):
    hook = tmp_path / "adv.py"
    hook.write_text(
        "def double(cfg, mb, kl):\n    return 2 * mb.advantages, mb.advantages\n"
        "def forgot(cfg, mb, kl):\n    mb.advantages = mb.advantages * 2\n"
    )
    mb = micro_batch([0.5], [(1, 3)])
    assign_advantages(AlgorithmConfig(custom_advantage=f"{hook}:double"), [mb], dp_sum=lambda t: t)
    assert mb.advantages[0, 1:4].tolist() == [1.0, 1.0, 1.0] and mb.returns[0, 1:4].tolist() == [0.5] * 3
    with pytest.raises(
        ValueError,
        match=r"algorithm.custom_advantage \('.*adv.py:forgot'\) must return "
        r"\(advantages, returns\).*returned NoneType.*Expected signature",
    ):
        assign_advantages(
            AlgorithmConfig(custom_advantage=f"{hook}:forgot"), [micro_batch([0.5], [(1, 3)])], dp_sum=lambda t: t
        )


def test_teacher_engine_refusals():
    required = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "rollout": {"reward": "exact_match"}}

    def run(**sections):
        return run_config({**required, **sections, "rollout": {**required["rollout"], **sections.get("rollout", {})}})

    opd = {"teacher_path": "t", "kl_coef": 0.1, "teacher_engine": "embedded"}
    cfg = run(algorithm={"opd": opd})
    assert cfg.algorithm.uses_teacher and not cfg.algorithm.swaps_teacher
    with pytest.raises(ValueError, match=r"teacher_engine \(embedded\) must come with algorithm.opd.kl_coef > 0"):
        run(algorithm={"opd": {"teacher_engine": "embedded"}})
    with pytest.raises(ValueError, match=r"engine.tp \(2\) must be 1 with algorithm.opd.teacher_engine"):
        run(algorithm={"opd": opd}, engine={"tp": 2})
    sglang = {**opd, "teacher_engine": "sglang"}
    assert run(algorithm={"opd": sglang}).algorithm.opd.teacher_engine == "sglang"
    # the SGLang teacher's own refusals (temperature, server args) need the backend: rlrun.preflight.engine's
