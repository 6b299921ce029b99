"""rlrun's foreach versions of Megatron's multi-tensor fallbacks compute what Megatron's do
(rlrun/megatron/multi_tensor.py), and ``make_optimizer`` installs them."""

from __future__ import annotations

import pytest
import torch

from rlrun.megatron import multi_tensor


@pytest.fixture(scope="module")
def megatron_utils():
    from megatron.core import utils

    return utils


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(shape, generator=g) * scale for shape, scale in [((7, 5), 1.0), ((300,), 1e-3), ((2, 3, 4), 50.0)]
    ]


def test_l2_norm_is_megatrons():
    grads = _grads(0)
    got, _ = multi_tensor.l2_norm(2048, torch.zeros(1, dtype=torch.int), [grads[:1], grads[1:]], False)
    assert got.shape == (1,) and got.dtype == torch.float32
    # megatron.core.utils.local_multi_tensor_l2_norm's formula (it builds its result on "cuda", so not called here)
    megatron = torch.norm(torch.tensor([torch.norm(g).item() for g in grads]))
    torch.testing.assert_close(got[0], megatron, rtol=1e-6, atol=0)
    by_formula = torch.cat([g.reshape(-1).double() for g in grads]).norm()
    assert got.item() == pytest.approx(by_formula.item(), rel=1e-6)


@pytest.mark.parametrize("in_place", [True, False])
def test_scale_is_megatrons(megatron_utils, in_place):
    flag = torch.zeros(1, dtype=torch.int)
    sources = _grads(1)
    got_targets = sources if in_place else [torch.empty_like(s, dtype=torch.bfloat16) for s in sources]
    want_targets = [t.clone() for t in (sources if in_place else got_targets)]
    want_sources = [s.clone() for s in sources]
    megatron_utils.local_multi_tensor_scale(
        2048, flag, [want_sources, want_targets if not in_place else want_sources], 0.37
    )
    multi_tensor.scale(2048, flag, [sources, got_targets], 0.37)
    for got, want in zip(got_targets, want_sources if in_place else want_targets, strict=True):
        assert torch.equal(got, want)


def test_scale_of_no_tensors_does_nothing():
    """A rank without gradients clips nothing; torch's foreach ops refuse empty lists, Megatron's loop did not."""
    multi_tensor.scale(2048, torch.zeros(1, dtype=torch.int), [[], []], 0.5)


def test_make_optimizer_installs_them(megatron_utils):
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    multi_tensor.patch_multi_tensor()
    multi_tensor.patch_multi_tensor()  # idempotent
    assert clip_grads.l2_norm_impl is multi_tensor.l2_norm
    assert clip_grads.multi_tensor_scale_impl is multi_tensor.scale
    assert megatron_optimizer.multi_tensor_scale_impl is multi_tensor.scale
