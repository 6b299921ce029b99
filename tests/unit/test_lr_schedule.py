"""``optimizer.lr_*``: the LR of every step equals the schedule's formula, written out here independently:

    warmup (s <= W, W > 0):   lr * s / W
    constant:                 lr
    after D:                  min_lr
    linear:                   min_lr + (lr - min_lr) * (1 - r)            r = (s - W) / (D - W)
    cosine:                   min_lr + (lr - min_lr) * (1 + cos(pi r)) / 2

and the scheduler applies it to every param group of the optimizer (whatever LR bounds the group came with),
with each group's weight-decay multiplier.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlrun.config.schema import OptimizerConfig
from rlrun.megatron.train import make_scheduler


def formula(s: int, lr: float, min_lr: float, warmup: int, decay: int, style: str) -> float:
    if warmup > 0 and s <= warmup:
        return lr * s / warmup
    if style == "constant":
        return lr
    if s > decay:
        return min_lr
    r = (s - warmup) / (decay - warmup)
    coeff = 1 - r if style == "linear" else (1 + math.cos(math.pi * r)) / 2
    return min_lr + (lr - min_lr) * coeff


def optimizer() -> torch.optim.Optimizer:
    """Two groups with the keys ``get_megatron_optimizer`` gives them (bounds as make_optimizer sets them)."""
    weights, biases = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    megatron = {"lr_mult": 1.0, "max_lr": 1.0, "min_lr": 1.0}
    return torch.optim.SGD(
        [{"params": [weights], "wd_mult": 1.0, **megatron}, {"params": [biases], "wd_mult": 0.0, **megatron}], lr=1.0
    )


@pytest.mark.parametrize(
    "style,warmup,decay",
    [("constant", 0, None), ("constant", 3, None), ("linear", 2, 8), ("cosine", 3, None), ("cosine", 0, 5)],
)
def test_every_step_follows_the_formula(style, warmup, decay):
    num_steps = 10
    cfg = OptimizerConfig(
        lr=2e-3, min_lr=1e-4, weight_decay=0.1, lr_warmup_steps=warmup, lr_decay_style=style, lr_decay_steps=decay
    )
    opt = optimizer()
    scheduler = make_scheduler(opt, cfg, num_steps)
    for s in range(num_steps + 2):  # past decay: min_lr
        want = formula(s, 2e-3, 1e-4, warmup, decay or num_steps, style)
        assert scheduler.get_lr(opt.param_groups[0]) == pytest.approx(want, rel=1e-12, abs=1e-15), s
        assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12, abs=1e-15)
        assert opt.param_groups[1]["lr"] == pytest.approx(want, rel=1e-12, abs=1e-15)
        assert [g["weight_decay"] for g in opt.param_groups] == pytest.approx([0.1, 0.0])
        scheduler.step(1)


def test_default_is_todays_constant_lr_without_warmup():
    cfg = OptimizerConfig(lr=3e-4)
    assert (cfg.lr_warmup_steps, cfg.lr_decay_style, cfg.use_distributed_optimizer) == (0, "constant", False)
    opt = optimizer()
    scheduler = make_scheduler(opt, cfg, num_steps=3)
    for _ in range(4):
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([3e-4, 3e-4])
        scheduler.step(1)


def test_state_round_trip_continues_the_schedule():
    cfg = OptimizerConfig(lr=1e-3, lr_warmup_steps=2, lr_decay_style="cosine", lr_decay_steps=6)
    first = make_scheduler(optimizer(), cfg, 6)
    for _ in range(3):
        first.step(1)
    opt = optimizer()
    second = make_scheduler(opt, cfg, 6)
    second.load_state_dict(first.state_dict())
    assert opt.param_groups[0]["lr"] == pytest.approx(formula(3, 1e-3, 0.0, 2, 6, "cosine"))


def test_decay_must_end_after_warmup():
    with pytest.raises(ValueError, match=r"optimizer.lr_decay_steps \(4\) must exceed optimizer.lr_warmup_steps \(4\)"):
        make_scheduler(optimizer(), OptimizerConfig(lr_warmup_steps=4, lr_decay_style="linear"), num_steps=4)
    with pytest.raises(ValueError, match="lr_decay_style"):
        OptimizerConfig(lr_decay_style="exponential")
