"""The log-prob benchmarks/verl_plugins.py gives verl in place of its per-token loop, against a float64
reference: each label's log-softmax, and its gradient softmax - one_hot.

verl is not installed here, so the function is compiled from verl_plugins.py's source the way
benchmarks/verl_logprob.py does it on the GPU (where it is also timed against verl's own fallback).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from verl_logprob import function_from_source  # noqa: E402

logprobs_of_labels = function_from_source((BENCHMARKS / "verl_plugins.py").read_text(), "logprobs_of_labels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37,), (3, 11)])
def test_log_probs_and_gradient_match_the_float64_formula(dtype, shape):
    vocab = 50
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(*shape, vocab, generator=generator) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, shape, generator=generator)
    weights = torch.randn(shape, generator=generator)

    out = logprobs_of_labels(logits, labels)
    (out * weights).sum().backward()

    exact = logits.detach().double()
    log_softmax = exact - exact.logsumexp(-1, keepdim=True)
    expected = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    one_hot = torch.nn.functional.one_hot(labels, vocab).double()
    expected_grad = weights.double().unsqueeze(-1) * (one_hot - log_softmax.exp())

    assert out.dtype == torch.float32 and out.shape == labels.shape
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)
    grad_atol = 1e-6 if dtype == torch.float32 else 2e-2  # the gradient goes back into the logits' dtype
    torch.testing.assert_close(logits.grad.double(), expected_grad, rtol=0, atol=grad_atol)


def test_an_unknown_function_name_is_refused():
    with pytest.raises(SystemExit, match="not_there is not a top-level function"):
        function_from_source((BENCHMARKS / "verl_plugins.py").read_text(), "not_there")
