"""Structured outputs through the official `openai` Python client against a running peregrine-agent.

Usage: openai_structured_test.py BASE_URL MODEL

Outputs are checked against their constraint with independent references: `jsonschema` validates
JSON-schema outputs, Python's `re` checks regex outputs. Exits non-zero on the first failure.
"""

import json
import pathlib
import re
import sys

import jsonschema
import openai

from checks import check

BASE_URL, MODEL = sys.argv[1:3]
client = openai.OpenAI(base_url=BASE_URL, api_key="unused", max_retries=0, timeout=300)


SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 16},
            "location": {
                "type": "object",
                "properties": {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "location"],
        "additionalProperties": False,
    },
    "list": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["colors", "count"],
        "additionalProperties": False,
    },
}

PROMPTS = {
    "person": "Describe a user of a website as JSON.",
    "nested": "Give the location of Paris as JSON.",
    "list": "List some colors as JSON.",
}


def response_format(name):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def test_chat_json_schema():
    for name, schema in SCHEMAS.items():
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[name]}], temperature=0, max_tokens=150,
            response_format=response_format(name))
        c = r.choices[0]
        check(f"chat json_schema {name} finished", c.finish_reason == "stop", (c.finish_reason, c.message.content))
        value = json.loads(c.message.content)
        jsonschema.validate(value, schema)
        check(f"chat json_schema {name} validates", True, value)


def test_chat_json_schema_stream():
    name = "person"
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[name]}], temperature=0, max_tokens=150,
        response_format=response_format(name), stream=True)
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    check("streamed json_schema finished", finish == "stop", (finish, text))
    jsonschema.validate(json.loads(text), SCHEMAS[name])
    check("streamed json_schema validates", True)


def test_sampled_json_schema():
    # Sampling (not greedy) still can only produce valid JSON.
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS["list"]}], temperature=1.0, seed=seed,
            max_tokens=150, response_format=response_format("list"))
        c = r.choices[0]
        check(f"sampled json_schema seed {seed} finished", c.finish_reason == "stop", (c.finish_reason, c.message.content))
        jsonschema.validate(json.loads(c.message.content), SCHEMAS["list"])


def test_json_object():
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object with a key 'a'."}], temperature=0,
        max_tokens=100, response_format={"type": "json_object"})
    c = r.choices[0]
    if c.finish_reason == "stop":
        check("json_object is an object", isinstance(json.loads(c.message.content), dict), c.message.content)
    else:
        # A free-form object may run to max_tokens; what was produced is still a valid prefix.
        check("json_object prefix", c.message.content.startswith("{"), c.message.content)


def test_completion_regex_and_choice():
    rx = r"[A-Z][a-z]{2,8} is [0-9]{1,2} years old\."
    for extra in ({"structured_outputs": {"regex": rx}}, {"guided_regex": rx}):
        r = client.completions.create(model=MODEL, prompt="A short sentence about a person's age:", max_tokens=40,
                                      temperature=0, extra_body=extra)
        c = r.choices[0]
        check(f"regex {list(extra)[0]}", re.fullmatch(rx, c.text) is not None and c.finish_reason == "stop", (c.text, c.finish_reason))
    choices = ["positive", "negative", "neutral"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        r = client.completions.create(model=MODEL, prompt="The sentiment of 'I love it' is", max_tokens=10,
                                      temperature=0, extra_body=extra)
        check(f"choice {list(extra)[0]}", r.choices[0].text in choices, r.choices[0].text)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                       max_tokens=10, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    check("chat choice", r.choices[0].message.content in ("yes", "no"), r.choices[0].message.content)
    grammar = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    r = client.completions.create(model=MODEL, prompt="Question: is water wet?", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"grammar": grammar}})
    check("lark grammar", r.choices[0].text in ("The answer is yes.", "The answer is no."), r.choices[0].text)
    # GBNF (llama.cpp's format), converted to Lark: a literal, a group, a class with a repeat.
    gbnf = 'root ::= "The answer is " answer "." [ ]{0,1}\nanswer ::= ("yes" | "no")  # either\n'
    r = client.completions.create(model=MODEL, prompt="Question: is water wet?", max_tokens=20, temperature=0,
                                  extra_body={"guided_grammar": gbnf})
    check("gbnf grammar", re.fullmatch(r"The answer is (yes|no)\. ?", r.choices[0].text) is not None, r.choices[0].text)
    r = client.completions.create(model=MODEL, prompt="A JSON object describing a cat:", max_tokens=60, temperature=0,
                                  extra_body={"guided_grammar": JSON_GBNF})
    c = r.choices[0]
    if c.finish_reason == "stop":
        check("json.gbnf output parses", isinstance(json.loads(c.text), dict), c.text)
    else:
        check("json.gbnf output is an object's prefix", c.text.startswith("{"), c.text)


# The shape of llama.cpp's grammars/json.gbnf (objects at the root); the converter's unit test reads it too.
JSON_GBNF = (pathlib.Path(__file__).resolve().parents[3] / "scripts/grammars/json.gbnf").read_text()


def expect_400(name, fn, param, needle=""):
    """A 400 whose `param` names the field at fault and whose message contains `needle`."""
    try:
        fn()
    except openai.BadRequestError as e:
        check(name, e.param == param and needle in e.message, (e.param, e.message))
        return
    raise AssertionError(f"{name}: no error raised")


def test_bad_constraints():
    msgs = [{"role": "user", "content": "hi"}]
    expect_400("bad schema type", lambda: client.chat.completions.create(
        model=MODEL, messages=msgs, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
        "response_format", "nope")
    expect_400("bad regex", lambda: client.completions.create(
        model=MODEL, prompt="hi", extra_body={"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs")
    expect_400("bad grammar", lambda: client.completions.create(
        model=MODEL, prompt="hi", extra_body={"guided_grammar": "start: missing_rule"}), "guided_grammar")
    expect_400("bad gbnf", lambda: client.completions.create(
        model=MODEL, prompt="hi", extra_body={"guided_grammar": 'root ::= answer'}), "guided_grammar", "GBNF")
    expect_400("two constraints", lambda: client.completions.create(
        model=MODEL, prompt="hi", extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "guided_choice", "only one")
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    check("serving after bad constraints", len(r.choices) == 1)


if __name__ == "__main__":
    for t in [test_chat_json_schema, test_chat_json_schema_stream, test_sampled_json_schema, test_json_object,
              test_completion_regex_and_choice, test_bad_constraints]:
        t()
    print("ALL OK")
