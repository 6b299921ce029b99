"""Run by tests/unit/test_chunked_attention.py under Triton's interpreter (TRITON_INTERPRET=1, CPU, fp32): the
embedded engine loaded with the chunked kernels (as a ``model.packed_attention: chunked_varlen`` run starts it; the
CUDA-only gates opened for the interpreter) generates the tokens of its memory-efficient path, log-probs within 1e-5,
in one prefill, in prefill chunks and with continuous batching; every prefill and decode went through the kernels."""

import tempfile
from pathlib import Path

from rlrun.engine.embedded import engine as embedded
from rlrun.engine.embedded import static_cache
from rlrun.engine.embedded.engine import EmbeddedEngine
from rlrun.kernels import chunked_attention
from tiny_models import make_tiny_model

model = make_tiny_model("qwen3", Path(tempfile.mkdtemp()) / "m", seed=2)
prompts = [[3 + (k * 7 + n) % 250 for k in range(n)] for n in (37, 3, 20, 9)]
params = {"max_new_tokens": 12, "temperature": 0.0, "n": 1}
options = {"seed": 0, "dtype": "float32", "device": "cpu"}
want = EmbeddedEngine(model, **options).generate(prompts, params)

calls = {"decode": 0, "causal": 0}


def counted(name, kernel):
    def call(*args, **kwargs):
        calls[name] += 1
        return kernel(*args, **kwargs)

    return call


chunked_attention.decode = counted("decode", chunked_attention.decode)
chunked_attention.causal = counted("causal", chunked_attention.causal)
static_cache.chunked_kernel_takes = lambda query, value, groups: True  # CUDA-only outside the interpreter
embedded._attention_implementation = lambda kernel, device: static_cache.ATTENTION_CHUNKED
for extra in ({}, {"chunked_prefill_size": 40}, {"max_running_requests": 2}):
    before = dict(calls)
    engine = EmbeddedEngine(model, **options, attention_kernel="chunked", **extra)
    for a, b in zip(want, engine.generate(prompts, params), strict=True):
        assert a["output_ids"] == b["output_ids"], (extra, a["output_ids"], b["output_ids"])
        assert max(abs(x - y) for x, y in zip(a["output_logprobs"], b["output_logprobs"], strict=True)) < 1e-5, extra
    assert calls["decode"] > before["decode"] and calls["causal"] > before["causal"], (extra, calls)
print("ok")
