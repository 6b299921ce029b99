"""Run by tests/unit/test_engine_sampling.py under Triton's interpreter (TRITON_INTERPRET=1, CPU, fp32): the greedy
kernel (``triton_kernels.greedy_tokens``) picks each row's first argmax, a tie included, across vocabularies of one
tile and several (a masked last one), and gives its log-prob under ``softmax(logits / T)`` within fp32 rounding of a
float64 ``log_softmax``."""

import torch

from rlrun.engine.embedded.triton_kernels import greedy_tokens

torch.manual_seed(0)
for rows, vocab in ((3, 5000), (4, 9000), (2, 4096), (1, 100)):
    logits = torch.randn(rows, vocab) * 4
    top = logits.max() + 1
    logits[0, 17] = logits[0, 17 + 4096 if vocab > 4113 else vocab - 3] = top  # a tie (one lane, or two): first wins
    temperature = torch.tensor([1.0, 0.7, 1.3, 2.0][:rows])
    tokens, logprobs = greedy_tokens(logits, temperature)
    assert tokens.dtype == torch.long and logprobs.dtype == torch.float32
    assert tokens.tolist() == logits.argmax(-1).tolist() and tokens[0] == 17, (tokens, logits.argmax(-1))
    want = torch.log_softmax(logits.double() / temperature.double()[:, None], -1).gather(-1, tokens[:, None])
    assert (logprobs.double() - want.squeeze(-1)).abs().max() < 1e-5, (logprobs, want)
tokens, logprobs = greedy_tokens(torch.empty(0, 64), torch.empty(0))
assert tokens.shape == logprobs.shape == (0,)
print("ok")
