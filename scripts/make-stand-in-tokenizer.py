#!/usr/bin/env python3
"""Writes a byte-level BPE tokenizer of Llama 3's vocabulary size (128,256 ids) for benchmarks of
dummy-weight shapes (`--load-format dummy --tokenizer DIR`): SmolLM2's real tokens, then tokens made
by concatenating pairs of them (each with the merge that makes it), then 256 special tokens at the
end laid out like Llama 3's (128000 <|begin_of_text|>, 128001 <|end_of_text|>, 128008 <|eom_id|>,
128009 <|eot_id|>, the rest reserved). A stand-in of Llama 3's size, NOT its vocabulary: what it
reproduces is the work a token mask does per step (the trie llguidance walks, 128k-bit masks).

Standard library only, so it runs on the GPU machine. Deterministic: the same input gives the same
file. Usage: make-stand-in-tokenizer.py OUT_DIR [--vocab-size N] [--source tokenizer.json]
"""

import argparse
import json
import os
import random
import sys

SPECIALS = 256
NAMED = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 8: "<|eom_id|>", 9: "<|eot_id|>"}


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--vocab-size", type=int, default=128256)
    ap.add_argument("--source", default=os.path.join(here, "..", "tests", "fixtures", "smollm2", "tokenizer.json"))
    args = ap.parse_args()

    with open(args.source, encoding="utf-8") as f:
        tok = json.load(f)
    model = tok["model"]
    if model.get("type") != "BPE" or tok.get("pre_tokenizer", {}).get("type") != "ByteLevel":
        sys.exit("the source must be a byte-level BPE tokenizer.json")
    vocab = dict(model["vocab"])
    merges = [m if isinstance(m, list) else m.split(" ") for m in model["merges"]]
    base = len(vocab)
    if max(vocab.values()) != base - 1:
        sys.exit("the source vocabulary is not dense")
    first_special = args.vocab_size - SPECIALS
    if first_special < base:
        sys.exit(f"--vocab-size must be at least {base + SPECIALS}")

    # Pieces to pair: the source's ordinary tokens (its added tokens are special text, not bytes).
    added = {a["content"] for a in tok.get("added_tokens", [])}
    pieces = sorted((i, p) for p, i in vocab.items() if p not in added)
    pieces = [p for _, p in pieces]
    rng = random.Random(20261125)
    next_id = base
    tries = 0
    while next_id < first_special:
        tries += 1
        if tries > 50 * args.vocab_size:
            sys.exit("could not find enough new pairs")
        a, b = pieces[rng.randrange(len(pieces))], pieces[rng.randrange(len(pieces))]
        if a + b in vocab:
            continue
        vocab[a + b] = next_id
        merges.append([a, b])
        next_id += 1

    added_tokens = list(tok.get("added_tokens", []))
    for k in range(SPECIALS):
        content = NAMED.get(k, f"<|reserved_special_token_{k}|>")
        if content in vocab:
            sys.exit(f"{content} is already a token")
        vocab[content] = first_special + k
        added_tokens.append({"id": first_special + k, "content": content, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True})

    model["vocab"] = vocab
    model["merges"] = merges
    tok["added_tokens"] = added_tokens
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    config = {"bos_token": NAMED[0], "eos_token": NAMED[1], "model_max_length": 131072,
              "tokenizer_class": "PreTrainedTokenizerFast",
              "comment": "A stand-in of Llama 3's vocabulary size built from SmolLM2's tokens, not Llama 3's vocabulary."}
    with open(os.path.join(args.out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    print(f"{args.out_dir}: {len(vocab)} tokens ({base} from the source, {first_special - base} pairs, {SPECIALS} special)")


if __name__ == "__main__":
    main()
