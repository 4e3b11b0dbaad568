"""Prefix hit rate of ``kv_aware`` routing (the engines' KV events) against ``prefix_affinity`` (routed-prefix memory)
on a replayed multi-tenant trace with an eviction storm (docs/kv-routing.md).

Real engines (``DynamicInferenceEngine``s in this process, the same weights each run) stepped in lockstep, one step
each per tick, and the coordinator's real policies choosing among them with what the coordinator would see: each
engine's requests in flight, its KV blocks free, and for ``kv_aware`` a :class:`~megatron_serve.coordinator.kv_index.
KVIndex` fed by the engine's own KV event batches (the bytes its link would carry), on a clock of ``--tick-s``
seconds per step.

The trace (seeded, replayed identically for every policy): ``--tenants`` tenants, each a system prompt of
``--prefix-blocks`` blocks followed by a user turn of its own, arriving with Zipf-like weights, a few per tick. In
the middle a batch tenant's rollouts (a GRPO group: ``--storm`` samples of one short prompt, ``--storm-tokens`` tokens
each) take the KV pools: their growing contexts evict the cached system prompts. Routed-prefix memory still believes its engines
hold them (it remembers what it *sent*, not what the pools *kept*); the index sees every ``BlockRemoved``.
``--storm-groups`` groups arrive together (a GRPO step), each prompt ``--storm-prompt-blocks`` blocks; with
``--storm-resumed N`` each sample is a partial rollout that already generated N tokens (resumed after a pause or a
refit): its KV fills a pool at its first step, while the memory counts only its prompt. ``--popularity uniform``
makes every tenant as frequent (no hot tenant whose blocks the engines' LRU keeps anyway).

Two knobs model what routed-prefix memory cannot know. ``--routers N``: N routers (gateway or coordinator replicas)
take the arrivals in turn, each with a policy of its own: routed-prefix memory remembers only what its router sent,
while every ``kv_aware`` router reads the same engines' events. ``--restart-at TICK``: the router restarts then: the
memory starts empty, the index is rebuilt from each engine's snapshot of the blocks it holds (what a new subscriber
gets first).

Reported per policy: prefix hit rate (prompt tokens the device pool or host tier served / prompt tokens that could
have been, i.e. all but each prompt's last), before / during / after the storm, and every request's tokens, which
must be equal across policies (checked: routing never changes a text; ``batch_invariant`` on).

    python benchmarks/kv_routing.py            # CPU-sized defaults
    python benchmarks/kv_routing.py --smoke    # seconds: the test suite runs this (with --model, its tiny model)
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from megatron_serve import InferenceConfig, SamplingParams
from megatron_serve.coordinator.kv_aware import KVAware
from megatron_serve.engine.core import DynamicInferenceEngine
from megatron_serve.coordinator.kv_index import KVIndex
from megatron_serve.coordinator.routing import make_routing_policy
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.wire.prefix_hash import ROOT_HASH
from megatron_serve.wire.request import EngineRequest

from cli_options import add_number_options

BLOCK = 16
PHASES = ("before", "storm", "after")


@dataclass
class Arrival:
    """One request of the trace: when it arrives, its tokens, how many to generate, and its phase."""

    tick: int
    request_id: str
    prompt: list[int]
    tokens: int
    phase: str
    tenant: str
    resumed: list[int] = field(default_factory=list)  # tokens a partial rollout already generated (it goes on)


def make_trace(args: argparse.Namespace) -> list[Arrival]:
    """The seeded multi-tenant trace with a storm in its middle third (see the module docstring)."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(5, 500) for _ in range(args.prefix_blocks * BLOCK)] for _ in range(args.tenants)]
    weights = [1.0 / (rank + 1) if args.popularity == "zipf" else 1.0 for rank in range(args.tenants)]
    trace: list[Arrival] = []
    third = args.ticks // 3
    for tick in range(args.ticks):
        phase = PHASES[min(tick // third, 2)] if third else "before"
        for _ in range(args.per_tick):
            tenant = rng.choices(range(args.tenants), weights)[0]
            tail = [rng.randrange(5, 500) for _ in range(rng.randrange(3, BLOCK))]
            trace.append(Arrival(tick, f"t{tenant}-{len(trace)}", prefixes[tenant] + tail, args.tokens, phase,
                                 f"t{tenant}"))
    storm_ticks = range(third, 2 * third) if third else range(0)
    groups = args.storm_groups if storm_ticks else 0
    for group in range(groups):  # a GRPO step's groups, at the storm's start: one prompt, n samples each
        group_prompt = [rng.randrange(5, 500) for _ in range(args.storm_prompt_blocks * BLOCK + 3)]
        for index in range(args.storm):
            tick = storm_ticks[0] + index // args.slots  # a slot's worth per tick: where the group's prompt is
            resumed = [rng.randrange(5, 500) for _ in range(args.storm_resumed)]
            trace.append(Arrival(tick, f"storm-{group}-{index}", group_prompt, args.storm_tokens, "storm", "batch",
                                 resumed))
    return sorted(trace, key=lambda a: a.tick)


@dataclass
class Outcome:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)  # phase -> prompt tokens served from a cache
    usable: dict[str, int] = field(default_factory=dict)  # phase -> prompt tokens that could have been
    sent: dict[str, dict[str, int]] = field(default_factory=dict)  # tenant -> engine -> requests
    seconds: float = 0.0


def make_engines(model_dir: str, args: argparse.Namespace) -> list[Any]:
    """The engines, stepped by ``replay`` itself: token ids in and out, so each holds its vocabulary only (an engine
    process's, without ``transformers``)."""
    engines = []
    for number in range(args.engines):
        engine = DynamicInferenceEngine.from_model_dir(
            model_dir, InferenceConfig(block_size_tokens=BLOCK, num_kv_blocks=args.pool_blocks, max_requests=args.slots,
                                       max_batch_tokens=2048, enable_prefix_caching=True, batch_invariant=True),
            vocabulary_only=True)
        engines.append(SimpleNamespace(engine=engine, engine_id=f"engine-{number}", group=number, running={},
                                       sink=None))
    return engines


class Routers:
    """``--routers`` routers of one policy over the same engines; ``restart()`` starts them afresh, as a coordinator
    (or gateway) process that restarted: routed-prefix memory empty, the KV index rebuilt from the engines'
    snapshots."""

    def __init__(self, routing: str, args: argparse.Namespace, engines: list[Any], clock: list[float]) -> None:
        self.routing, self.args, self.engines, self.clock = routing, args, engines, clock
        self.restart()

    def restart(self) -> None:
        self.index = index = KVIndex()
        index.now = self.clock[0]
        for side in self.engines:
            if side.sink is not None:
                side.engine.kv_events.detach(side.sink)
            side.sink = lambda seq, payload, e=side.engine_id: index.apply(e, seq, payload, self.clock[0])
            side.engine.kv_events.attach(side.sink)  # the snapshot first, then every batch
        self.policies = [KVAware(index, overlap_weight=self.args.overlap_weight) if self.routing == "kv_aware"
                         else make_routing_policy(self.routing, index) for _ in range(self.args.routers)]

    def select(self, number: int, request: Any, views: list[Any]) -> Any:
        """The engine the router that takes arrival ``number`` (in turn) chooses."""
        return self.policies[number % len(self.policies)].select(request, views)


def view(side: Any, args: argparse.Namespace) -> SimpleNamespace:
    """What the coordinator's engine record says of ``side`` (its heartbeat's facts, up to date every tick)."""
    allocator = side.engine.allocator
    return SimpleNamespace(engine_id=side.engine_id, group=side.group, capacity=args.slots, load=len(side.running),
                           kv_blocks_free=allocator.num_free, kv_blocks_total=allocator.num_blocks, stats={},
                           info={"block_size": BLOCK, "prefix_caching": True}, epoch=side.engine.epoch, side=side)


def replay(model_dir: str, args: argparse.Namespace, routing: str, trace: list[Arrival]) -> Outcome:
    """The trace through ``args.engines`` engines routed by ``routing``; what each request got."""
    clock = [0.0]  # the coordinator's clock: --tick-s per tick (one step of every engine), not this machine's
    engines = make_engines(model_dir, args)
    routers = Routers(routing, args, engines, clock)
    outcome, queue, pending = Outcome(), list(trace), []
    started = time.perf_counter()
    tick = routed = 0
    while queue or pending or any(side.running for side in engines):
        clock[0] = routers.index.now = tick * args.tick_s
        if tick == args.restart_at:
            routers.restart()
        while queue and queue[0].tick <= tick:
            pending.append(queue.pop(0))
        while pending:
            views = [view(side, args) for side in engines if len(side.running) < args.slots]
            if not views:
                break
            arrival = pending.pop(0)
            request = SimpleNamespace(request_id=arrival.request_id, params=SamplingParams(),
                                      prefix_keys=arrival.prompt, prefix_root=ROOT_HASH)
            side = routers.select(routed, request, views).side
            routed += 1
            params = SamplingParams(temperature=0.0, num_tokens_to_generate=len(arrival.resumed) + arrival.tokens,
                                    ignore_eos=True)
            side.engine.add_request(EngineRequest(request_id=arrival.request_id, prompt_tokens=arrival.prompt,
                                                  generated_tokens=arrival.resumed, sampling_params=params,
                                                  arrival_time=time.time()))
            side.running[arrival.request_id] = arrival
            tenant = outcome.sent.setdefault(arrival.tenant, {})
            tenant[side.engine_id] = tenant.get(side.engine_id, 0) + 1
        for side in engines:
            if side.engine.has_unfinished_requests():
                for out in side.engine.step():
                    collect(outcome, side, out)
        tick += 1
    outcome.seconds = time.perf_counter() - started
    for side in engines:
        side.engine.shutdown()
    return outcome


def collect(outcome: Outcome, side: Any, out: Any) -> None:
    """One step's output of a request: its tokens, and at its first what its admission found cached."""
    arrival = side.running[out.request_id]
    outcome.tokens.setdefault(out.request_id, []).extend(out.new_tokens)
    if out.cached_tokens is not None and arrival.tenant != "batch":
        outcome.cached[arrival.phase] = outcome.cached.get(arrival.phase, 0) + out.cached_tokens
        outcome.usable[arrival.phase] = outcome.usable.get(arrival.phase, 0) + len(arrival.prompt) - 1
    if out.finished:
        del side.running[out.request_id]


def rate(outcome: Outcome, phases: tuple[str, ...] = PHASES) -> float:
    usable = sum(outcome.usable.get(p, 0) for p in phases)
    return sum(outcome.cached.get(p, 0) for p in phases) / usable if usable else 0.0


def report(args: argparse.Namespace, trace: list[Arrival], rows: dict[str, Outcome]) -> None:
    tenants = sum(1 for a in trace if a.tenant != "batch")
    print(f"trace: {tenants} tenant requests ({args.tenants} tenants, system prompts of {args.prefix_blocks} blocks of "
          f"{BLOCK}), a storm of {args.storm} rollouts x {args.storm_tokens} tokens; {args.engines} engines x "
          f"{args.pool_blocks} KV blocks, {args.slots} slots; {args.routers} router(s)"
          + (f", restarted at tick {args.restart_at}" if args.restart_at is not None else ""))
    print(f"  {'routing':>16} {'hit rate':>9} {'before':>7} {'storm':>7} {'after':>7} {'seconds':>8}")
    for name, row in rows.items():
        print(f"  {name:>16} {rate(row):9.3f} " + " ".join(f"{rate(row, (p,)):7.3f}" for p in PHASES)
              + f" {row.seconds:8.1f}")
    aware, memory = rate(rows["kv_aware"]), rate(rows["prefix_affinity"])
    print(f"  kv_aware / prefix_affinity: x{aware / memory:.2f} overall, storm and after x"
          f"{rate(rows['kv_aware'], PHASES[1:]) / max(rate(rows['prefix_affinity'], PHASES[1:]), 1e-9):.2f}")
    print(f"  texts: {len(rows['kv_aware'].tokens)} requests, equal under every policy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_number_options(parser, engines=3, pool_blocks=40, slots=8, tenants=6, prefix_blocks=6)
    parser.add_argument("--popularity", choices=("zipf", "uniform"), default="zipf",
                        help="how often each tenant comes: Zipf-like (1/rank) or all alike")
    parser.add_argument("--ticks", type=int, default=60)
    parser.add_argument("--per-tick", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--storm", type=int, default=8)
    parser.add_argument("--storm-tokens", type=int, default=256)
    parser.add_argument("--storm-groups", type=int, default=1, help="GRPO groups, each of --storm samples")
    parser.add_argument("--storm-prompt-blocks", type=int, default=1, help="blocks of a group's prompt (+3 tokens)")
    parser.add_argument("--storm-resumed", type=int, default=0,
                        help="tokens each storm sample already generated: partial rollouts resumed (after a refit, a "
                             "pause), whose KV fills the pool at once while routed-prefix memory counts their prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tick-s", type=float, default=0.05, help="the coordinator's seconds per engine step")
    parser.add_argument("--overlap-weight", type=float, default=1.0, help="kv_aware's (Dynamo's default: 1)")
    parser.add_argument("--policies", default="least_loaded,prefix_affinity,kv_aware")
    parser.add_argument("--routers", type=int, default=1,
                        help="routers taking the arrivals in turn, each with a policy (and a memory) of its own")
    parser.add_argument("--restart-at", type=int, default=None, metavar="TICK",
                        help="the router(s) restart at this tick: memory lost, the index rebuilt from snapshots")
    parser.add_argument("--smoke", action="store_true", help="a smaller trace: seconds")
    parser.add_argument("--model", default=None, help="a model directory instead of the tiny model made here (the test "
                        "suite gives its own, the same: no model to make, no transformers model)")
    args = parser.parse_args()
    if args.smoke:
        args.ticks, args.per_tick, args.storm, args.storm_tokens = 24, 1, 4, 48
    policies = args.policies.split(",")
    if not {"kv_aware", "prefix_affinity"} <= set(policies):
        parser.error("--policies must name kv_aware and prefix_affinity")
    trace = make_trace(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(make_tiny_model(tmp, seed=0))
        rows = {name: replay(model_dir, args, name, trace) for name in policies}
    first = rows[policies[0]].tokens
    for name, row in rows.items():
        assert row.tokens == first, f"{name} changed a text"
    report(args, trace, rows)


if __name__ == "__main__":
    main()
