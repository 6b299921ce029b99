"""A calculator-tool agent written against the ``openai`` client only: nothing here imports rlrun.

    rollout.agent: examples/openai_agent/agent.py:agent

The same function runs against any OpenAI-compatible server (``openai.AsyncOpenAI(base_url=..., api_key=...)``);
under rlrun, ``client`` points at the rank's endpoint and every token the model sampled trains. The model gets
a ``calculator`` tool; each tool call is evaluated and answered with a ``tool`` message, for up to
``MAX_TURNS`` model turns. The return value is the reward: ``correct`` trains (``rollout.reward_key``),
``tool_calls`` is logged beside it.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from fractions import Fraction

MAX_TURNS = 3
MAX_TOKENS = 48
INTEGER = re.compile(r"-?\d+")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression (+ - * / and parentheses) exactly.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
SYSTEM = (
    "You answer arithmetic questions. To compute, call the calculator: "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>. '
    "Then reply with the final answer as a number."
)
# One worked example in the model's own words (SmolLM2-135M does not call a tool it has only been told about).
DEMONSTRATION = [
    {"role": "user", "content": "What is 12 * 7 + 5?"},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7 + 5"}}</tool_call>',
    },
    {"role": "tool", "content": "89"},
    {"role": "assistant", "content": "89"},
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """Exact arithmetic on integers and decimals; an error message for anything else."""
    try:
        value = _eval(ast.parse(str(expression).replace("×", "*"), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as err:
        return f"error: {err or type(err).__name__}"
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = Fraction(_OPS[type(node.op)](_eval(node.left), _eval(node.right)))
        if abs(value) > 10**12:
            raise ValueError("result out of range")
        return value
    raise ValueError(f"unsupported: {type(node).__name__}")


async def agent(client, row: dict) -> dict:
    """Ask, run the calculator calls, answer; reward 1 when the final reply's last integer is the label."""
    messages = [{"role": "system", "content": SYSTEM}, *DEMONSTRATION, {"role": "user", "content": row["prompt"]}]
    num_calls, reply = 0, ""
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS
        )
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        reply = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            num_calls += 1
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(_expression(call))})
    numbers = INTEGER.findall(reply)
    correct = bool(numbers) and int(numbers[-1]) == int(row["label"])
    return {"correct": float(correct), "tool_calls": float(num_calls)}


def _expression(call) -> str:
    """The call's ``expression`` (or its only string argument: a small model misnames the key)."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        return ""
    if not isinstance(arguments, dict):
        return ""
    strings = [v for v in arguments.values() if isinstance(v, str)]
    return arguments.get("expression") or (strings[0] if len(strings) == 1 else "")
