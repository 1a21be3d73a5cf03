"""Tool calling through the official `openai` Python client against a running peregrine-agent
serving SmolLM2 (whose chat template has no tool-call format).

Usage: openai_tools_test.py BASE_URL MODEL

`tool_choice` required / named force a call through the grammar, so the tiny model always makes
one: each call's arguments are checked against the tool's schema with `jsonschema` (an
independent validator), streamed calls are assembled from their deltas as the SDK documents and
must equal the non-streamed ones (greedy), and a tool-call history round-trips through the chat
template. `auto` on a model without a call format is a 400 naming `tool_choice` (as vLLM without
`--tool-call-parser`). Also `logit_bias` (a +100 bias forces its token) and `n` / `best_of`
(greedy choices equal n=1's; `best_of` picks the candidate with the highest cumulative logprob).
Exits non-zero on the first failure.
"""

import json
import sys

import jsonschema
import openai

from checks import check

BASE_URL, MODEL = sys.argv[1:3]
client = openai.OpenAI(base_url=BASE_URL, api_key="unused", max_retries=0, timeout=300)


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": {"type": "object", "additionalProperties": False}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def check_call(name, call):
    check(f"{name}: a function tool call", call.type == "function" and call.id.startswith("call_"), call)
    check(f"{name}: declared function", call.function.name in SCHEMAS, call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    check(f"{name}: arguments validate", True, call.function.arguments)


def create(**kw):
    args = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 80}
    args.update(kw)
    return client.chat.completions.create(**args)


def streamed(**kw):
    """The calls as the SDK's chunks deliver them: per index, the first delta has id, type and name."""
    calls, content, finish = {}, "", None
    for chunk in create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:
                    check("first delta names the call", tc.id and tc.type == "function" and tc.function.name, tc)
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    check("later deltas only add arguments", tc.id is None and tc.function.name is None, tc)
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    return [calls[i] for i in sorted(calls)], content, finish


def test_named():
    r = create(tool_choice=NAMED)
    c = r.choices[0]
    check("named: finish_reason", c.finish_reason == "tool_calls", c.finish_reason)
    check("named: one call, no content", len(c.message.tool_calls) == 1 and not c.message.content, c.message)
    check("named: the named function", c.message.tool_calls[0].function.name == "get_weather", c.message.tool_calls)
    check_call("named", c.message.tool_calls[0])
    calls, content, finish = streamed(tool_choice=NAMED)
    check("named stream: finish_reason", finish == "tool_calls", finish)
    check("named stream: same call as unstreamed (greedy)",
          [(x["name"], x["arguments"]) for x in calls] == [("get_weather", c.message.tool_calls[0].function.arguments)] and content == "",
          (calls, content))
    return r


def test_required():
    r = create(tool_choice="required", parallel_tool_calls=False)
    c = r.choices[0]
    check("required: finish_reason", c.finish_reason == "tool_calls", (c.finish_reason, c.message))
    check("required: exactly one call without parallel calls", len(c.message.tool_calls) == 1, c.message.tool_calls)
    check_call("required", c.message.tool_calls[0])
    calls, content, finish = streamed(tool_choice="required", parallel_tool_calls=False)
    check("required stream: finish_reason", finish == "tool_calls", finish)
    expected = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    check("required stream: same calls as unstreamed (greedy)", [(x["name"], x["arguments"]) for x in calls] == expected, (calls, expected))
    # Sampled, several seeds: the grammar still makes every output a valid call.
    for seed in range(3):
        s = create(tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed).choices[0]
        check(f"required sampled seed {seed}: finished with a call", s.finish_reason == "tool_calls", (s.finish_reason, s.message))
        for call in s.message.tool_calls:
            check_call(f"required sampled seed {seed}", call)


def test_round_trip(first):
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "unit": "celsius"})},
    ]
    r = create(messages=history, tool_choice="none", max_tokens=16)
    c = r.choices[0]
    check("history with tool_calls and a tool turn is served", c.message.tool_calls is None and isinstance(c.message.content, str), c.message)
    without_tool_turn = create(messages=history[:-1], tool_choice="none", max_tokens=1).usage.prompt_tokens
    check("the tool turn reached the prompt", r.usage.prompt_tokens > without_tool_turn, (r.usage, without_tool_turn))


def test_refusals():
    try:
        create(tool_choice="auto")
    except openai.BadRequestError as e:
        check("auto without a call format is a 400", e.param == "tool_choice", (e.param, e.message))
    else:
        raise AssertionError("auto: no error raised")
    try:
        create(tool_choice={"type": "function", "function": {"name": "missing"}})
    except openai.BadRequestError as e:
        check("unknown named function is a 400", e.param == "tool_choice", (e.param, e.message))
    else:
        raise AssertionError("named missing: no error raised")


def test_logit_bias():
    # +100 on one token makes it (in practice) the only choice, even when sampling.
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=1.0, seed=1, logprobs=0,
                                  logit_bias={"1000": 100})
    tokens = r.choices[0].logprobs.tokens
    check("logit_bias +100 forces its token", len(tokens) == 4 and len(set(tokens)) == 1, tokens)
    try:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, logit_bias={"99999999": 1})
    except openai.BadRequestError as e:
        check("logit_bias outside the vocabulary is a 400", "logit_bias" in e.message, e.message)
    else:
        raise AssertionError("logit_bias outside the vocabulary: no error raised")


def test_n_and_best_of():
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, n=4)
    texts = [c.text for c in r.choices]
    check("n=4 gives 4 choices with their index", [c.index for c in r.choices] == [0, 1, 2, 3], r.choices)
    check("greedy choices are identical", len(set(texts)) == 1, texts)
    one = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    check("and equal to n=1", texts[0] == one.choices[0].text and r.usage.prompt_tokens == one.usage.prompt_tokens,
          (texts[0], one.choices[0].text))
    check("usage: the prompt once, every choice's tokens", r.usage.completion_tokens == 4 * one.usage.completion_tokens, r.usage)
    # best_of: the choice with the highest cumulative logprob among the same candidates (choice i
    # is seeded seed + i, so n=3 and best_of=3 generate the same three).
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=5, logprobs=0)
    cands = client.completions.create(n=3, **kw).choices
    sums = [sum(c.logprobs.token_logprobs) for c in cands]
    best = client.completions.create(n=1, best_of=3, **kw).choices
    check("best_of returns n choices", len(best) == 1, best)
    check("best_of picks the highest cumulative logprob", best[0].text == cands[sums.index(max(sums))].text, (best[0].text, sums, [c.text for c in cands]))
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, n=2, stream=True)
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    check("streamed n=2 chat: both choices, greedy equal", texts[0] == texts[1] and texts[0], texts)


if __name__ == "__main__":
    first = test_named()
    test_required()
    test_round_trip(first)
    test_refusals()
    test_logit_bias()
    test_n_and_best_of()
    print("ALL OK")
