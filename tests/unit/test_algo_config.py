"""The ``algorithm`` config: incompatible combinations and hook paths fail at load time with the
key, the path and the expected signature; per-rank advantages (KL reward, OPD, whitening, custom)."""

import statistics
import textwrap
import threading

import pytest
import torch

from rlrun.algo.rank_advantages import assign_advantages
from rlrun.config import ConfigError, load_config
from rlrun.config.schema import AlgorithmConfig
from rlrun.data.batch import MicroBatch


def error_of(tmp_path, algorithm_yaml: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n" + textwrap.indent(textwrap.dedent(algorithm_yaml), "  "))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


@pytest.mark.parametrize(
    "yaml_text, expected",
    [
        (
            "kl:\n  loss_coef: 0.1\n  reward_coef: 0.1\n",
            "algorithm.kl.reward_coef (0.1) must be 0 when algorithm.kl.loss_coef",
        ),
        ("advantage_estimator: reinforce_plus_plus\n", "algorithm.normalize_advantages (False) must be true"),
        ("advantage_estimator: ppo\n", "algorithm.advantage_estimator (ppo) must come with algorithm.custom_advantage"),
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
        ("eps_clip_c: 0.5\n", "algorithm.eps_clip_c (0.5) must be greater than 1"),
        ("kl:\n  estimator: k4\n", "algorithm.kl.estimator ('k4') must be 'k1', 'k2', 'k3' or 'low_var_kl'"),
    ],
)
def test_incompatible_settings_fail_at_load(tmp_path, yaml_text, expected):
    message = error_of(tmp_path, yaml_text)
    assert expected in message, message
    assert message.startswith(f"{tmp_path / 'run.yaml'}:")


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
    missing = error_of(tmp_path, f"{field}: {tmp_path}/nope.py:f\n")
    assert f"algorithm.{field} ('{tmp_path}/nope.py:f') must name a function with signature {signature}" in missing
    assert "does not exist" in missing or "not found" in missing
    wrong = error_of(tmp_path, f"{field}: {hook}:one_arg\n")
    assert f"signature {signature}, but it takes (x)" in wrong
    assert error_of(tmp_path, f"{field}: {hook}:absent\n").count("has no attribute 'absent'") == 1


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
    from rlrun.config.schema import RunConfig

    opd = {"teacher_path": "t", "kl_coef": 0.1, "teacher_engine": "embedded"}
    cfg = RunConfig.model_validate({"algorithm": {"opd": opd}})
    assert cfg.algorithm.uses_teacher and not cfg.algorithm.swaps_teacher
    with pytest.raises(ValueError, match=r"teacher_engine \(embedded\) must come with algorithm.opd.kl_coef > 0"):
        RunConfig.model_validate({"algorithm": {"opd": {"teacher_engine": "embedded"}}})
    with pytest.raises(ValueError, match=r"engine.tp \(2\) must be 1 with algorithm.opd.teacher_engine"):
        RunConfig.model_validate({"algorithm": {"opd": opd}, "engine": {"tp": 2}})
    sglang = {**opd, "teacher_engine": "sglang"}
    assert RunConfig.model_validate({"algorithm": {"opd": sglang}}).algorithm.opd.teacher_engine == "sglang"
    with pytest.raises(ValueError, match=r"rollout.temperature \(0.7\) must be 1 with algorithm.opd.teacher_engine"):
        RunConfig.model_validate({"algorithm": {"opd": sglang}, "rollout": {"temperature": 0.7}})
    with pytest.raises(ValueError, match=r"teacher_server_args \(\{'max_running_requests': 8\}\) must be empty"):
        RunConfig.model_validate({"algorithm": {"opd": {**opd, "teacher_server_args": {"max_running_requests": 8}}}})
