#!/usr/bin/env python3
"""Makes the sequence-classification references in tests/fixtures/minilm/classifier/ with transformers.

A seeded random classification head on the all-MiniLM-L6-v2 body (its pooler comes from the
checkpoint): `BertForSequenceClassification` with 3 labels (classify) and with 1 label (a
cross-encoder for rerank/score). For each head it saves only what the body does not have
(`classifier.weight`, `classifier.bias`) as `<name>/head.safetensors`, the model's `config.json`,
and `reference.json`: inputs (single texts and query/document pairs), the ids and token types
transformers' tokenizer made, and the logits of a float32 forward on the CPU.

Run: $(scripts/torch-venv.sh) scripts/make-minilm-classifier-fixture.py "$(scripts/fetch-encoder.sh)"
"""
import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoTokenizer, BertForSequenceClassification

SEED = 20261125
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "minilm", "classifier")

SINGLES = [
    "A man is eating food.",
    "The new movie is awesome.",
    "I would not recommend this restaurant to anyone.",
    "Stock markets fell sharply after the announcement. " * 12,
]
QUERY = "How do I bake bread at home?"
DOCUMENTS = [
    "Mix flour, water, yeast and salt, knead, let it rise, then bake at 230 degrees.",
    "The stock market closed higher on Friday.",
    "Sourdough needs a starter and a long, slow fermentation.",
    "Bread",
]


def make(folder, name, labels):
    torch.manual_seed(SEED)
    id2label = {i: l for i, l in enumerate(labels)}
    model = BertForSequenceClassification.from_pretrained(
        folder, num_labels=len(labels), id2label=id2label, label2id={l: i for i, l in id2label.items()}
    )
    # Larger than the default init (std 0.02) so the logits spread and a wrong head shows.
    with torch.no_grad():
        model.classifier.weight.normal_(0.0, 0.5)
        model.classifier.bias.normal_(0.0, 0.1)
    model.eval()
    tok = AutoTokenizer.from_pretrained(folder)
    out_dir = os.path.join(OUT, name)
    os.makedirs(out_dir, exist_ok=True)
    save_file(
        {"classifier.weight": model.classifier.weight.detach().contiguous(),
         "classifier.bias": model.classifier.bias.detach().contiguous()},
        os.path.join(out_dir, "head.safetensors"),
    )
    # As save_pretrained() would write it: the class that owns the head.
    model.config.architectures = [type(model).__name__]
    # The hub id, not this machine's cache path.
    model.config._name_or_path = "sentence-transformers/all-MiniLM-L6-v2"
    model.config.to_json_file(os.path.join(out_dir, "config.json"))
    cases = [{"text": t} for t in SINGLES] + [{"text": QUERY, "text_pair": d} for d in DOCUMENTS]
    for case in cases:
        enc = tok(case["text"], case.get("text_pair"), return_tensors="pt", truncation=False, padding=False)
        with torch.no_grad():
            logits = model(**enc).logits[0]
        case["input_ids"] = enc["input_ids"][0].tolist()
        case["token_type_ids"] = enc["token_type_ids"][0].tolist()
        case["logits"] = [float(x) for x in logits]
    ref = {
        "generated_by": {
            "script": "scripts/make-minilm-classifier-fixture.py",
            "libraries": {"torch": torch.__version__, "transformers": transformers.__version__},
            "dtype": "float32", "device": "cpu", "seed": SEED,
            "head": "classifier.weight ~ N(0, 0.5), classifier.bias ~ N(0, 0.1); pooler from the checkpoint",
        },
        "labels": labels,
        "cases": cases,
    }
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")


def main():
    torch.set_num_threads(2)
    folder = sys.argv[1]
    make(folder, "three-labels", ["negative", "neutral", "positive"])
    make(folder, "cross-encoder", ["relevance"])


if __name__ == "__main__":
    main()
