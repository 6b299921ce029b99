"""``rlrun bench rollout``: embedded-engine output tokens/s vs transformers ``generate`` and vs the
memory-bandwidth bound, on one random model of a published shape, same batch and lengths, one run.

The bound (:class:`BandwidthBound`): a decode step must read every weight once from HBM and, for each of the B rows,
the K and V of every position it attends to, so at context c a step reads
``weight_bytes + B * kv_bytes_per_token * c`` bytes, with ``kv_bytes_per_token = layers * 2 * kv_heads * head_dim *
element_size``. The N tokens of a response come from N forwards at contexts P, P+1, ..., P+N-1 (P the prompt), so
with ``mean_context = P + (N - 1) / 2`` the call takes at least N steps of ``(weight_bytes + B * kv_bytes_per_token *
mean_context) / hbm_bytes_per_s`` seconds and makes at most ``B / step_s`` tokens/s (prefill, activations and the
logits ignored: the real bound is a little lower). ``fraction_of_bound`` is the engine's greedy tokens/s over that.
The HBM bandwidth is the card's (:func:`card_hbm_bytes_per_s`: H200 4.8 TB/s, H100 SXM 3.35 TB/s) unless given. Every
response is forced
to its full length (``ignore_eos`` / ``min_new_tokens``) so both sides emit exactly B x new_tokens.
Each engine run is preceded by an untimed run of the same shape, which captures its decode step
(CUDA graph) once, as a long-lived engine does on its first call.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import torch

from rlrun.kernels.attention import engine_kernel_family
from rlrun.tools.bench.decode_profile import DecodeProfile, profile_decode
from rlrun.tools.bench.shapes import get_shape, weight_bytes, write_random_model
from rlrun.tools.bench.timing import hardware, timer

HBM_BYTES_PER_S = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12))
"""Published HBM bandwidth by a name fragment of the CUDA device, first match wins (an H100 that is neither PCIe nor
NVL is the SXM card, HBM3)."""
WARMUP_NEW_TOKENS = 4


def card_hbm_bytes_per_s(device_name: str) -> float:
    """The HBM bandwidth of the card called ``device_name`` (``torch.cuda.get_device_name``), bytes/s."""
    for fragment, rate in HBM_BYTES_PER_S:
        if fragment in device_name:
            return rate
    known = ", ".join(fragment for fragment, _ in HBM_BYTES_PER_S)
    raise ValueError(
        f"--hbm-gbps must be set on {device_name!r} because its HBM bandwidth is not known (known: {known}); "
        "set --hbm-gbps to the card's published bandwidth in GB/s"
    )


def kv_bytes_per_token(shape: str, element_size: int) -> int:
    """Bytes of K and V one position holds in the cache: ``layers * 2 * kv_heads * head_dim * element_size``."""
    s = get_shape(shape)
    return s.layers * 2 * s.kv_heads * s.head_dim * element_size


@dataclasses.dataclass(frozen=True)
class Throughput:
    """One generator's timed run: ``tokens_per_s = output_tokens / seconds`` (prefill included)."""

    seconds: float
    output_tokens: int
    tokens_per_s: float
    repeats_s: list[float] | None = None
    """Where the run is the median of several timed calls of the same work: every call's seconds, in order."""

    @classmethod
    def of(cls, seconds: float, output_tokens: int, repeats_s: list[float] | None = None) -> Throughput:
        return cls(
            seconds=seconds, output_tokens=output_tokens, tokens_per_s=output_tokens / seconds, repeats_s=repeats_s
        )


@dataclasses.dataclass(frozen=True)
class BandwidthBound:
    """The HBM bound of a decode call (module docstring): ``bytes_per_step = weight_bytes + batch *
    kv_bytes_per_token * mean_context``, ``mean_context = prompt_len + (new_tokens - 1) / 2``, ``step_s =
    bytes_per_step / hbm_bytes_per_s``, ``tokens_per_s = batch / step_s``."""

    hbm_bytes_per_s: float
    step_s: float
    tokens_per_s: float
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0
    mean_context: float = 0.0
    bytes_per_step: float = 0.0

    @classmethod
    def of(
        cls,
        weight_bytes: int,
        hbm_bytes_per_s: float,
        batch: int,
        kv_bytes_per_token: int,
        prompt_len: int,
        new_tokens: int,
    ) -> BandwidthBound:
        mean_context = prompt_len + (new_tokens - 1) / 2
        nbytes = weight_bytes + batch * kv_bytes_per_token * mean_context
        step_s = nbytes / hbm_bytes_per_s
        return cls(
            hbm_bytes_per_s=hbm_bytes_per_s,
            step_s=step_s,
            tokens_per_s=batch / step_s,
            weight_bytes=weight_bytes,
            kv_bytes_per_token=kv_bytes_per_token,
            mean_context=mean_context,
            bytes_per_step=nbytes,
        )


