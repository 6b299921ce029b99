"""Which attention kernel makes a trainer-style forward agree with the embedded engine (GPU, bf16).

The engine (rlrun's EmbeddedEngine) samples responses with its log-probs; then the same weights, loaded a
second time in transformers with a probe attention function, score the packed samples the way the trainer
does (one row, positions restarting per sample) with each candidate kernel. Reported per candidate: mean and
max |trainer - engine| log-prob and the fraction of tokens that agree bitwise. Two engine kernels (the shared
memory-efficient one, and SDPA's own choice, the engine before rlrun.kernels.attention) and two prompt sets
(equal lengths, as the quickstart's; mixed lengths, which the engine left-pads). Also times forward+backward
of the varlen kernels on larger packed rows.

  python3 scripts/gpu/onpolicy_probe.py MODEL_DIR OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, AutoModelForCausalLM

from rlrun.engine.embedded import static_cache
from rlrun.engine.embedded.engine import EmbeddedEngine
from rlrun.engine.embedded.fused_norm import fuse_rms_norms
from rlrun.kernels import attention as attention_kernel

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
STATE: dict = {}
DEVICE = os.environ.get("PROBE_DEVICE", "cuda")  # "cpu": a smoke run of this script only


def probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """[1, H, T, D] packed row -> [1, T, H, D] with STATE's kernel and sample bounds."""
    kernel, bounds = STATE["kernel"], STATE["bounds"]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]
    cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    max_len = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    if kernel == "efficient_varlen":
        out = attention_kernel.causal_varlen(q, k, v, cu, max_len, scaling)
    elif kernel == "flash_varlen":
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scaling
        )[0]
    else:  # per sample, through SDPA with one backend allowed (or its own choice)
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
            if kernel == "shared_per_sample":
                o = attention_kernel.causal(qs, ks, vs, scaling)
            elif kernel == "sdpa_default":
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling, enable_gqa=True)
            else:
                with sdpa_kernel([BACKENDS[kernel]]):
                    if kernel in ("efficient", "cudnn"):
                        ks, vs = (t.repeat_interleave(qs.shape[1] // t.shape[1], dim=1) for t in (ks, vs))
                    o = F.scaled_dot_product_attention(
                        qs, ks, vs, is_causal=True, scale=scaling, enable_gqa=ks.shape[1] != qs.shape[1]
                    )
            outs.append(o[0].transpose(0, 1))
        out = torch.cat(outs)
    return out[None], None


def sdpa_masked(query, key, value, mask, scale=None, bias=None):
    """The engine's attention before rlrun.kernels.attention: SDPA's own kernel choice under the mask (``bias``,
    the shared kernel's additive form of the mask, unused)."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)


def trainer_logprobs(model, samples, kernel):
    """Per-token log-probs of each sample's response, scoring all samples in one packed row."""
    ids, positions, bounds = [], [], [0]
    for prompt, out in samples:
        seq = prompt + out
        ids += seq
        positions += list(range(len(seq)))
        bounds.append(bounds[-1] + len(seq))
    STATE.update(kernel=kernel, bounds=bounds)
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([ids], device=DEVICE), position_ids=torch.tensor([positions], device=DEVICE)
        ).logits[0]
    logp = torch.log_softmax(logits.float(), -1)
    result = []
    for (prompt, out), start in zip(samples, bounds[:-1], strict=True):
        first = start + len(prompt) - 1  # the position whose logits predict the first response token
        rows = torch.arange(first, first + len(out), device=DEVICE)
        result.append(logp[rows, torch.tensor(out, device=DEVICE)])
    return torch.cat(result)


def compare(engine_lp, trainer_lp):
    diff = (trainer_lp - engine_lp).abs()
    return {
        "mean_gap": diff.mean().item(),
        "max_gap": diff.max().item(),
        "bitwise_frac": (diff == 0).float().mean().item(),
        "tokens": diff.numel(),
    }


def prompt_sets(tokenizer):
    gen = torch.Generator().manual_seed(0)
    rows = [json.loads(line) for line in open("configs/data/addition_train.jsonl")][:16]
    equal = (
        [torch.randint(10, 250, (24,), generator=gen).tolist() for _ in rows]
        if tokenizer is None
        else [
            tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True)
            for r in rows
        ]
    )
    equal = [p if isinstance(p, list) else p["input_ids"] for p in equal]
    mixed = [
        torch.randint(10, 250 if DEVICE == "cpu" else 40000, (int(n),), generator=gen).tolist()
        for n in torch.randint(5, 150, (16,), generator=gen)
    ]
    return {"equal_len_24tok_8new": (equal, 8), "mixed_len_5_150tok_64new": (mixed, 64)}


