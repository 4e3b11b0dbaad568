"""What the trainer recipe costs against plain ``transformers``: the same batch, forward (log probs, no
gradients) and forward + backward, with the default ``sdpa`` attention and with the recipe
(``attn_implementation="megatron_invariant"`` under ``batch_invariant()``), in one run.

The batches are what RL trainers feed: sequences of 30-100 % of the row, right-padded with a mask, and
the same sequences packed into rows (``position_ids`` restarting). Each mode runs ``--repeat`` times,
alternately; each row reports each mode's fastest process CPU time per batch and the recipe's throughput
as a fraction of the default's (default CPU time / recipe CPU time).

    OMP_NUM_THREADS=1 python benchmarks/trainer_recipe.py [--batch 8 --length 256] [--hidden-size 256 \
        --layers 4] [--dtype float32] [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import tempfile
import time

import torch
import transformers

from megatron_serve.invariant import ATTENTION_NAME, batch_invariant
from megatron_serve.model.tiny import make_tiny_model


def batches(count: int, length: int, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """A right-padded batch and the same sequences packed into rows of ``length``."""
    rng = random.Random(seed)
    sequences = [[rng.randrange(5, 500) for _ in range(rng.randint(length * 3 // 10, length))] for _ in range(count)]
    ids = torch.zeros((count, length), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, :len(sequence)] = torch.tensor(sequence)
        mask[row, :len(sequence)] = 1
    rows, positions, current, current_positions = [], [], [], []
    for sequence in sequences:
        if len(current) + len(sequence) > length:
            rows.append(current + [0] * (length - len(current)))
            positions.append(current_positions + list(range(length - len(current))))
            current, current_positions = [], []
        current += sequence
        current_positions += list(range(len(sequence)))
    rows.append(current + [0] * (length - len(current)))
    positions.append(current_positions + list(range(length - len(current))))
    return {"right-padded": {"input_ids": ids, "attention_mask": mask},
            "packed": {"input_ids": torch.tensor(rows), "position_ids": torch.tensor(positions)}}


def run(model: torch.nn.Module, inputs: dict[str, torch.Tensor], recipe: bool, backward: bool) -> float:
    """Process CPU seconds of one forward (and backward)."""
    start = time.process_time()
    with torch.set_grad_enabled(backward), (batch_invariant() if recipe else contextlib.nullcontext()):
        logits = model(**inputs).logits
        log_probs = torch.log_softmax(logits.float(), -1)
        if backward:
            log_probs[..., :-1, :].gather(-1, inputs["input_ids"][..., 1:, None]).sum().backward()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, hidden {args.hidden_size}, "
          f"{args.layers} layers, batch {args.batch} x {args.length}")
    print(f"{'batch':<14}{'pass':<20}{'default CPU ms':>16}{'recipe CPU ms':>15}{'throughput':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model(f"{tmp}/llama", seed=0, hidden_size=args.hidden_size, num_layers=args.layers,
                                        num_heads=8, num_kv_heads=4, intermediate_size=args.hidden_size * 8 // 3))
        dtype = getattr(torch, args.dtype)
        models = {recipe: transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=ATTENTION_NAME if recipe else "sdpa") for recipe in (False, True)}
        for name, inputs in batches(args.batch, args.length).items():
            for backward in (False, True):
                times: dict[bool, list[float]] = {False: [], True: []}
                for recipe in (False, True):  # warm-up
                    run(models[recipe], inputs, recipe, backward)
                for _ in range(args.repeat):
                    for recipe in (False, True):
                        times[recipe].append(run(models[recipe], inputs, recipe, backward))
                base, mode = min(times[False]), min(times[True])
                label = "forward + backward" if backward else "forward (log probs)"
                print(f"{name:<14}{label:<20}{base * 1e3:>16.1f}{mode * 1e3:>15.1f}{base / mode:>11.2f}x")


if __name__ == "__main__":
    main()
