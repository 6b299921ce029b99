"""The multi-task example's two reward types (``configs/multi_task.yaml``), chosen per row by its metadata.

    rollout.rewards:
      add:  examples/multi_task/rewards.py:addition      # a float: the quickstart's shaped reward
      calc: examples/multi_task/rewards.py:calculator    # a dict: {"correct", "tool_call"}
    rollout.reward_key: correct                          # the dict's key that trains

Both read the last model turn: every row goes through the calculator agent's generate function, so a
response keeps its ChatML turn markers (``examples/calculator_tool/agent.py``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from rlrun.rollout.rewards import first_number

_AGENT = Path(__file__).resolve().parents[1] / "calculator_tool/agent.py"
_spec = importlib.util.spec_from_file_location("calculator_agent", _AGENT)
agent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agent)


def addition(sample) -> float:
    """``first_number`` (right sum, brevity bonus) on the last model turn."""
    return first_number(dataclasses.replace(sample, response_text=agent.final_turn(sample.response_text)))


def calculator(sample) -> dict[str, float]:
    """``correct``: the calculator agent's reward (right final integer, no pending call); ``tool_call``:
    whether the response called the calculator at all (logged, not trained)."""
    return {
        "correct": agent.reward(sample),
        "tool_call": float(agent.tool_call(sample.response_text) is not None),
    }
