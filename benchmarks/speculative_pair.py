"""A target and a smaller draft model trained in minutes on CPU, so speculative decoding meets real acceptance.

The corpus is token ids drawn from a small stochastic grammar over the tiny tokenizer's vocabulary
(ids 5..511, past its special tokens), segment after segment:

- a phrase from a fixed lexicon of 48 (3-7 tokens): its first token decides the rest;
- counting: ``s, s+1, s+2, ...`` (4-10 tokens): a next-token rule either model learns;
- a copy of an earlier segment of the same sequence: predictable only by attending back to it
  (induction), which the 2-layer target learns sooner and better than the 1-layer draft;
- 1-3 random tokens: predictable by neither.

So a draft guesses much but not all of what the target says: greedy, its guesses agree with the
target's inside phrases and counts and part of the copies, and differ at segment starts.
Both are ``transformers``' ``LlamaForCausalLM`` built from a config by ``make_tiny_model`` (which
writes the tokenizer too), trained with AdamW on sequences of 128 tokens, and saved as Hugging Face
checkpoints. A pair is cached under its settings' hash, so reruns skip the training.

Measured (``python benchmarks/speculative_pair.py``, default settings, one thread, on a 2-core CPU
shared with other work, load ~12): training took 163 s for the target (96 wide, 2 layers, final loss
1.86) and 23 s for the draft (32 wide, 1 layer, loss 2.21); 600 steps of 16 x 128 tokens, about
0.07 s of CPU a step for the target. On 16 held-out prompts of 64 tokens, 64 greedy tokens each,
K=4: mean acceptance length 4.25 of 5, 81.1% of the draft's guesses accepted. (Two threads on the
same loaded machine stalled on OpenMP barriers at ~10 s a step: train on one.)

    python benchmarks/speculative_pair.py [--cache-dir DIR] [--steps 600] [--k 4]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

FIRST_ID, VOCAB = 5, 512  # corpus ids: past the tokenizer's 5 special tokens
SEQUENCE = 128


@dataclass(frozen=True)
class PairSettings:
    """What decides the trained pair (and its cache key)."""

    steps: int = 600
    batch: int = 16
    lr: float = 3e-3
    seed: int = 0
    target_hidden: int = 96
    target_layers: int = 2
    draft_hidden: int = 32
    draft_layers: int = 1

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


class Grammar:
    """The corpus' segments; the lexicon is fixed by ``seed`` (training and held-out text share it)."""

    def __init__(self, seed: int = 0):
        rng = random.Random(seed)
        starts = rng.sample(range(FIRST_ID, VOCAB), 48)
        self.phrases = [[start] + [rng.randrange(FIRST_ID, VOCAB) for _ in range(rng.randint(2, 6))]
                        for start in starts]

    def sequence(self, rng: random.Random, length: int = SEQUENCE) -> list[int]:
        tokens: list[int] = []
        segments: list[list[int]] = []
        while len(tokens) < length:
            kind = rng.random()
            if kind < 0.4:
                segment = list(rng.choice(self.phrases))
            elif kind < 0.6:
                start = rng.randrange(FIRST_ID, VOCAB - 10)
                segment = list(range(start, start + rng.randint(4, 10)))
            elif kind < 0.8 and segments:
                segment = list(rng.choice(segments))
            else:
                segment = [rng.randrange(FIRST_ID, VOCAB) for _ in range(rng.randint(1, 3))]
            segments.append(segment)
            tokens += segment
        return tokens[:length]

    def batch(self, rng: random.Random, count: int, length: int = SEQUENCE) -> torch.Tensor:
        return torch.tensor([self.sequence(rng, length) for _ in range(count)])


def _train(model_dir: Path, grammar: Grammar, settings: PairSettings, seed: int, device: str) -> float:
    """Train the checkpoint in ``model_dir`` in place; returns the final training loss."""
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.01)
    warmup = max(1, settings.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * max(0.1, 1 - step / settings.steps))
    rng = random.Random(seed)
    loss = torch.tensor(float("nan"))
    for _ in range(settings.steps):
        batch = grammar.batch(rng, settings.batch).to(device)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return float(loss.detach())


