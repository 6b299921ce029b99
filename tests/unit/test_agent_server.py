"""The agents' OpenAI-compatible server through the real ``openai`` client: streaming and tool-call requests,
4xx answers naming the field, token-in-token-out sessions (an assistant turn re-sent as text keeps its sampled
tokens; a rewritten history is a new sample), and agents that raise or time out scored 0 and counted."""

from __future__ import annotations

import asyncio
import json

import pytest

from minimal_config import rollout_config
from rlrun.agents.runner import run_agents
from rlrun.agents.server import AgentServer
from rlrun.agents.sessions import Session
from rlrun.agents.template import ChatTemplate
from rlrun.agents.tool_parsers import TOOL_PARSERS
from rlrun.data.sample import Prompt
from tests.agent_engine import ScriptedEngine
from tests.tiny_models import make_tokenizer

openai = pytest.importorskip("openai")
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
SAMPLING = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "n": 1, "sampling_seed": 0}


def serve(engine, tokenizer, body):
    """Run ``body(client, server, session)`` against a fresh server holding one open session."""

    async def main():
        server = AgentServer(engine, tokenizer, TOOL_PARSERS["hermes"], SAMPLING, 4096, "policy", concurrency=4)
        session = Session("s0", Prompt(0, [1], "q"), seed=0, template=ChatTemplate(tokenizer))
        server.sessions[session.id] = session
        await server.start()
        client = openai.AsyncOpenAI(base_url=server.base_url("s0"), api_key=server.token, max_retries=0)
        try:
            return await body(client, server, session)
        finally:
            await client.close()
            await server.stop()

    return asyncio.run(main())


def test_streaming_chat_and_tools_requests():
    tokenizer = make_tokenizer()
    engine = ScriptedEngine(tokenizer, ["hello there", CALL, "42"])
    chat = [{"role": "user", "content": "What is 6 * 7?"}]

    async def body(client, server, session):
        stream = await client.chat.completions.create(model="policy", messages=chat, stream=True)
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        reply = await client.chat.completions.create(model="policy", messages=chat, tools=TOOLS, logprobs=True)
        message = reply.choices[0].message
        follow = [
            *chat,
            message.model_dump(exclude_none=True),
            {"role": "tool", "content": "42", "tool_call_id": message.tool_calls[0].id},
        ]
        final = await client.chat.completions.create(model="policy", messages=follow, tools=TOOLS)
        models = await client.models.list()
        return text, finish, reply, final, [m.id for m in models.data], session

    text, finish, reply, final, models, session = serve(engine, tokenizer, body)
    assert text == "hello there" and finish == ["stop"] and models == ["policy"]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("calculator", {"expression": "6*7"})
    ]
    assert [e.logprob for e in choice.logprobs.content] == engine_logprobs(len(tokenizer(CALL)["input_ids"]) + 1)
    assert final.choices[0].message.content == "42" and final.choices[0].finish_reason == "stop"
    # The tool turn continued the tool-call branch: the engine saw its sampled tokens, then the template's tool
    # turn; reference: the whole conversation rendered by the template (this tokenizer has no merges).
    template = ChatTemplate(tokenizer)
    whole = [*chat, {"role": "assistant", "content": CALL}, {"role": "tool", "content": "42"}]
    assert engine.calls[2][0] == template.prompt_ids(whole, TOOLS)
    assert len(session.branches) == 2 and session.num_tool_calls == 1


def engine_logprobs(n):
    return [-0.25 - 0.01 * i for i in range(n)]


@pytest.mark.parametrize(
    "field, request_body",
    [
        ("messages", {"messages": []}),
        ("messages[0].role", {"messages": [{"role": "robot", "content": "hi"}]}),
        ("messages[0].content", {"messages": [{"role": "user"}]}),
        ("n", {"n": 0}),
        ("temperature", {"temperature": 3}),
        ("top_p", {"top_p": 0}),
        ("max_tokens", {"max_tokens": 0}),
        ("max_completion_tokens", {"max_completion_tokens": "8"}),
        ("stop", {"stop": [""]}),
        ("tools[0]", {"tools": [{"type": "function"}]}),
        ("tool_choice", {"tool_choice": "sometimes"}),
        ("logprobs", {"logprobs": "yes"}),
    ],
)
def test_malformed_requests_get_400_naming_the_field(field, request_body):
    tokenizer = make_tokenizer()
    engine = ScriptedEngine(tokenizer, ["x"])
    body_in = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], **request_body}

    async def body(client, server, session):
        with pytest.raises(openai.BadRequestError) as err:
            await client.post("/chat/completions", body=body_in, cast_to=object)
        return err.value

    err = serve(engine, tokenizer, body)
    assert err.status_code == 400 and field in err.message
    assert err.body["param"] == field
    assert not engine.calls


