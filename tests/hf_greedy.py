"""transformers' greedy reference for an engine's tokens, from one forward pass per prompt."""

from __future__ import annotations

import torch


def end_of_text_ids(model: torch.nn.Module) -> list[int]:
    """The ids ``generate``'s ``min_new_tokens`` keeps out of the choice: the generation config's end of text."""
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def greedy_choices(model: torch.nn.Module, token_lists: list[list[int]], generated_lists: list[list[int]],
                   eos: list[int] | None = None) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy choice and its log prob (raw logits, as ``generate``'s ``output_logits``) at each
    generated position, one prompt at a time (no padding effects). One forward pass over the prompt and the engine's
    tokens gives every position's logits given the engine's prefix: where the engine's tokens are the argmax at every
    position, they are what greedy ``generate`` makes one step (one forward pass) at a time, without its per-step
    overhead. ``eos`` (default: the model's end of text) is kept out of the argmax, as ``min_new_tokens`` does."""
    eos = end_of_text_ids(model) if eos is None else eos
    results = []
    for tokens, generated in zip(token_lists, generated_lists):
        with torch.no_grad():
            logits = model(torch.tensor([tokens + generated])).logits[0, len(tokens) - 1:-1].float()
        choosable = logits.clone()
        choosable[:, eos] = -float("inf")
        chosen = choosable.argmax(-1).tolist()
        results.append((chosen, [torch.log_softmax(row, -1)[t].item() for row, t in zip(logits, chosen)]))
    return results
