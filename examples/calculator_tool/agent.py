"""Calculator-tool agent: the generate function and reward for ``configs/calculator_tool.yaml``.

    rollout.generate_fn: examples/calculator_tool/agent.py:generate
    rollout.reward:      examples/calculator_tool/agent.py:reward

``generate`` lets the model answer, runs its calculator calls and feeds the results back as ``tool``
turns (or a nudge as a ``user`` turn) for up to ``MAX_TURNS`` model turns. Only the model's own
tokens are trained on: everything the environment appends goes in with loss mask 0.

Protocol (turns rendered by the tokenizer's chat template, ``traj.append_message``):
* the model calls the tool by writing ``<calc>EXPRESSION</calc>`` (an unclosed ``<calc>EXPRESSION``
  at the end of a turn counts too); the environment answers in a ``tool`` turn with the result or
  an error;
* a turn without a tool call that contains an integer is the final answer;
* a turn with neither gets a ``user`` turn asking for one of the two.
"""

from __future__ import annotations

import ast
import operator
import re
import warnings
from fractions import Fraction

CALL = re.compile(r"<calc>(?P<expr>.*?)(?:</calc>|$)", re.DOTALL)
INTEGER = re.compile(r"-?\d+")
NUDGE = "Use <calc>expression</calc> to compute, or reply with the final answer as a number."
MAX_ABS = 10**12
MAX_TURNS = 4
ASSISTANT = "<|im_start|>assistant\n"
END = "<|im_end|>"
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class CalcError(ValueError):
    """The expression is not plain arithmetic on numbers (or its result is out of range)."""


def evaluate(expression: str) -> str:
    """Exact arithmetic (+ - * / // %, parentheses, unary minus) on integers and decimals."""
    try:
        with warnings.catch_warnings():  # odd model text ("12abc") makes the parser warn before it fails
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expression.strip().replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise CalcError(f"cannot parse {expression.strip()!r}") from None
    value = _eval(tree.body)
    if abs(value) > MAX_ABS:
        raise CalcError("result out of range")
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise CalcError("division by zero")
        return Fraction(_OPS[type(node.op)](left, right))
    raise CalcError(f"unsupported syntax: {type(node).__name__}")


def tool_call(turn: str) -> str | None:
    """The expression of the turn's first tool call, or None."""
    match = CALL.search(turn)
    return match["expr"] if match else None


def environment_reply(turn: str) -> tuple[str, str] | None:
    """(role, text) of the environment's answer to a model turn, or None when the turn is a final answer."""
    expression = tool_call(turn)
    if expression is not None:
        try:
            return "tool", evaluate(expression)
        except CalcError as err:
            return "tool", f"error: {err}"
    if INTEGER.search(turn):
        return None
    return "user", NUDGE


async def generate(traj) -> None:
    """Model turn, environment turn, model turn, ... until a final answer or ``MAX_TURNS`` model turns."""
    for _ in range(MAX_TURNS - 1):
        turn = await traj.generate()
        reply = environment_reply(turn)
        if reply is None:
            return
        role, text = reply
        # The tokenizer's chat template closes the model's turn (when it did not end it itself), renders the
        # reply and opens the next assistant turn.
        traj.append_message(role, text)
    await traj.generate()


def final_turn(response_text: str) -> str:
    """The last model turn of a response (``response_text`` keeps the turn markers; ChatML's here, the
    template of SmolLM2 and Qwen)."""
    return response_text.rsplit(ASSISTANT, 1)[-1].replace(END, "")


def reward(sample) -> float:
    """1.0 when the last model turn is a final answer (no tool call) whose first integer is the label."""
    turn = final_turn(sample.response_text)
    if tool_call(turn) is not None:
        return 0.0
    found = INTEGER.search(turn)
    return float(found is not None and int(found.group()) == int(sample.prompt.label))
