"""``rollout.reward_timeout_s``: each reward call runs in a reward process; a call that hangs has its process
killed, scores 0 with its error recorded, and the batch (and the run) goes on; calls in time score as usual.
Run in a child process, as a rank would: a reward that ended the process would fail the test, not pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REWARD = textwrap.dedent("""
    import os, time

    def verifier(sample):
        if sample.response_text == "hang":
            time.sleep(600)  # a sandbox that never answers
        return float(len(sample.response_text)) + os.getpid() * 0  # runs in a reward process

    def where(sample):
        return float(os.getpid())
""")
SCORE = textwrap.dedent("""
    import json, os, sys, time
    from rlrun.data.sample import Prompt, Sample
    from rlrun.rollout.rewards import load_reward_fn, score_samples
    from rlrun.rollout.rewards.processes import reward_processes

    prompt = Prompt(index=0, prompt_ids=[1], prompt_text="q")
    def sample(text):
        return Sample(group_index=0, prompt=prompt, response_ids=[2], response_text=text, rollout_logprobs=[-0.1],
                      finish_reason="stop")
    samples = [sample(t) for t in ["ab", "hang", "abcd", "hang", "x"]]
    start = time.monotonic()
    verifier = load_reward_fn(sys.argv[1] + ":verifier")
    errors = score_samples(samples, verifier, timeout_s=float(sys.argv[2]), processes=2)
    elapsed = time.monotonic() - start
    where = [sample("a")]
    score_samples(where, load_reward_fn(sys.argv[1] + ":where"), timeout_s=30)
    workers = [w.process.pid for w in reward_processes()._all]
    print(json.dumps({"errors": errors, "rewards": [s.reward for s in samples], "elapsed": elapsed,
                      "messages": [s.reward_error for s in samples], "worker_pid": where[0].reward,
                      "workers": workers, "me": os.getpid()}))
""")


def test_hung_reward_scores_zero_and_the_batch_goes_on(tmp_path):
    reward = tmp_path / "verifier.py"
    reward.write_text(REWARD)
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    done = subprocess.run(
        [sys.executable, "-c", SCORE, str(reward), "2"], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["errors"] == 2 and out["rewards"] == [2.0, 0.0, 4.0, 0.0, 1.0]
    timeout = "RewardTimeoutError: no reward within rollout.reward_timeout_s (2 s); its process (pid "
    assert [m is not None and m.startswith(timeout) for m in out["messages"]] == [False, True, False, True, False]
    # the two hung calls ran side by side in two processes, each killed at its limit
    assert 2 <= out["elapsed"] < 60, out
    killed = [int(m.split("(pid ")[1].split(")")[0]) for m in out["messages"] if m]
    assert all(not Path(f"/proc/{pid}").exists() for pid in killed)
    # rewards ran outside the scoring process, in one of its live workers
    assert out["worker_pid"] != out["me"] and int(out["worker_pid"]) in out["workers"]


def test_reward_errors_in_a_process_keep_their_message(tmp_path):
    reward = tmp_path / "raises.py"
    reward.write_text("def verifier(sample):\n    raise ValueError('no answer line')\n")
    script = textwrap.dedent("""
        import sys
        from rlrun.data.sample import Prompt, Sample
        from rlrun.rollout.rewards import load_reward_fn, score_samples
        s = Sample(group_index=0, prompt=Prompt(index=0, prompt_ids=[1], prompt_text="q"), response_ids=[2],
                   response_text="r", rollout_logprobs=[0.0], finish_reason="stop")
        assert score_samples([s], load_reward_fn(sys.argv[1] + ":verifier"), timeout_s=30) == 1
        print(s.reward_error)
    """)
    done = subprocess.run(
        [sys.executable, "-c", script, str(reward)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"]},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"ValueError: no answer line (at {reward}:2 in verifier)"  # as in the rank