def test_key_and_session_are_checked():
    tokenizer = make_tokenizer()
    engine = ScriptedEngine(tokenizer, ["x"])
    chat = [{"role": "user", "content": "hi"}]

    async def body(client, server, session):
        intruder = openai.AsyncOpenAI(base_url=server.base_url("s0"), api_key="wrong", max_retries=0)
        elsewhere = openai.AsyncOpenAI(base_url=server.base_url("s1"), api_key=server.token, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await intruder.chat.completions.create(model="policy", messages=chat)
        with pytest.raises(openai.NotFoundError):
            await elsewhere.chat.completions.create(model="policy", messages=chat)
        session.closed = True
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="policy", messages=chat)
        await intruder.close()
        await elsewhere.close()

    serve(engine, tokenizer, body)
    assert not engine.calls


def test_resent_assistant_text_keeps_the_sampled_tokens(smollm2):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    # " hello" sampled in two pieces; the same text tokenizes as one token.
    sampled = (
        tokenizer(" hel", add_special_tokens=False)["input_ids"]
        + tokenizer("lo", add_special_tokens=False)["input_ids"]
    )
    text = tokenizer.decode(sampled)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] != sampled  # the drift the sessions avoid
    engine = ScriptedEngine(tokenizer, [sampled, "fine"])
    chat = [{"role": "user", "content": "Say hello."}]

    async def body(client, server, session):
        first = await client.chat.completions.create(model="policy", messages=chat)
        resent = [*chat, {"role": "assistant", "content": first.choices[0].message.content}]
        await client.chat.completions.create(model="policy", messages=[*resent, {"role": "user", "content": "Again"}])
        rewritten = [*chat, {"role": "assistant", "content": "HELLO"}, {"role": "user", "content": "Again"}]
        await client.chat.completions.create(model="policy", messages=rewritten)
        return first, session

    first, session = serve(engine, tokenizer, body)
    assert first.choices[0].message.content.strip() == text.strip()
    trajectory = session.to_sample(tokenizer)
    continued, restarted = trajectory.parts
    trained = [t for t, m in zip(continued.response_ids, continued.loss_mask, strict=True) if m]
    fine = tokenizer("fine", add_special_tokens=False)["input_ids"]
    assert trained == sampled + [tokenizer.eos_token_id] + fine + [tokenizer.eos_token_id]
    logprobs = [p for p, m in zip(continued.rollout_logprobs, continued.loss_mask, strict=True) if m]
    assert logprobs == engine_logprobs(len(sampled) + 1) + engine_logprobs(len(fine) + 1)
    assert engine.calls[1][0][: len(engine.calls[0][0]) + len(sampled) + 1] == engine.calls[0][0] + sampled + [
        tokenizer.eos_token_id
    ]
    # The rewritten history is a sample of its own, its prompt the template's rendering of what was sent.
    assert restarted.prompt.prompt_ids == ChatTemplate(tokenizer).prompt_ids(
        [*chat, {"role": "assistant", "content": "HELLO"}, {"role": "user", "content": "Again"}]
    )
    assert continued.prompt.prompt_ids == ChatTemplate(tokenizer).prompt_ids(chat)
    # The engine's session key is the branch's: the continued turn keeps it (an embedded engine with
    # session_cache_size reuses its K/V), the rewritten history gets another.
    keys = [params["session"] for _, params in engine.calls]
    assert keys[0] == keys[1] != keys[2] and keys[0].startswith("s0/")


async def _agent(client, row):
    if row["sample_index"] == 1:
        raise RuntimeError("harness crashed")
    if row["sample_index"] == 2:
        await asyncio.sleep(3600)
    reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}])
    return float(reply.choices[0].message.content == "right")


def test_agents_that_raise_or_time_out_score_zero_and_are_counted():
    tokenizer = make_tokenizer()
    engine = ScriptedEngine(tokenizer, ["right"])
    prompts = [Prompt(i, [1, 2], f"question {i}") for i in range(2)]
    cfg = rollout_config(samples_per_prompt=3, reward="first_number", agent="x.py:agent", agent_timeout_s=8.0)
    samples = run_agents(_agent, engine, prompts, cfg, SAMPLING, 0, tokenizer, 512)
    assert [s.group_index for s in samples] == [0, 0, 0, 1, 1, 1]
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0] * 2
    assert [s.reward_error is None for s in samples] == [True, False, False] * 2
    where = f"(at {__file__}:{_agent.__code__.co_firstlineno + 2} in _agent)"  # the agent's line that raised
    assert samples[1].reward_error == f"agent raised RuntimeError: harness crashed {where}"
    assert samples[2].reward_error.startswith("agent timed out after rollout.agent_timeout_s (8.0 s)")
    assert all(len(s.rollout_logprobs) == len(s.response_ids) == len(s.loss_mask) for s in samples)
    assert samples[1].loss_mask == [0]  # no model turn: one masked token keeps the group whole
