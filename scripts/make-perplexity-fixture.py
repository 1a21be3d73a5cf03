#!/usr/bin/env python3
"""transformers' float32 perplexity of SmolLM2 on the eval text (agent/src/eval/pride-and-prejudice-ch1.txt,
Project Gutenberg eBook #1342, chapter 1; public domain). The model is the test GGUF, dequantized to
float32 by transformers' GGUF loader (the recipe of tests/fixtures/smollm2/reference.json), one forward
pass over the whole text on the CPU. Writes tests/fixtures/smollm2/perplexity.json: the token ids
(the GGUF tokenizer, no BOS), the negative log-likelihood of every token after the first given the ones
before it, and the perplexity exp(mean NLL) of the whole text and of its first 256 tokens.

Needs torch, transformers and gguf (scripts/torch-venv.sh's venv plus `pip install gguf==0.19.0`):
    $(scripts/torch-venv.sh) scripts/make-perplexity-fixture.py "$(scripts/fetch-model.sh)"
"""
import json
import math
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "agent/src/eval/pride-and-prejudice-ch1.txt"
OUT = ROOT / "tests/fixtures/smollm2/perplexity.json"
PREFIX = 256


def main(gguf):
    gguf = Path(gguf)
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32).eval()
    # The GGUF has no output.weight: the LM head is the embedding (transformers 4.46 does not tie it
    # from GGUF metadata by itself and would leave it random).
    model.lm_head.weight = model.model.embed_tokens.weight
    text = TEXT.read_text()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].to(torch.float64)
    logp = torch.log_softmax(logits, dim=-1)
    nll = [-float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    ppl = lambda xs: math.exp(sum(xs) / len(xs))
    OUT.write_text(json.dumps({
        "generated_by": {
            "script": "scripts/make-perplexity-fixture.py",
            "libraries": {"torch": torch.__version__, "transformers": transformers.__version__},
            "dtype": "float32", "device": "cpu", "torch_threads": 2,
            "weights": "the GGUF dequantized to float32 by transformers' GGUF loader",
        },
        "text_file": "agent/src/eval/pride-and-prejudice-ch1.txt",
        "source": "Project Gutenberg eBook #1342, Jane Austen, Pride and Prejudice, chapter 1 (public domain)",
        "input_ids": ids,
        "nll": [float(f"{x:.6g}") for x in nll],
        "perplexity": float(f"{ppl(nll):.6g}"),
        "prefix_tokens": PREFIX,
        "prefix_perplexity": float(f"{ppl(nll[:PREFIX - 1]):.6g}"),
    }, indent=1) + "\n")
    print(f"{len(ids)} tokens, perplexity {ppl(nll):.4f}, first {PREFIX}: {ppl(nll[:PREFIX - 1]):.4f}")


if __name__ == "__main__":
    main(sys.argv[1])
