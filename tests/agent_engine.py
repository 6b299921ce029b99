"""A scripted engine for the agent server's tests: each ``generate`` row answers with the next scripted reply
(text, or exact token ids), ending on the tokenizer's EOS, with made-up log-probs; every call is recorded. The
server, the sessions, the template and the ``openai`` client around it are the real ones."""

from __future__ import annotations

import threading


class ScriptedEngine:
    def __init__(self, tokenizer, replies):
        self.tokenizer = tokenizer
        self.replies = list(replies)
        """Each a string (tokenized) or a list of token ids; a callable(input_ids) -> either, or cycled when
        the list runs out (its last entry repeats)."""
        self.calls: list[tuple[list[int], dict]] = []
        self.lock = threading.Lock()

    def generate(self, input_ids, sampling_params, return_logprob=True):
        with self.lock:
            results = []
            for ids in input_ids:
                self.calls.append((list(ids), dict(sampling_params)))
                for _ in range(sampling_params.get("n", 1)):
                    reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
                    reply = reply(ids) if callable(reply) else reply
                    out = (
                        list(reply)
                        if isinstance(reply, list)
                        else self.tokenizer(reply, add_special_tokens=False)["input_ids"]
                    )
                    out = out + [self.tokenizer.eos_token_id]
                    results.append(
                        {
                            "output_ids": out,
                            "output_logprobs": [-0.25 - 0.01 * i for i in range(len(out))],
                            "finish_reason": {"type": "stop", "matched": self.tokenizer.eos_token_id},
                            "weight_version": "7",
                        }
                    )
            return results
