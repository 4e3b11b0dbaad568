"""Run inside the venv of the trainer-only distribution (``megatron-serve-invariant``), outside the checkout.

``python trainer_recipe.py MODEL_DIR RUNS_JSON``: the recipe over the runs' sequences (prompt + completion)
packed into one row and left-padded, with the trainer distribution alone; prints JSON: what is importable
of the server, and each layout's completion log probs per run.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import torch
import transformers

from megatron_kernels.invariant_trainer import ATTENTION_NAME, batch_invariant

SERVER = ("megatron_serve", "megatron_operator", "zmq", "fastapi", "uvicorn", "kopf", "msgspec", "kubernetes")


def completion_log_probs(logits: torch.Tensor, places: list[list[int]], runs: list[dict]) -> list[list[float]]:
    flat = torch.log_softmax(logits.float(), -1).reshape(-1, logits.shape[-1])
    return [[flat[place[len(run["prompt"]) - 1 + i], token].item() for i, token in enumerate(run["tokens"])]
            for place, run in zip(places, runs)]


def main(model_dir: str, runs_path: str) -> None:
    runs = json.loads(open(runs_path).read())
    sequences = [run["prompt"] + run["tokens"] for run in runs]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation=ATTENTION_NAME).eval()
    ids = torch.tensor([token for sequence in sequences for token in sequence])[None]
    positions = torch.cat([torch.arange(len(sequence)) for sequence in sequences])[None]
    places, start = [], 0
    for sequence in sequences:
        places.append(list(range(start, start + len(sequence))))
        start += len(sequence)
    length = 32 * -(-max(map(len, sequences)) // 32)
    padded = torch.zeros((len(sequences), length), dtype=torch.long)
    mask = torch.zeros_like(padded)
    for row, sequence in enumerate(sequences):
        padded[row, length - len(sequence):] = torch.tensor(sequence)
        mask[row, length - len(sequence):] = 1
    with torch.no_grad(), batch_invariant():
        packed = completion_log_probs(model(ids, position_ids=positions).logits, places, runs)
        left = model(padded, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
    left_places = [list(range(row * length + length - len(s), (row + 1) * length)) for row, s in enumerate(sequences)]
    print(json.dumps({"server_importable": [name for name in SERVER if importlib.util.find_spec(name)],
                      "packed": packed, "left_padded": completion_log_probs(left, left_places, runs)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
