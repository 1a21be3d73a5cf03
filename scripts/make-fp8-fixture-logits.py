#!/usr/bin/env python3
"""transformers' float32 logits for tests/fixtures/fp8_tiny (made by make-fp8-fixture.py) or
tests/fixtures/int8_tiny (make-int8-fixture.py): the checkpoint's 8-bit weights dequantized
(`dequantized.safetensors`, made by those scripts), every other tensor as stored, run by
LlamaForCausalLM in float32 on the CPU. Writes reference_logits.json: for a few token
sequences, the logits of every position (vocab 128).

Needs torch and transformers (any venv with them; e.g. torch 2.5.1 CPU/cu124 and transformers 4.46):
    $VENV/bin/python scripts/make-fp8-fixture-logits.py tests/fixtures/fp8_tiny  # or .../int8_tiny
"""
import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

SEQUENCES = [[1, 17, 42, 99, 5, 64, 3, 127], [2, 2, 2, 50, 51, 52, 0, 9], [100, 7, 33, 81, 12, 120, 64, 1]]


def main(folder):
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config")  # the weights below are already dequantized
    cfg["torch_dtype"] = "float32"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32).eval()
    dequantized = load_file(folder / "dequantized.safetensors")
    state = {k: v.to(torch.float32) for k, v in load_file(folder / "model.safetensors").items()
             if k not in dequantized and not k.endswith("weight_scale")}
    state.update(dequantized)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    assert not missing and not unexpected, (missing, unexpected)
    out = []
    with torch.no_grad():
        for seq in SEQUENCES:
            logits = model(torch.tensor([seq])).logits[0]
            out.append({"input_ids": seq, "logits": [[float(f"{x:.6g}") for x in row] for row in logits.tolist()]})
    (folder / "reference_logits.json").write_text(json.dumps({
        "generated_by": f"scripts/make-fp8-fixture-logits.py: torch {torch.__version__}, transformers "
                        f"{transformers.__version__}, float32, CPU; logits rounded to 6 significant digits",
        "sequences": out}, separators=(",", ":")) + "\n")
    print(f"wrote {folder / 'reference_logits.json'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/fp8_tiny")
