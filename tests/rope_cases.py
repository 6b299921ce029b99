"""The RoPE comparison that tests/integration/test_rope_apply.py (CPU) and tests/gpu/test_rope_apply_gpu.py (CUDA,
the Triton rotation) run: Megatron's own unfused functions against rlrun's patched ones, bit for bit."""

from __future__ import annotations

import torch


def rotations(head_dim: int, rot_dim: int, dtype_name: str, exact_mapping: bool, device: str = "cpu") -> dict:
    """Megatron's functions against the patched ones (rlrun/megatron/rope_apply.py) on the same inputs on
    ``device``, in a one-rank gloo world (the ``thd`` path asks its context-parallel group for its size); with
    ``kernel_calls``, how often the Triton rotation ran (CUDA)."""
    import torch.distributed as dist
    from megatron.core.models.common.embeddings import rope_utils

    from rlrun.megatron import rope_apply
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
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    inv_freq = 1e4 ** -(torch.arange(0, rot_dim, 2).float() / rot_dim)
    rows = tokens if exact_mapping else 32
    angles = torch.arange(rows).float()[:, None] * inv_freq
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :].to(device)  # Megatron's [S, 1, 1, rot_dim]

    def run(bshd, thd, layout: str, mscale: float):
        rope_utils._apply_rotary_pos_emb_bshd, rope_utils._apply_rotary_pos_emb_thd = bshd, thd
        try:
            x = (3 * torch.randn(tokens, 4, head_dim, generator=torch.Generator().manual_seed(1))).to(device, dtype)
            if layout == "bshd":
                x = x[:16].reshape(4, 4, 4, head_dim)  # [S, B, H, D]
            x.requires_grad_()
            grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
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

    kernel_calls = []
    rotate = rope_apply._Rotate.apply
    rope_apply._Rotate.apply = lambda *args: kernel_calls.append(1) or rotate(*args)
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
    rope_apply._Rotate.apply = rotate
    dist.destroy_process_group()
    return {"cases": results, "kernel_calls": len(kernel_calls)}