@dataclasses.dataclass(frozen=True)
class RolloutResult:
    """One ``bench rollout`` measurement: the inputs, both generators' throughput, and the bound."""

    shape: str
    hardware: str
    dtype: str
    batch: int
    prompt_len: int
    new_tokens: int
    num_params: int
    weight_bytes: int
    engine: Throughput
    """Greedy, log-probs on."""
    engine_sampled: Throughput
    """Same lengths, sampling at temperature 1 with top-p 0.95 and a seed (the sampler's cost)."""
    cuda_graph: bool
    """The engine's decode step ran as a captured CUDA graph (False: eagerly, e.g. on CPU)."""
    hf_generate: Throughput
    bound: BandwidthBound
    speedup_vs_hf: float
    """engine tokens/s / HF generate tokens/s (goal >= 5)."""
    fraction_of_bound: float
    """engine tokens/s / bound tokens/s."""
    decode_profile: DecodeProfile | None = None
    """With ``--profile``: where a decode step of the sampled call spends its time
    (rlrun/tools/bench/decode_profile.py)."""
    cublas_workspace_config: str | None = None
    """``CUBLAS_WORKSPACE_CONFIG`` of the process: the embedded worker's (``EXACT_GEMM_ENV``) unless the caller set
    another, so the engine here runs the GEMMs a training run's engine runs (transformers' generate shares it)."""


GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 1.0, "top_p": 0.95, "sampling_seed": 0}


def profile_path(path: Path, batch: int, batches: list[int]) -> Path:
    """Where batch ``batch``'s kernel-time table goes: ``path`` itself for one batch size, else ``<stem>_b<batch>``."""
    return path if len(batches) == 1 else path.with_name(f"{path.stem}_b{batch}{path.suffix}")


def _engine_run(engine, prompts: list[list[int]], new_tokens: int, params: dict) -> int:
    """Log-probs on (as the trainer asks), every response exactly ``new_tokens`` long."""
    results = engine.generate(prompts, {"max_new_tokens": new_tokens, "ignore_eos": True, **params})
    return sum(r["completion_tokens"] for r in results)


def _hf_run(model, prompts: torch.Tensor, new_tokens: int) -> int:
    out = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return (out.shape[1] - prompts.shape[1]) * out.shape[0]


def bench_rollout(
    shape: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    device: str,
    dtype: str,
    hbm_bytes_per_s: float | None = None,
    seed: int = 0,
    profile: Path | None = None,
) -> RolloutResult:
    """Time one warm run of the embedded engine and of HF ``generate`` on the same weights in memory; ``profile``:
    also profile decode steps of the sampled call (its kernel-time table written there); ``hbm_bytes_per_s``: the
    bound's bandwidth, by default the card's (:func:`card_hbm_bytes_per_s`).

    The engine runs in this process, not in a worker, so the process takes the worker's environment
    (``EXACT_GEMM_ENV``: cuBLAS without a workspace, read when cuBLAS first runs, so before any GEMM here) where the
    caller has not set those variables."""
    from transformers import AutoModelForCausalLM

    from rlrun.engine.embedded.engine import DTYPES, EmbeddedEngine
    from rlrun.engine.embedded.fused_rope import unfused
    from rlrun.engine.registry import EXACT_GEMM_ENV

    for key, value in EXACT_GEMM_ENV.items():
        os.environ.setdefault(key, value)
    if hbm_bytes_per_s is None:  # before the model is built: an unknown card fails at once
        hbm_bytes_per_s = card_hbm_bytes_per_s(hardware(torch.device(device)))
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-") as tmp:
        model_dir = write_random_model(get_shape(shape), Path(tmp), DTYPES[dtype], device)
        # The kernels a run with model.packed_attention auto gives its engine (the chunked ones on CUDA in bf16).
        kernel = engine_kernel_family("auto", dtype) if torch.device(device).type == "cuda" else "efficient"
        engine = EmbeddedEngine(model_dir, seed=seed, dtype=dtype, device=device, attention_kernel=kernel)
        # The same weights as transformers loads them by default (stock attention), for generate.
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(engine.device).eval()
    dev = engine.device
    vocab = engine.vocab_size
    prompts = torch.randint(2, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    prompt_lists, prompts_dev = prompts.tolist(), prompts.to(dev)
    with unfused(model):  # stock transformers: not the engine's RoPE kernel, swapped in process-wide
        _hf_run(model, prompts_dev, WARMUP_NEW_TOKENS)
    engine_tp = {}
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        _engine_run(engine, prompt_lists, new_tokens, params)  # warm-up of the same shape: captures the step
        with timer(dev) as engine_s:
            engine_tokens = _engine_run(engine, prompt_lists, new_tokens, params)
        engine_tp[name] = Throughput.of(engine_s[0], engine_tokens)
    decode = (
        None if profile is None else profile_decode(engine, prompt_lists, SAMPLED, new_tokens, profile, hbm_bytes_per_s)
    )
    with unfused(model), timer(dev) as hf_s:
        hf_tokens = _hf_run(model, prompts_dev, new_tokens)
    nbytes = weight_bytes(model)
    hf_tp = Throughput.of(hf_s[0], hf_tokens)
    element_size = next(model.parameters()).element_size()
    bound = BandwidthBound.of(
        nbytes, hbm_bytes_per_s, batch, kv_bytes_per_token(shape, element_size), prompt_len, new_tokens
    )
    greedy = engine_tp["greedy"]
    return RolloutResult(
        shape=shape,
        hardware=hardware(dev),
        dtype=dtype,
        batch=batch,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        num_params=sum(p.numel() for p in model.parameters()),
        weight_bytes=nbytes,
        engine=greedy,
        engine_sampled=engine_tp["sampled"],
        cuda_graph=engine.decode_step_captured,
        hf_generate=hf_tp,
        bound=bound,
        speedup_vs_hf=greedy.tokens_per_s / hf_tp.tokens_per_s,
        fraction_of_bound=greedy.tokens_per_s / bound.tokens_per_s,
        decode_profile=decode,
        cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