def trained_pair(cache_dir: str | Path, settings: PairSettings = PairSettings(),
                 device: str = "cpu") -> tuple[Path, Path, dict]:
    """``(target dir, draft dir, facts)``: trained now, or found under ``cache_dir`` from an earlier run.

    ``facts``: training seconds and final losses of the run that trained them (read back when cached).
    ``device``: where to train (the same pair up to the device's arithmetic; not part of the cache key).
    """
    from megatron_serve.model.tiny import make_tiny_model  # noqa: PLC0415

    root = Path(cache_dir) / f"pair-{settings.key()}"
    target, draft, done = root / "target", root / "draft", root / "trained.json"
    if done.is_file():
        return target, draft, {**json.loads(done.read_text()), "cached": True}
    grammar = Grammar(settings.seed)
    facts: dict = {"settings": asdict(settings)}
    for name, path, hidden, layers, seed in (("target", target, settings.target_hidden, settings.target_layers, 1),
                                             ("draft", draft, settings.draft_hidden, settings.draft_layers, 2)):
        make_tiny_model(path, seed=settings.seed + seed, hidden_size=hidden, num_layers=layers,
                        num_heads=max(2, hidden // 32), num_kv_heads=max(1, hidden // 64),
                        intermediate_size=hidden * 2, max_position_embeddings=1024)
        start = time.perf_counter()
        facts[f"{name}_loss"] = _train(path, grammar, settings, settings.seed + seed, device)
        facts[f"{name}_train_s"] = time.perf_counter() - start
    done.write_text(json.dumps(facts))
    return target, draft, {**facts, "cached": False}


def held_out_prompts(count: int, length: int, seed: int = 12345, grammar_seed: int = 0) -> list[list[int]]:
    """Prompts from the corpus' grammar, drawn with a seed training never uses."""
    grammar, rng = Grammar(grammar_seed), random.Random(seed)
    return [grammar.sequence(rng, length) for _ in range(count)]


def acceptance(target_dir: str | Path, draft_dir: str | Path, prompts: list[list[int]], k: int,
               new_tokens: int) -> tuple[float, float]:
    """Greedy speculative decoding simulated at the proposer level: ``(mean acceptance length, fraction of
    guesses accepted)``. The target's greedy continuation comes from a ``DraftModelProposer`` of the target
    itself (the engine's greedy tokens, as its tests show); each verify step keeps the guesses up to the first
    that differs, plus the target's own token (acceptance length = accepted + 1)."""
    from megatron_serve import InferenceConfig  # noqa: PLC0415
    from megatron_serve.engine.speculative.draft_model import DraftModelProposer  # noqa: PLC0415
    from megatron_serve.engine.speculative.proposer import DraftInput  # noqa: PLC0415

    config = InferenceConfig(device="cpu", dtype="float32")
    truth = DraftModelProposer(target_dir, config).propose(
        [DraftInput(str(i), p, new_tokens) for i, p in enumerate(prompts)])
    drafter = DraftModelProposer(draft_dir, config, target_dir=target_dir)
    steps = accepted = proposed = 0
    done = [0] * len(prompts)
    while any(d < new_tokens for d in done):
        live = [i for i, d in enumerate(done) if d < new_tokens]
        guesses = drafter.propose([DraftInput(str(i), prompts[i] + truth[i][: done[i]], k) for i in live])
        for i, guess in zip(live, guesses):
            expected = truth[i][done[i]: done[i] + k]
            match = next((j for j, (a, b) in enumerate(zip(guess, expected)) if a != b), min(len(guess), len(expected)))
            steps, accepted, proposed = steps + 1, accepted + match, proposed + len(guess)
            done[i] += match + 1
    return (accepted + steps) / steps, accepted / max(proposed, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "megatron-serve-speculative"))
    parser.add_argument("--steps", type=int, default=PairSettings.steps)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    args = parser.parse_args()
    settings = PairSettings(steps=args.steps)
    target, draft, facts = trained_pair(args.cache_dir, settings)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; pair in {target.parent} "
          f"({'cached' if facts['cached'] else 'trained now'}): target {facts['target_train_s']:.0f} s "
          f"(loss {facts['target_loss']:.2f}), draft {facts['draft_train_s']:.0f} s (loss {facts['draft_loss']:.2f})")
    length, rate = acceptance(target, draft, held_out_prompts(args.prompts, 64), args.k, 64)
    print(f"held-out greedy, K={args.k}: mean acceptance length {length:.2f} (of {args.k + 1}), "
          f"{100 * rate:.1f}% of guesses accepted")


if __name__ == "__main__":
    main()