def time_varlen(heads, kv_heads, dim, lengths, kernel, repeats=20):
    tokens = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    leaves = [
        torch.randn(tokens, h, dim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    ]
    grad = torch.randn(tokens, heads, dim, device=DEVICE, dtype=torch.bfloat16)

    def step():
        q, k, v = leaves
        if kernel == "efficient_varlen":
            out = attention_kernel.causal_varlen(q, k, v, cu, max(lengths))
        else:
            out = torch.ops.aten._flash_attention_forward(
                q, k, v, cu, cu, max(lengths), max(lengths), 0.0, True, False
            )[0]
        out.backward(grad)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def random_smollm2(path):
    """A random-init model of SmolLM2-135M's shape (no tokenizer): kernel agreement without the real weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=2048,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def main(model_dir, out_path):
    if model_dir == "random-smollm2":
        model_dir = random_smollm2("/tmp/random-smollm2")
    if DEVICE == "cpu":
        return smoke(model_dir, out_path)
    info = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name()}
    q = torch.randn(32, 3, 3, 64, device=DEVICE, dtype=torch.bfloat16)
    kv = torch.randn(32, 3, 128, 64, device=DEVICE, dtype=torch.bfloat16)
    mask = torch.ones(32, 1, 1, 128, dtype=torch.bool, device=DEVICE)
    qs, ks = (
        torch.randn(1, 9, 32, 64, device=DEVICE, dtype=torch.bfloat16),
        torch.randn(1, 3, 32, 64, device=DEVICE, dtype=torch.bfloat16),
    )
    info["sdpa_choice_engine_decode"] = int(torch._fused_sdp_choice(q, kv, kv, mask))
    info["sdpa_choice_engine_prefill"] = int(
        torch._fused_sdp_choice(qs, qs, qs, torch.ones(1, 1, 32, 32, dtype=torch.bool, device=DEVICE).tril())
    )
    info["sdpa_choice_trainer_per_sample"] = int(torch._fused_sdp_choice(qs, ks, ks, None, 0.0, True, enable_gqa=True))
    info["sdpa_backend_ids"] = {name: int(b) for name, b in BACKENDS.items()}
    print(json.dumps(info), flush=True)

    results = {"info": info, **gaps(model_dir)}
    results["varlen_fwd_bwd_s"] = {}
    for name, shape in {
        "smollm2_128x40": (9, 3, 64, [40] * 128),
        "qwen3-0.6b_128x640": (16, 8, 128, [640] * 128),
    }.items():
        for kernel in ("efficient_varlen", "flash_varlen"):
            results["varlen_fwd_bwd_s"][f"{name}/{kernel}"] = time_varlen(*shape[:3], shape[3], kernel)
    print(json.dumps(results["varlen_fwd_bwd_s"]), flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


def smoke(model_dir, out_path):
    with open(out_path, "w") as f:
        json.dump(gaps(model_dir), f, indent=1)


def gaps(model_dir):
    AttentionInterface.register("rlrun_probe", probe_attention)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="rlrun_probe")
    trainer = trainer.to(DEVICE).eval()
    fuse_rms_norms(trainer)
    engine = EmbeddedEngine(model_dir, dtype="bfloat16" if DEVICE == "cuda" else "float32", device=DEVICE, seed=0)
    results = {"gaps": {}}
    kernels = [
        "efficient_varlen",
        "shared_per_sample",
        "flash_varlen",
        "sdpa_default",
        "flash",
        "efficient",
        "cudnn",
        "math",
    ]
    for set_name, (prompts, new) in prompt_sets(engine.tokenizer).items():
        for engine_kernel in ("shared", "sdpa"):
            static_cache.masked = attention_kernel.masked if engine_kernel == "shared" else sdpa_masked
            params = {"n": 8, "max_new_tokens": new, "temperature": 1.0, "sampling_seed": 7}
            out = engine.generate(prompts, params)
            samples = [(prompts[i // 8], r["output_ids"]) for i, r in enumerate(out)]
            engine_lp = torch.tensor([lp for r in out for lp in r["output_logprobs"]], device=DEVICE)
            for kernel in kernels:
                try:
                    row = compare(engine_lp, trainer_logprobs(trainer, samples, kernel))
                except RuntimeError as error:  # a backend that refuses these inputs
                    row = {"error": str(error)[:200]}
                key = f"{set_name}/engine_{engine_kernel}/trainer_{kernel}"
                results["gaps"][key] = row
                print(key, json.dumps(row), flush=True)
    static_cache.masked = attention_kernel.masked
    return results


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
