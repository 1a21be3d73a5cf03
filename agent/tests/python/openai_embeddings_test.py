"""Drives a peregrine-agent serving all-MiniLM-L6-v2 with the official `openai` Python client.

Usage: openai_embeddings_test.py BASE_URL MODEL MINILM_REFERENCE_JSON

Expected vectors come from Sentence-Transformers (tests/fixtures/minilm/reference.json), never from
the server itself. Exits non-zero with a message on the first failure.
"""

import base64
import json
import math
import struct
import sys

import openai

BASE_URL, MODEL, REFERENCE = sys.argv[1:4]
ref = json.load(open(REFERENCE))
client = openai.OpenAI(base_url=BASE_URL, api_key="unused", max_retries=0, timeout=120)
TOL = 1e-5


def check(name, cond, detail=""):
    if not cond:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok {name}", flush=True)


def max_diff(a, b):
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def test_floats_and_base64():
    # The client asks for base64 unless told otherwise, and decodes it itself.
    for fmt in ("float", None):
        kwargs = {"encoding_format": fmt} if fmt else {}
        r = client.embeddings.create(model=MODEL, input=ref["sentences"], **kwargs)
        check(f"three vectors ({fmt or 'default'})", len(r.data) == 3 and [d.index for d in r.data] == [0, 1, 2])
        for d, want in zip(r.data, ref["embeddings"]):
            diff = max_diff(d.embedding, want)
            check(f"sentence {d.index} within {TOL} ({fmt or 'default'})", diff <= TOL, diff)
        tokens = sum(len(ids) for ids in ref["input_ids"])
        check("usage counts the tokens", r.usage.prompt_tokens == tokens and r.usage.total_tokens == tokens, r.usage)
        check("model echoed", r.model == MODEL, r.model)


def test_raw_base64_and_cosines():
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=ref["sentences"], encoding_format="base64")
    body = json.loads(raw.text)
    vecs = []
    for d in body["data"]:
        b = base64.b64decode(d["embedding"])
        vecs.append(struct.unpack(f"<{len(b) // 4}f", b))
    for i in range(3):
        for j in range(3):
            cos = sum(x * y for x, y in zip(vecs[i], vecs[j]))
            check(f"cosine {i},{j}", abs(cos - ref["cosine_similarity"][i][j]) <= TOL, cos)


def test_token_ids_and_single_string():
    r = client.embeddings.create(model=MODEL, input=ref["input_ids"][1], encoding_format="float")
    check("token ids give the reference vector", max_diff(r.data[0].embedding, ref["embeddings"][1]) <= TOL)
    r = client.embeddings.create(model=MODEL, input=ref["sentences"][2], encoding_format="float")
    check("a single string", max_diff(r.data[0].embedding, ref["embeddings"][2]) <= TOL)


def test_dimensions():
    r = client.embeddings.create(model=MODEL, input=ref["sentences"][0], dimensions=64, encoding_format="float")
    v = r.data[0].embedding
    want = ref["embeddings"][0][:64]
    norm = math.sqrt(sum(x * x for x in want))
    check("dimensions=64: 64 components", len(v) == 64, len(v))
    check("dimensions=64: leading components re-normalized", max_diff(v, [x / norm for x in want]) <= TOL)


def expect_error(name, cls, **kwargs):
    try:
        client.embeddings.create(**kwargs)
    except cls as e:
        check(name, 400 <= e.status_code < 500 and isinstance(e.body, dict) and bool(e.body.get("message")), e)
        return
    except openai.APIStatusError as e:
        raise AssertionError(f"{name}: expected {cls.__name__}, got {e.status_code}: {e}")
    raise AssertionError(f"{name}: no error")


def test_bad_inputs():
    expect_error("empty string", openai.BadRequestError, model=MODEL, input="", encoding_format="float")
    expect_error("empty list", openai.BadRequestError, model=MODEL, input=[], encoding_format="float")
    expect_error("10k inputs", openai.BadRequestError, model=MODEL, input=["x"] * 10000, encoding_format="float")
    expect_error("over-long input", openai.BadRequestError, model=MODEL, input="word " * 400, encoding_format="float")
    expect_error("token id outside the vocabulary", openai.BadRequestError, model=MODEL, input=[[101, 99999]], encoding_format="float")
    expect_error("dimensions above the width", openai.BadRequestError, model=MODEL, input="a", dimensions=385, encoding_format="float")
    expect_error("unknown model", openai.NotFoundError, model="nope", input="a", encoding_format="float")
    expect_error("wrong input type", openai.UnprocessableEntityError, model=MODEL, input=12.5, encoding_format="float")
    expect_error("unknown encoding_format", openai.UnprocessableEntityError, model=MODEL, input="a", encoding_format="int8")
    # Still serving, correctly.
    r = client.embeddings.create(model=MODEL, input=ref["sentences"][0], encoding_format="float")
    check("serves after bad inputs", max_diff(r.data[0].embedding, ref["embeddings"][0]) <= TOL)


def test_generation_refused():
    try:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    except openai.BadRequestError as e:
        check("completions refused with 400", "encoder" in str(e), e)
        return
    raise AssertionError("completions on an encoder did not fail")


test_floats_and_base64()
test_raw_base64_and_cosines()
test_token_ids_and_single_string()
test_dimensions()
test_bad_inputs()
test_generation_refused()
print("ALL OK")
