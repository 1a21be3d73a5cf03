"""Drives a running peregrine-agent with the official `openai` Python client.

Usage: openai_client_test.py BASE_URL MODEL API_KEY LIMITED_KEY FIXTURES_REFERENCE_JSON

Expected outputs come from the transformers fixtures (greedy decodes of SmolLM2), never from the
server itself. Exits non-zero with a message on the first failure.
"""

import json
import math
import sys

import openai

BASE_URL, MODEL, API_KEY, LIMITED_KEY, REFERENCE = sys.argv[1:6]
ref = json.load(open(REFERENCE))
client = openai.OpenAI(base_url=BASE_URL, api_key=API_KEY, max_retries=0, timeout=120)
SPECIAL = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")


def strip_special(text):
    for s in SPECIAL:
        text = text.replace(s, "")
    return text


def clean_prompts():
    """Fixture prompts whose greedy decode has no near-tie, so any correct engine reproduces it."""
    out = []
    for p in ref["prompts"]:
        if all(s["top2_margin"] >= 1e-2 for s in p["greedy"]["steps"]):
            out.append(p)
    assert len(out) >= 3, "fixtures changed: too few clean prompts"
    return out


def expect_greedy(p):
    g = p["greedy"]
    finish = "stop" if g["stopped_at_eos"] else "length"
    return strip_special(g["text"]), finish, len(g["ids"])


def check(name, cond, detail=""):
    if not cond:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok {name}", flush=True)


def test_models():
    ids = [m.id for m in client.models.list().data]
    check("models.list", MODEL in ids, ids)


def test_completions():
    for p in clean_prompts()[:3]:
        text, finish, n = expect_greedy(p)
        r = client.completions.create(model=MODEL, prompt=p["prompt"], max_tokens=p["greedy"]["max_new_tokens"],
                                      temperature=0, logprobs=2)
        c = r.choices[0]
        check(f"completion text {p['prompt']!r}", c.text == text, f"{c.text!r} != {text!r}")
        check("completion finish_reason", c.finish_reason == finish, c.finish_reason)
        check("completion usage", (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens)
              == (len(p["input_ids"]), n, len(p["input_ids"]) + n), r.usage)
        want = [s["logprob"] for s in p["greedy"]["steps"]]
        got = c.logprobs.token_logprobs
        check("completion logprobs", len(got) == len(want) and all(abs(a - b) < 2e-2 for a, b in zip(got, want)),
              f"{got[:4]} vs {want[:4]}")
        check("completion top_logprobs", all(len(t) >= 1 for t in c.logprobs.top_logprobs), c.logprobs.top_logprobs[:2])
        # The sampled token is the argmax under greedy decoding, so it leads its top_logprobs.
        first_top = max(c.logprobs.top_logprobs[0].values())
        check("completion top1 == sampled", math.isclose(first_top, got[0], abs_tol=1e-4), (first_top, got[0]))
    # Token-id prompts give the same result as text prompts.
    p = clean_prompts()[0]
    r = client.completions.create(model=MODEL, prompt=p["input_ids"], max_tokens=8, temperature=0)
    check("completion from token ids", r.choices[0].text == strip_special(expect_greedy(p)[0])[: len(r.choices[0].text)]
          and r.usage.prompt_tokens == len(p["input_ids"]), r.choices[0].text)


def test_stop_string():
    p = clean_prompts()[1]
    text, _, _ = expect_greedy(p)
    # A stop string from the middle of the known continuation.
    cut = len(text) // 2
    stop = text[cut:cut + 3]
    r = client.completions.create(model=MODEL, prompt=p["prompt"], max_tokens=32, temperature=0, stop=[stop])
    c = r.choices[0]
    check("stop string cuts text", c.text == text[: text.index(stop)], f"{c.text!r} stop={stop!r}")
    check("stop string finish_reason", c.finish_reason == "stop", c.finish_reason)


def test_streaming_completion():
    p = clean_prompts()[0]
    text, finish, n = expect_greedy(p)
    stream = client.completions.create(model=MODEL, prompt=p["prompt"], max_tokens=32, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    pieces, finishes, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.text)
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    check("stream completion text", "".join(pieces) == text, "".join(pieces))
    check("stream completion finish", finishes == [finish], finishes)
    check("stream completion usage", usage is not None and usage.completion_tokens == n, usage)


