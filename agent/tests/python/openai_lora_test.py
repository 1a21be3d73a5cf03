"""LoRA adapters through the official `openai` Python client: the adapter is listed as a model and a
completion naming it gives PEFT's greedy text (fixtures/smollm2/lora_reference.json).

Usage: openai_lora_test.py BASE_URL BASE_MODEL ADAPTER LORA_REFERENCE_JSON
"""

import json
import sys

import openai

BASE_URL, BASE_MODEL, ADAPTER, REFERENCE = sys.argv[1:5]
ref = json.load(open(REFERENCE))["adapters"][ADAPTER]
client = openai.OpenAI(base_url=BASE_URL, api_key="unused", max_retries=0, timeout=120)

models = {m.id: m for m in client.models.list().data}
assert ADAPTER in models, f"{ADAPTER} not in /v1/models: {list(models)}"
assert BASE_MODEL in models, f"{BASE_MODEL} not in /v1/models: {list(models)}"

for p in ref["prompts"][:2]:
    g = p["greedy"]
    want = g["text"].replace("<|im_end|>", "")
    r = client.completions.create(model=ADAPTER, prompt=p["prompt"], max_tokens=g["max_new_tokens"], temperature=0)
    got = r.choices[0].text
    assert got == want, f"{ADAPTER} on {p['prompt']!r}: got {got!r}, want {want!r}"
    assert r.model == ADAPTER, r.model

try:
    client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=1)
    raise AssertionError("unknown model must fail")
except openai.NotFoundError:
    pass

print("ALL OK")
