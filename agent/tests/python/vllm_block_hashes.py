"""An independent implementation of the block hashes of vLLM's `sha256_cbor_64bit` prefix-caching
scheme (what llm-d's precise prefix-cache scorer computes from a prompt), written from its
description with hashlib and cbor2 (the CBOR library vLLM itself uses):

    hash(x)   = int.from_bytes(sha256(cbor2.dumps(x, canonical=True)).digest()[-8:], "big")
    NONE_HASH = hash(seed)                      # seed: PYTHONHASHSEED, a string
    block_i   = hash((parent, tuple(tokens_i), extra))   # parent: block_{i-1}, or NONE_HASH

Reads {"seed": str, "block_size": int, "chains": [{"tokens": [...], "extra": null | [int]}]} on
stdin; prints {"none_hash": int, "chains": [[block hash, ...], ...]} (full blocks only)."""
import hashlib
import json
import sys

import cbor2


def h(obj):
    return int.from_bytes(hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()[-8:], "big")


req = json.load(sys.stdin)
root = h(req["seed"])
bs = req["block_size"]
out = []
for chain in req["chains"]:
    tokens = chain["tokens"]
    extra = tuple(chain["extra"]) if chain["extra"] is not None else None
    parent = root
    hashes = []
    for i in range(len(tokens) // bs):
        parent = h((parent, tuple(tokens[i * bs:(i + 1) * bs]), extra))
        hashes.append(parent)
    out.append(hashes)
json.dump({"none_hash": root, "chains": out}, sys.stdout)
