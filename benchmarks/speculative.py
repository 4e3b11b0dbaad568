"""Speculative decoding: tokens per target forward and throughput with and without each method, in one run.

The model pair is trained by the benchmark itself (:mod:`speculative_pair`: a 2-layer target and a
1-layer draft on a synthetic grammar, cached between runs), so a draft's acceptance is real, neither
0 nor 100%. Every row runs the same held-out prompts through the engine with no speculation, with
``ngram`` (prompt lookup) and with ``draft_model``, at concurrency 1 (requests one after another) and
64 (all in flight), greedy, sampled (temperature 1, a seed per request) and ``sampled-n4`` (the same,
each prompt asked for ``--n`` choices, as users of sampling do), and n-gram also on a repetitive-edit
workload (a passage, then its first words again: the target goes on copying it).
A row reports generated tokens per target forward (an engine step that computes tokens; the step that
only reads the last one in flight is not one), tokens per second of wall time, CPU milliseconds per
token, and each as a ratio to no speculation in the same run. Every row also says whether the tokens
equal no speculation's (they must: verification draws each position from the request's own seeded
stream, so seeded sampled text is reproduced too).

An ``n`` row's prompt becomes ``n`` requests as the engine's API expands it (``SamplingParams(n=4,
seed=i).choices()``: one seed, a stream per choice), its choices in flight together. Concurrency counts
sequences in flight, so the batch is what the other rows at that concurrency run: 64 is 16 prompts of
4 choices in one round; at 1 a prompt's choices cannot be split, so ``--requests-c1`` prompts run one after
another, a batch of ``n`` each. The warm-up round is built the same way.

Each engine first serves a warm-up round of other prompts with the same sampling, untimed (``--cold``: none):
a server has served before, so its K policy has measured what steps cost and its first probes are behind it;
cold, a bucket's first probe shows at concurrency 64 (2 of 65 steps).

Threads are pinned (``--threads``, default 1, as ``torch.set_num_threads`` and ``OMP_NUM_THREADS``):
on a shared 2-core machine throughput moves with everyone's load, CPU time per token much less.
``--repeat N`` runs each row N times with the methods alternated and prints medians (each ratio taken
against the same repeat's ``none``): on a loaded machine one run's ratios swing by 10-15%.

Goals (issue 39): at least 1.5x tokens per target forward at concurrency 1 with the trained draft, and
at least 0.98x of no speculation's throughput at concurrency 64.

The pair's training time and the draft's greedy agreement with the target on held-out text
(``speculative_pair.acceptance``, K=4) are printed first. Methods run adaptive (``ngram``, ``draft_model``: K per
request and step, engine.speculative.adaptive) and with K pinned to ``--k`` (``ngram/K``, ``draft_model/K``); the
``mean K`` column is draft tokens per decode row that could speculate. The figures measured with it, and what they
say, are in docs/speculative.md (Adaptive K, and its "Rows of the benchmark").

    python benchmarks/speculative.py [--k 4] [--concurrency 1,64] [--methods none,draft_model,draft_model/K]
        [--n 4] [--repeat N] [--cold | --warm-and-cold] [--cache-dir DIR] [--device cuda --dtype bfloat16]

Needs ``InferenceConfig.speculative``; exits 2 with a message on a build without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine.core import DynamicInferenceEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative_pair import PairSettings, acceptance, held_out_prompts, trained_pair  # noqa: E402

#: ``method`` adapts K per request and step (the default); ``method/K`` pins K to ``--k`` (``adaptive: false``)
METHODS = ("none", "ngram", "ngram/K", "draft_model", "draft_model/K")


def speculative_config(method: str, k: int, draft_dir: Path):
    """The engine's config for ``method`` (None: no speculation), vLLM's ``--speculative-config`` fields."""
    from megatron_serve.config import SpeculativeConfig  # noqa: PLC0415 - checked present in main()

    if method == "none":
        return None
    name, pinned = method.removesuffix("/K"), method.endswith("/K")
    if name == "ngram":
        return SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=4,
                                 adaptive=not pinned)
    return SpeculativeConfig(method="draft_model", num_speculative_tokens=k, model=str(draft_dir), adaptive=not pinned)


@dataclasses.dataclass
class Run:
    wall: float
    cpu: float
    forwards: int
    tokens: list[list[int]]
    mean_k: float  # draft tokens per decode row that could speculate (K pinned: about --k)

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)


@dataclasses.dataclass
class Workload:
    """One group of rows: ``prompts`` run with one sampling at one concurrency, each prompt as ``n`` choices."""
    name: str
    sampling: str  # "greedy", "sampled" (temperature 1) or "sampled-n<n>" (the same, n choices a prompt)
    concurrency: int
    prompts: list[list[int]]
    warmup: list[list[int]]
    n: int = 1

    @property
    def in_flight(self) -> int:
        """Sequences in flight: ``concurrency`` in whole prompts (a prompt's choices run together, as a server
        runs them), at least one prompt: at concurrency 1 the batch is ``n``."""
        return self.n * max(1, self.concurrency // self.n)

    def sequences(self, prompts: list[list[int]]) -> list[list[int]]:
        """Each prompt ``n`` times, its choices side by side (in the order of :meth:`params`)."""
        return [prompt for prompt in prompts for _ in range(self.n)]

    def params(self, new_tokens: int) -> list[SamplingParams]:
        """One per sequence, prompt ``i`` seeded ``i``; its ``n`` choices are expanded as the engine's API does
        (``SamplingParams.choices``: one seed, a stream per sample index), so each draws its own tokens."""
        temperature = 0.0 if self.sampling == "greedy" else 1.0
        return [choice for i in range(len(self.prompts))
                for choice in SamplingParams(temperature=temperature, seed=i, n=self.n, ignore_eos=True,
                                             num_tokens_to_generate=new_tokens).choices()]


def run(target_dir: Path, config: InferenceConfig, workload: Workload, params: list[SamplingParams]) -> Run:
    """All of ``workload``'s sequences, ``workload.in_flight`` at a time; counts engine steps (one target forward
    each). The engine first serves ``workload.warmup`` (other prompts, the same sampling), untimed: a server has
    served before, so its K policy has measured what steps cost and its first probes are behind it (``--cold``:
    none)."""
    engine = DynamicInferenceEngine.from_model_dir(target_dir, config, vocabulary_only=True)
    serve(engine, [DynamicInferenceRequest(f"warmup-{i}", None, prompt, p)
                   for i, (prompt, p) in enumerate(zip(workload.sequences(workload.warmup), params))],
          workload.in_flight)
    counts = ("spec_decode_num_draft_tokens", "spec_decode_num_rows")
    before = [engine.stats.counters[name] for name in counts]
    requests = [DynamicInferenceRequest(str(i), None, prompt, p)
                for i, (prompt, p) in enumerate(zip(workload.sequences(workload.prompts), params))]
    gc.collect()  # the engines of earlier rows, freed now rather than in this row's timed loop
    wall, cpu = time.perf_counter(), time.process_time()
    forwards = serve(engine, requests, workload.in_flight)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    drafts, rows = (engine.stats.counters[name] - was for name, was in zip(counts, before))
    engine.shutdown()
    mean_k = drafts / max(rows, 1)
    return Run(wall, cpu, forwards, [r.generated_tokens for r in requests], mean_k)


def serve(engine: DynamicInferenceEngine, requests: list[DynamicInferenceRequest], concurrency: int) -> int:
    """Run ``requests`` to the end, ``concurrency`` at a time; the target forwards it took: the steps that computed
    tokens (a step that only reads the step in flight, the last of a round, runs none)."""
    forwards = 0
    for start in range(0, len(requests), concurrency):
        for request in requests[start: start + concurrency]:
            engine.add_request(request)
        while engine.has_unfinished_requests():
            computed = engine.load().computed_tokens
            engine.step()
            forwards += engine.load().computed_tokens != computed
    return forwards


def workloads(args: argparse.Namespace) -> list[Workload]:
    """Held-out grammar text at each concurrency, greedy, sampled and (``--n`` > 1) sampled with ``n`` choices a
    prompt, then the edit workload (greedy). Concurrency 1 runs ``--requests-c1`` prompts one after another,
    a higher one a single round. The warm-up is one round of other prompts (two prompts at concurrency 1);
    none with ``--cold``."""
    kinds = [("greedy", 1), ("sampled", 1), *([(f"sampled-n{args.n}", args.n)] if args.n > 1 else [])]
    out = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for sampling, n in kinds:
            count = args.requests_c1 if concurrency == 1 else max(1, concurrency // n)
            warmup = 0 if args.cold else min(count, 2) if concurrency == 1 else count
            out.append(Workload("grammar", sampling, concurrency,
                                held_out_prompts(count, args.prompt_tokens, seed=100 + concurrency),
                                held_out_prompts(warmup, args.prompt_tokens, seed=300 + concurrency), n))
    passages = held_out_prompts(args.requests_c1 + (0 if args.cold else 2), args.prompt_tokens, seed=7)
    edits = [p + p[: args.prompt_tokens // 4] for p in passages]
    out.append(Workload("edit", "greedy", 1, edits[: args.requests_c1], edits[args.requests_c1:]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--requests-c1", type=int, default=8, help="requests run one after another at concurrency 1")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--n", type=int, default=4, help="choices a prompt in the sampled-nN rows (1: no such rows)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "megatron-serve-speculative"))
    parser.add_argument("--train-steps", type=int, default=PairSettings.steps)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each row, the methods alternated; each figure "
                        "is the median (ratios to the same repeat's none)")
    parser.add_argument("--cold", action="store_true", help="time each engine from its first request (no warm-up "
                        "round: the K policy's first probes are in the figures)")
    parser.add_argument("--warm-and-cold", action="store_true", help="both tables in one run (one interpreter, one "
                        "pair loaded), each after a line `warm:` or `cold:`")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"a subset of {','.join(METHODS)} ('none' "
                        "is always run first: the ratios' base)")
    args = parser.parse_args()
    if "speculative" not in {f.name for f in dataclasses.fields(InferenceConfig)}:
        print("this build's InferenceConfig has no `speculative` field: speculative decoding is not in it yet",
              file=sys.stderr)
        sys.exit(2)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)  # training too: 2 threads on the loaded 2-core CPU took 10 s a step, 1 took 0.07
    target, draft, facts = trained_pair(args.cache_dir, PairSettings(steps=args.train_steps), args.device)
    length, rate = acceptance(target, draft, held_out_prompts(16, args.prompt_tokens), args.k, args.new_tokens)
    gc.freeze()  # what the imports and the pair made lives to the end: each row's collection scans only the engines
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device} {args.dtype}, K={args.k}, "
          f"{args.prompt_tokens} prompt / {args.new_tokens} new tokens")
    print(f"pair {target.parent} ({'cached' if facts['cached'] else 'trained now'}): target {facts['target_train_s']:.0f} s, "
          f"draft {facts['draft_train_s']:.0f} s; held-out greedy draft acceptance length {length:.2f} "
          f"({100 * rate:.1f}% of guesses)")
    chosen = ["none", *(m for m in args.methods.split(",") if m in METHODS and m != "none")]
    for cold in (False, True) if args.warm_and_cold else (args.cold,):
        if args.warm_and_cold:
            print("cold:" if cold else "warm:")
        table(argparse.Namespace(**{**vars(args), "cold": cold}), chosen, target, draft)


def table(args: argparse.Namespace, chosen: list[str], target: Path, draft: Path) -> None:
    """The table's header and a row per workload and method (``args.cold``: no warm-up round)."""
    print(f"{'workload':<9}{'sampling':<11}{'conc':>5}  {'method':<14}{'tok/fwd':>8}{'ratio':>7}{'tok/s':>9}"
          f"{'ratio':>7}{'CPU ms/tok':>11}{'ratio':>7}{'mean K':>7}  same tokens")
    for workload in workloads(args):
        params = workload.params(args.new_tokens)
        methods = [m for m in chosen if workload.name != "edit" or not m.startswith("draft_model")]
        runs: dict[str, list[Run]] = {method: [] for method in methods}
        for _ in range(args.repeat):  # the methods alternated, so that the machine's load hits each alike
            for method in methods:
                config = InferenceConfig(device=args.device, dtype=args.dtype, max_requests=max(workload.in_flight, 8),
                                         speculative=speculative_config(method, args.k, draft))
                runs[method].append(run(target, config, workload, params))
        for method in methods:
            print(row(workload, method, runs[method], runs["none"]), flush=True)