def chat_case():
    c = ref["chat"][0]
    return c["messages"], strip_special(c["greedy"]["text"]), ("stop" if c["greedy"]["stopped_at_eos"] else "length"), c


def test_chat():
    messages, text, finish, c = chat_case()
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                       logprobs=True, top_logprobs=3)
    ch = r.choices[0]
    check("chat content", ch.message.content == text, f"{ch.message.content!r} != {text!r}")
    check("chat role", ch.message.role == "assistant", ch.message.role)
    check("chat finish_reason", ch.finish_reason == finish, ch.finish_reason)
    check("chat prompt tokens", r.usage.prompt_tokens == len(c["input_ids"]), r.usage)
    lp = ch.logprobs.content
    want = [s["logprob"] for s in c["greedy"]["steps"]]
    check("chat logprobs", len(lp) == len(want) and all(abs(a.logprob - b) < 2e-2 for a, b in zip(lp, want)),
          [a.logprob for a in lp[:4]])
    check("chat top_logprobs", all(len(t.top_logprobs) == 3 for t in lp), [len(t.top_logprobs) for t in lp])


def test_chat_stream_usage():
    messages, text, finish, c = chat_case()
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    content, roles, finishes, usage, n_chunks = [], [], [], None, 0
    for chunk in stream:
        n_chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
            check("chat stream usage chunk has no choices", chunk.choices == [], chunk)
        for ch in chunk.choices:
            if ch.delta.role:
                roles.append(ch.delta.role)
            if ch.delta.content:
                content.append(ch.delta.content)
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    check("chat stream content", "".join(content) == text, "".join(content))
    check("chat stream role once", roles == ["assistant"], roles)
    check("chat stream finish", finishes == [finish], finishes)
    check("chat stream usage", usage is not None and usage.prompt_tokens == len(c["input_ids"])
          and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage)
    check("chat stream is incremental", n_chunks > 3, n_chunks)


def test_seeded_sampling_reproducible():
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    check("seeded sampling reproducible", a == b, (a, b))


def expect_error(name, cls, fn):
    try:
        fn()
    except cls as e:
        body = e.body if isinstance(e.body, dict) else {}
        check(name, "message" in body and "type" in body, e.body)
        return
    except Exception as e:  # noqa: BLE001 - report the wrong class
        raise AssertionError(f"{name}: expected {cls.__name__}, got {type(e).__name__}: {e}")
    raise AssertionError(f"{name}: expected {cls.__name__}, no error raised")


def test_errors():
    expect_error("unknown model → NotFoundError", openai.NotFoundError,
                 lambda: client.completions.create(model="no-such-model", prompt="hi", max_tokens=1))
    expect_error("context too long → BadRequestError", openai.BadRequestError,
                 lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=10**9))
    expect_error("bad temperature → BadRequestError", openai.BadRequestError,
                 lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=1, temperature=7))
    expect_error("negative max_tokens → BadRequestError", openai.BadRequestError,
                 lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-5))
    expect_error("unknown field → BadRequestError", openai.BadRequestError,
                 lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"frobnicate": 1}))
    expect_error("wrong type → UnprocessableEntityError", openai.UnprocessableEntityError,
                 lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens="many"))
    bad = openai.OpenAI(base_url=BASE_URL, api_key="sk-wrong", max_retries=0)
    expect_error("wrong key → AuthenticationError", openai.AuthenticationError,
                 lambda: bad.models.list())
    limited = openai.OpenAI(base_url=BASE_URL, api_key=LIMITED_KEY, max_retries=0)
    limited.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    expect_error("over rpm → RateLimitError", openai.RateLimitError,
                 lambda: limited.completions.create(model=MODEL, prompt="hi", max_tokens=1))
    # Still serving after all that.
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    check("serving after errors", len(r.choices) == 1, r)


if __name__ == "__main__":
    check("openai version", openai.__version__ is not None, "")
    for t in [test_models, test_completions, test_stop_string, test_streaming_completion, test_chat,
              test_chat_stream_usage, test_seeded_sampling_reproducible, test_errors]:
        t()
    print("ALL OK")
