"""The quickstart's shaped addition reward, written as verl writes a reward: ``compute_score`` with verl's
parameters, used by rlrun as is (rollout.reward: examples/verl_format/compute_score.py:compute_score).

    0                                                          if the first integer in the reply != ground truth
    0.5 + 0.5 * max(0, 1 - (len(reply) - len(answer)) / 20)    otherwise (a brevity bonus)
"""

import re

_INTEGER = re.compile(r"-?\d+")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    reply = solution_str.strip()
    found = _INTEGER.search(reply)
    if found is None or int(found.group()) != int(ground_truth):
        return 0.0
    extra_chars = len(reply) - len(str(ground_truth))
    return 0.5 + 0.5 * max(0.0, 1.0 - extra_chars / 20)