def row(workload: Workload, method: str, runs: list[Run], bases: list[Run]) -> str:
    """One table row: each figure the median over the repeats of its value (ratios: to the same repeat's
    ``none``), and whether every run's tokens equal no speculation's (sampled ones too: each position is
    drawn from the request's seeded stream, so speculation must not change them)."""
    def median(values: list[float]) -> float:
        return statistics.median(values)

    per_forward = median([r.generated / r.forwards for r in runs])
    base_per_forward = median([b.generated / b.forwards for b in bases])
    wall_ratio = median([b.wall / r.wall * r.generated / b.generated for r, b in zip(runs, bases)])
    cpu_ratio = median([b.cpu / r.cpu * r.generated / b.generated for r, b in zip(runs, bases)])
    same = "yes" if all(r.tokens == b.tokens for r, b in zip(runs, bases)) else "NO"
    return (f"{workload.name:<9}{workload.sampling:<11}{workload.concurrency:>5}  {method:<14}{per_forward:>8.2f}"
            f"{per_forward / base_per_forward:>7.2f}{median([r.generated / r.wall for r in runs]):>9.1f}"
            f"{wall_ratio:>7.2f}{median([1e3 * r.cpu / r.generated for r in runs]):>11.2f}{cpu_ratio:>7.2f}"
            f"{median([r.mean_k for r in runs]):>7.2f}  {same}")


if __name__ == "__main__":
    main()
