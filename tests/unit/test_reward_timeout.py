"""``rollout.reward_timeout_s``: a reward function that hangs ends its process with the line it hangs on
(rlrun/runtime/deadline.py), in a real process; one that finishes in time is scored as usual."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from rlrun.runtime.deadline import EXIT_DEADLINE

REPO = Path(__file__).resolve().parents[2]
SCORE = textwrap.dedent("""
    import sys, time
    from rlrun.data.sample import Prompt, Sample
    from rlrun.rollout.rewards import score_samples

    def verifier(sample):
        if sample.response_text == "hang":
            time.sleep(600)  # a sandbox that never answers
        return 1.0

    prompt = Prompt(index=0, prompt_ids=[1], prompt_text="q")
    reply = dict(response_ids=[2], response_text=sys.argv[1], rollout_logprobs=[-0.1], finish_reason="stop")
    samples = [Sample(group_index=0, prompt=prompt, **reply)]
    score_samples(samples, verifier, timeout_s=float(sys.argv[2]))
    print("scored", samples[0].reward)
""")


def score_in_process(reply: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCORE, reply, str(timeout_s)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )


def test_hung_reward_ends_the_process_naming_the_line_it_hangs_on():
    hung = score_in_process("hang", 0.5)
    assert hung.returncode == EXIT_DEADLINE and "scored" not in hung.stdout, hung.stderr
    assert hung.stderr.startswith("[rlrun] pid ") and hung.stderr.count("\n") == 1, hung.stderr
    assert "the reward function verifier (1 calls) ran past 0.5 s, stuck at <string>:8 in verifier; " in hung.stderr
    assert hung.stderr.rstrip().endswith("fix the hook, or raise rollout.reward_timeout_s if it needs longer")
    done = score_in_process("4", 30)
    assert done.returncode == 0 and done.stdout == "scored 1.0\n", done.stderr
