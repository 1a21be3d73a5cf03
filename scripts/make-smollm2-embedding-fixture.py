#!/usr/bin/env python3
"""Makes tests/fixtures/smollm2/embeddings.json: decoder embeddings of SmolLM2-135M-Instruct with transformers.

What `serve --task embed` on the decoder GGUF must return: the hidden state after the model's final
RMSNorm at the last token of each input (last-token pooling), scaled to unit length. transformers
dequantizes the same GGUF (tests/fixtures/README.md) to float32; inputs are tokenized with
tests/fixtures/smollm2/tokenizer.json (no BOS is prepended, as the GGUF says), one forward per input
on the CPU in float32. Floats are rounded to 6 significant digits.

Run: $(scripts/torch-venv.sh) scripts/make-smollm2-embedding-fixture.py "$(scripts/fetch-model.sh)"
"""
import json
import os
import sys

import numpy
import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "tests", "fixtures", "smollm2")
INPUTS = [
    "The capital of France is",
    "A man is eating food.",
    "Rust is a systems programming language with memory safety and no garbage collector.",
    "hello",
]


def round6(x):
    return float(f"{x:.6g}")


def check_against_reference(model, tok):
    """The same hidden states through the tied LM head (the embedding matrix) must give the logits
    of smollm2/reference.json (made with another transformers version) within its 1e-3: the
    dequantized weights and the final norm are the ones the fixtures were made from."""
    with open(os.path.join(FIXTURES, "reference.json")) as f:
        reference = json.load(f)
    for prompt in reference["prompts"][:3]:
        ids = tok.encode(prompt["prompt"]).ids
        assert ids == prompt["input_ids"], (ids, prompt["input_ids"])
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
            logits = out.hidden_states[-1][0] @ model.model.embed_tokens.weight.T
        for position in prompt["positions"]:
            got = logits[position["pos"], position["top10_ids"]].tolist()
            worst = max(abs(a - b) for a, b in zip(got, position["top10_logits"]))
            assert worst <= 1e-3, (prompt["prompt"], position["pos"], worst)


def main(gguf_path):
    torch.manual_seed(0)
    torch.set_num_threads(2)
    folder, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    model.eval()
    tok = tokenizers.Tokenizer.from_file(os.path.join(FIXTURES, "tokenizer.json"))
    cases = []
    for text in INPUTS:
        ids = tok.encode(text).ids
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        # transformers' last hidden state is the final norm's output (LlamaModel applies `norm`
        # before appending it).
        last = out.hidden_states[-1][0, -1].to(torch.float64)
        unit = last / last.norm()
        cases.append({"text": text, "input_ids": ids, "embedding": [round6(v) for v in unit.tolist()],
                      "norm_before_normalize": round6(last.norm().item())})
    check_against_reference(model, tok)
    vecs = numpy.array([c["embedding"] for c in cases], dtype=numpy.float64)
    cos = vecs @ vecs.T
    reference = {
        "generated_by": {
            "script": "scripts/make-smollm2-embedding-fixture.py",
            "libraries": {"torch": torch.__version__, "transformers": transformers.__version__,
                          "tokenizers": tokenizers.__version__, "numpy": numpy.__version__},
            "dtype": "float32", "device": "cpu", "gguf_file": name,
        },
        "pooling": "last token of the final RMSNorm's output, L2-normalized",
        "hidden_size": len(cases[0]["embedding"]),
        "cases": cases,
        "cosine_similarity": [[round6(v) for v in row] for row in cos.tolist()],
    }
    with open(os.path.join(FIXTURES, "embeddings.json"), "w") as f:
        json.dump(reference, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
