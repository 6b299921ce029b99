"""rlrun/megatron/rope_apply.py rotates queries and keys bitwise as Megatron's own unfused RoPE does, forward and
backward, for packed (``thd``) rows and per-sample (``bshd``) rows, and hands what it does not cover to Megatron."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed


def _rotations(head_dim: int, rot_dim: int, dtype_name: str, exact_mapping: bool) -> dict:
    """Megatron's functions against the patched ones on the same inputs, in a one-rank gloo world (the ``thd``
    path asks its context-parallel group for its size)."""
    import torch.distributed as dist
    from megatron.core.models.common.embeddings import rope_utils

    from rlrun.megatron.rope_apply import patch_rope

    patch_rope()
    patch_rope()  # idempotent: the originals stay Megatron's
    ours_bshd, ours_thd = rope_utils._apply_rotary_pos_emb_bshd, rope_utils._apply_rotary_pos_emb_thd
    theirs_bshd, theirs_thd = ours_bshd.megatron, ours_thd.megatron
    assert not getattr(theirs_bshd, "rlrun", False)
    dist.init_process_group("gloo")  # run_distributed's environment
    group = dist.new_group([0])
    dtype = getattr(torch, dtype_name)
    lengths = [5, 1, 17, 9, 12]
    tokens = sum(lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inv_freq = 1e4 ** -(torch.arange(0, rot_dim, 2).float() / rot_dim)
    rows = tokens if exact_mapping else 32
    angles = torch.arange(rows).float()[:, None] * inv_freq
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # Megatron's [S, 1, 1, rot_dim]

    def run(bshd, thd, layout: str, mscale: float):
        rope_utils._apply_rotary_pos_emb_bshd, rope_utils._apply_rotary_pos_emb_thd = bshd, thd
        try:
            x = (3 * torch.randn(tokens, 4, head_dim, generator=torch.Generator().manual_seed(1))).to(dtype)
            if layout == "bshd":
                x = x[:16].reshape(4, 4, 4, head_dim)  # [S, B, H, D]
            x.requires_grad_()
            grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
            config = type("Config", (), {"apply_rope_fusion": False, "rotary_interleaved": False,
                                         "multi_latent_attention": False, "mrope_section": None})()  # fmt: skip
            if layout == "thd":
                out = rope_utils.apply_rotary_pos_emb(x, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale,
                                                      cp_group=group)  # fmt: skip
                again = rope_utils.apply_rotary_pos_emb(
                    x, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=group
                )  # fmt: skip  (the cached path)
            else:
                out = rope_utils.apply_rotary_pos_emb(x, freqs[:4], config, mscale=mscale, cp_group=group)
                again = rope_utils.apply_rotary_pos_emb(x, freqs[:4], config, mscale=mscale, cp_group=group)
            (out * grad).sum().backward()
            return out.detach(), again.detach(), x.grad, x.detach()
        finally:
            rope_utils._apply_rotary_pos_emb_bshd, rope_utils._apply_rotary_pos_emb_thd = ours_bshd, ours_thd

    results = {}
    for layout in ("thd", "bshd"):
        for mscale in (1.0, 0.7):
            want = run(theirs_bshd, theirs_thd, layout, mscale)
            got = run(ours_bshd, ours_thd, layout, mscale)
            results[f"{layout}_{mscale}"] = {
                "forward": torch.equal(got[0], want[0]),
                "cached": torch.equal(got[1], want[0]),
                "backward": torch.equal(got[2], want[2]),
                "rotated": not torch.allclose(want[0].float(), want[3].float()),  # the check can see a rotation
            }
    dist.destroy_process_group()
    return results


@pytest.mark.parametrize(
    ("head_dim", "rot_dim", "dtype", "exact_mapping"),
    [(64, 64, "bfloat16", False), (64, 64, "float32", False), (64, 64, "bfloat16", True), (64, 32, "bfloat16", False)],
)
def test_rotations_are_megatrons_bit_for_bit(head_dim, rot_dim, dtype, exact_mapping):
    results = run_distributed(_rotations, 1, head_dim, rot_dim, dtype, exact_mapping)
    for case, checks in results.items():
        assert all(checks.values()), (case, checks)
