"""A generate function whose trajectory yields two training samples (``rollout.generate_fn`` returning a
list): the model answers, then checks that answer in a second context of its own, without its first reply's
wording around it (the shape of slime's multi-agent and context-reset agents).

    rollout:
      generate_fn: examples/hooks/judge_agent.py:generate

Both replies train, each as its own sample (own prompt, own loss mask) with the trajectory's group score;
the reward (``rollout.reward``, e.g. ``first_number``) scores the trajectory once, on its last sample: the
check, whose number is the trajectory's final answer. ChatML turns, as the chat templates of SmolLM2 and
Qwen write them. Interface: rlrun/rollout/multiturn.py (``Trajectory.fork``), rlrun/rollout/train_samples.py.
"""

from __future__ import annotations

USER = "<|im_start|>user\n"
END = "<|im_end|>"
CHECK = (
    USER + "Question: {question}\nProposed answer: {answer}\nCheck it and reply with the final number only." + END
    + "\n<|im_start|>assistant\n"
)  # fmt: skip


def question_of(prompt_text: str) -> str:
    """The row's last user turn (the whole prompt when it has no ChatML turns)."""
    if USER not in prompt_text:
        return prompt_text.strip()
    return prompt_text.rsplit(USER, 1)[1].split(END, 1)[0].strip()


async def generate(traj):
    answer = await traj.generate()
    check = traj.fork(CHECK.format(question=question_of(traj.prompt.prompt_text), answer=answer.strip()))
    await check.generate()
    return [traj.to_sample(), check.to_sample()]
