"""The host KV tier on vs off, and suspend with keep_kv vs a plain suspend (docs/kv-tiers.md).

``MegatronLLM`` in direct mode, in this process, same weights every time.

* Tiers: ``--prefixes`` distinct prompts of ``--prefix-len`` tokens whose blocks add up to twice the device
  pool, each sent ``--rounds`` times, one at a time (an agent's turns, an RL group's samples spread over
  time): with the pool alone most prefixes were evicted before they come back; with ``--kv-offloading-size``
  they come back from host memory. Per request: TTFT (its prefill, the engine to itself) and CPU time of
  this process (``time.process_time``), tier off vs on, as ratios; outputs must be equal (checked).
* Disk: engine A serves the same prompts and as many others with the node's disk tier
  (``--kv-offloading-backend disk``) behind a host tier of two prompts, so that the prompts' blocks end in files;
  engine B, new, on the same directory, serves the prompts again and reads them from disk, against engine C
  without the disk tier, which computes them. Per request: TTFT and CPU time of this process per prompt token;
  outputs must be equal (checked).
* Disk steps: the disk tier's I/O against the step, engines driven step by step. Engine A's step times while it
  serves the prompts and spills them to disk; then engine B's step times while one request decodes and the
  prompts, admitted one after another beside it, are read from A's files: a step that waited for the disk shows
  in the decoding request's time between tokens. CPU time of this process (every thread) per prompt token read.
* Suspend: ``--live`` requests in flight, suspended and resumed; time of suspend + resume, bytes kept in
  host memory, and the time and tokens computed until every request has its next token, keep_kv vs a plain
  suspend (which recomputes every context).

    python benchmarks/kv_tiers.py                 # CPU-sized defaults
    python benchmarks/kv_tiers.py --smoke         # seconds: the test suite runs this (with --model, its tiny model)
    python benchmarks/kv_tiers.py --hidden-size 1024 --layers 16 --prefix-len 2048 --device cuda  # a GPU
    python benchmarks/kv_tiers.py --sections disk-steps   # one section
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time

import torch

from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.engine.core import DynamicInferenceEngine
from megatron_serve.engine.kv.disk import DiskKVTier
from megatron_serve.model.tiny import make_tiny_model

from cli_options import add_number_options

BLOCK = 16


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def config(args, tier: float | None, disk: str | None = None) -> InferenceConfig:
    on_disk = {} if disk is None else {"kv_offloading_backend": "disk", "kv_disk_dir": disk,
                                       "kv_disk_size": args.disk_gib}
    return InferenceConfig(dtype=args.dtype, device=args.device, block_size_tokens=BLOCK,
                           num_kv_blocks=args.pool_blocks, max_requests=args.live, max_batch_tokens=4096,
                           kv_offloading_size=tier, **on_disk)


def timed(llm: MegatronLLM, prompts: list[list[int]], device: str) -> tuple[list[float], list[float], list]:
    """Each prompt alone, one token: its TTFT, this process's CPU time, and its tokens."""
    ttft, cpu, outputs = [], [], []
    for prompt in prompts:
        _sync(device)
        wall, process = time.perf_counter(), time.process_time()
        out = llm.generate([prompt], SamplingParams(temperature=0.0, num_tokens_to_generate=1, ignore_eos=True))
        _sync(device)
        ttft.append(time.perf_counter() - wall)
        cpu.append(time.process_time() - process)
        outputs.append(out[0].generated_tokens)
    return ttft, cpu, outputs


def tiers(model_dir: str, args, tier: float | None) -> dict:
    llm = MegatronLLM(model_dir, config(args, tier))
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 500) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=2, ignore_eos=True)
    llm.generate([[7] * 40], params)  # warm-up, sharing no block with the workload
    ttft, cpu, outputs = [], [], []
    for round_index in range(args.rounds):
        for prompt in prompts:
            _sync(args.device)
            wall, process = time.perf_counter(), time.process_time()
            out = llm.generate([prompt], SamplingParams(temperature=0.0, num_tokens_to_generate=1, ignore_eos=True))
            _sync(args.device)
            if round_index:  # the first round computes every prefix either way
                ttft.append(time.perf_counter() - wall)
                cpu.append(time.process_time() - process)
            outputs.append(out[0].generated_tokens)
    engine = llm.engine
    host = engine.host_tier
    return {"ttft": statistics.median(ttft), "cpu": statistics.mean(cpu), "outputs": outputs,
            "cached": engine.load().cached_tokens, "host_hits": engine.scheduler.host_cached_tokens,
            "bytes": dict(host.stats.bytes) if host is not None else {}}


def disk(model_dir: str, args) -> dict:
    """Engine B reads from disk what engine A wrote, against engine C computing it (see the module docstring)."""
    rng = random.Random(2)
    prompts = [[rng.randrange(5, 500) for _ in range(args.prefix_len)] for _ in range(2 * args.prefixes)]
    warm = [[7] * 40]  # sharing no block with the workload
    recompute = MegatronLLM(model_dir, config(args, args.tier_gib))
    host_gib = 2 * (args.prefix_len // BLOCK) * recompute.engine.kv_cache.bytes_per_pool_block / 2**30
    rows = {}
    with tempfile.TemporaryDirectory() as directory:
        writer = MegatronLLM(model_dir, config(args, host_gib, directory))
        timed(writer, prompts, args.device)  # the second half pushes the first out to disk
        writer.engine.host_tier.flush()  # the spills still queued are written
        written = writer.engine.host_tier.disk.written
        del writer
        reader = MegatronLLM(model_dir, config(args, args.tier_gib, directory))
        for name, llm in (("recompute", recompute), ("disk hit", reader)):
            timed(llm, warm, args.device)
            ttft, cpu, outputs = timed(llm, prompts[: args.prefixes], args.device)
            rows[name] = {"ttft": statistics.median(ttft), "cpu": statistics.mean(cpu), "outputs": outputs,
                          "cached": llm.engine.load().cached_tokens}
        rows["disk hit"].update(hits=reader.engine.host_tier.disk.hits, written=written)
    return rows


def _steps_until(engine: DynamicInferenceEngine, done, device: str) -> list[float]:
    """Step ``engine`` until ``done()``; each step's wall time."""
    times = []
    while not done():
        started = time.perf_counter()
        engine.step()
        _sync(device)
        times.append(time.perf_counter() - started)
    return times


class FileTime:
    """Seconds spent in the disk tier's file reads and writes (``DiskKVTier.read``/``write``), on the step thread
    (the caller's) and on any other, while in use."""

    def __init__(self) -> None:
        self.step = {"read": 0.0, "write": 0.0}
        self.other = {"read": 0.0, "write": 0.0}
        self._saved = {}

    def __enter__(self) -> "FileTime":
        main = threading.current_thread()
        for name in ("read", "write"):
            method = self._saved[name] = getattr(DiskKVTier, name)

            def timed(tier, *args, _method=method, _name=name, **kwargs):
                started = time.perf_counter()
                try:
                    return _method(tier, *args, **kwargs)
                finally:
                    where = self.step if threading.current_thread() is main else self.other
                    where[_name] += time.perf_counter() - started
            setattr(DiskKVTier, name, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, method in self._saved.items():
            setattr(DiskKVTier, name, method)


def disk_steps(model_dir: str, args) -> dict:
    """Step times while the disk tier writes (engine A) and reads (engine B, beside a decoding request): see the
    module docstring."""
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 500) for _ in range(args.prefix_len)] for _ in range(2 * args.prefixes)]
    one = SamplingParams(temperature=0.0, num_tokens_to_generate=1, ignore_eos=True)
    with tempfile.TemporaryDirectory() as directory, FileTime() as files:
        probe = DynamicInferenceEngine.from_model_dir(model_dir, config(args, None), vocabulary_only=True)
        host_gib = 2 * (args.prefix_len // BLOCK) * probe.kv_cache.bytes_per_pool_block / 2**30
        del probe
        writer = DynamicInferenceEngine.from_model_dir(model_dir, config(args, host_gib, directory),
                                                       vocabulary_only=True)
        writer.add_request(DynamicInferenceRequest("warm", "", [9] * 40, one))  # the first forward's cost aside
        _steps_until(writer, lambda: not writer.has_unfinished_requests(), args.device)
        writes = []
        for index, prompt in enumerate(prompts):
            request = DynamicInferenceRequest(f"w{index}", "", prompt, one)
            writer.add_request(request)
            writes += _steps_until(writer, lambda: not writer.has_unfinished_requests(), args.device)
        writer.shutdown()  # its queued writes land
        written = writer.host_tier.disk.written
        del writer
        reader = DynamicInferenceEngine.from_model_dir(model_dir, config(args, args.tier_gib, directory),
                                                       vocabulary_only=True)
        budget = args.pool_blocks * BLOCK // 2 - 40  # half the pool: room for the prompts beside it
        decode = DynamicInferenceRequest("decode", "", [7] * 40, SamplingParams(temperature=0.0, ignore_eos=True,
                                                                                num_tokens_to_generate=budget))
        reader.add_request(decode)
        _steps_until(reader, lambda: len(decode.generated_tokens) >= 2, args.device)
        reads, ttft, tokens_before = [], [], len(decode.generated_tokens)
        process = time.process_time()
        for index, prompt in enumerate(prompts[: args.prefixes]):
            request = DynamicInferenceRequest(f"r{index}", "", prompt, one)
            reader.add_request(request)
            started = time.perf_counter()
            reads += _steps_until(reader, lambda: bool(request.generated_tokens), args.device)
            ttft.append(time.perf_counter() - started)
        cpu = time.process_time() - process
        decoded = len(decode.generated_tokens) - tokens_before
        reader.abort_request("decode")
        hits = reader.host_tier.disk.hits
        reader.shutdown()
    return {"written": written, "writes": writes, "reads": reads, "ttft": statistics.median(ttft), "hits": hits,
            "cpu_per_token": cpu / (args.prefixes * args.prefix_len), "decoded": decoded, "files": files}


def _ms(times: list[float]) -> str:
    ordered = sorted(times)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return (f"median {1e3 * statistics.median(ordered):7.2f} ms, p90 {1e3 * p90:7.2f} ms, max {1e3 * ordered[-1]:7.2f}"
            f" ms over {len(ordered)} steps")


def suspend(model_dir: str, args, keep_kv: bool) -> dict:
    engine = MegatronLLM(model_dir, config(args, None)).engine
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=16, ignore_eos=True)
    length = min(args.prefix_len, args.pool_blocks * BLOCK // args.live - 2 * BLOCK)  # all fit in the pool at once
    requests = [DynamicInferenceRequest(str(i), "", [rng.randrange(5, 500) for _ in range(length)], params)
                for i in range(args.live)]
    for request in requests:
        engine.add_request(request)
    while min(len(r.generated_tokens) for r in requests) < 4:
        engine.step()
    engine.sync()
    counts = [len(r.generated_tokens) for r in requests]
    computed = engine.load().computed_tokens
    _sync(args.device)
    started = time.perf_counter()
    engine.memory.suspend(keep_kv=keep_kv)
    kept = engine.memory.kept_kv_bytes
    suspended = time.perf_counter()
    engine.memory.resume()
    _sync(args.device)
    resumed = time.perf_counter()
    while any(len(r.generated_tokens) <= count for r, count in zip(requests, counts)):
        engine.step()
    engine.sync()
    _sync(args.device)
    back = time.perf_counter()
    return {"suspend_s": suspended - started, "resume_s": resumed - suspended, "next_token_s": back - resumed,
            "kept_bytes": kept, "computed": engine.load().computed_tokens - computed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_number_options(parser, hidden_size=256, layers=4, prefix_len=512, pool_blocks=128, rounds=3, live=4,
                       tier_gib=0.5)
    parser.add_argument("--disk-gib", type=float, default=1.0, help="the disk tier's bound")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny model and workload: seconds")
    parser.add_argument("--model", default=None, help="a model directory instead of a random model of --hidden-size "
                        "and --layers (the test suite gives its tiny model: no model to make, no transformers model)")
    parser.add_argument("--sections", default="tiers,disk,disk-steps,suspend",
                        help="comma-separated: tiers, disk, disk-steps, suspend")
    args = parser.parse_args()
    if args.smoke:
        args.hidden_size, args.layers, args.prefix_len, args.pool_blocks, args.rounds = 64, 2, 64, 16, 2
        args.live, args.tier_gib = 2, 0.01
    # blocks of the working set: twice the pool
    args.prefixes = max(2, 2 * args.pool_blocks // (args.prefix_len // BLOCK))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(make_tiny_model(tmp, seed=0, hidden_size=args.hidden_size,
                                                      num_layers=args.layers, intermediate_size=4 * args.hidden_size,
                                                      max_position_embeddings=max(1024, 2 * args.prefix_len)))
        sections = set(args.sections.split(","))
        if "tiers" in sections:
            report_tiers(model_dir, args)
        if "disk" in sections:
            report_disk(model_dir, args)
        if "disk-steps" in sections:
            report_disk_steps(model_dir, args)
        if "suspend" in sections:
            report_suspend(model_dir, args)


def report_tiers(model_dir: str, args) -> None:
    off, on = tiers(model_dir, args, None), tiers(model_dir, args, args.tier_gib)
    assert on["outputs"] == off["outputs"], "the host tier changed an output"
    print(f"tiers: {args.prefixes} prompts x {args.prefix_len} tokens, {args.rounds} rounds, pool "
          f"{args.pool_blocks} blocks (working set twice the pool), device {args.device}")
    print(f"  {'':>10} {'TTFT ms':>10} {'CPU ms/req':>11} {'cached tok':>11} {'host hits':>10}")
    for name, row in (("tier off", off), ("tier on", on)):
        print(f"  {name:>10} {1e3 * row['ttft']:10.2f} {1e3 * row['cpu']:11.2f} {row['cached']:11d} "
              f"{row['host_hits']:10d}")
    print(f"  on/off: TTFT x{on['ttft'] / off['ttft']:.2f}, CPU x{on['cpu'] / off['cpu']:.2f}; "
          f"copied {on['bytes']}")


def report_disk(model_dir: str, args) -> None:
    rows = disk(model_dir, args)
    assert rows["disk hit"]["outputs"] == rows["recompute"]["outputs"], "the disk tier changed an output"
    print(f"disk: engine B reads {args.prefixes} prompts x {args.prefix_len} tokens engine A wrote "
          f"({rows['disk hit']['written']} blocks written), against an engine that computes them")
    print(f"  {'':>10} {'TTFT ms':>10} {'CPU ms/req':>11} {'CPU us/tok':>11} {'cached tok':>11}")
    for name, row in rows.items():
        print(f"  {name:>10} {1e3 * row['ttft']:10.2f} {1e3 * row['cpu']:11.2f} "
              f"{1e6 * row['cpu'] / args.prefix_len:11.2f} {row['cached']:11d}")
    hit, computed = rows["disk hit"], rows["recompute"]
    print(f"  disk/recompute: TTFT x{hit['ttft'] / computed['ttft']:.2f}, CPU x{hit['cpu'] / computed['cpu']:.2f}; "
          f"{hit['hits']} blocks read from disk")


def report_disk_steps(model_dir: str, args) -> None:
    steps = disk_steps(model_dir, args)
    print(f"disk steps: engine A spills {2 * args.prefixes} prompts x {args.prefix_len} tokens "
          f"({steps['written']} blocks written); engine B reads {args.prefixes} of them beside a decoding "
          f"request ({steps['hits']} blocks read)")
    print(f"  A, step time:                 {_ms(steps['writes'])}")
    print(f"  B, step time (decode beside): {_ms(steps['reads'])}; {steps['decoded']} tokens decoded")
    print(f"  B, TTFT of a prompt read from disk: median {1e3 * steps['ttft']:.2f} ms; CPU per prompt token "
          f"{1e6 * steps['cpu_per_token']:.2f} us")
    files = steps["files"]
    print(f"  file writes: {1e3 * files.step['write']:.1f} ms on the step thread, {1e3 * files.other['write']:.1f} ms "
          f"on others; file reads: {1e3 * files.step['read']:.1f} ms on the step thread, "
          f"{1e3 * files.other['read']:.1f} ms on others")


def report_suspend(model_dir: str, args) -> None:
    plain, kept = suspend(model_dir, args, False), suspend(model_dir, args, True)
    print(f"suspend/resume: {args.live} live requests")
    print(f"  {'':>10} {'suspend ms':>11} {'resume ms':>10} {'next tok ms':>12} {'kept bytes':>11} "
          f"{'computed':>9}")
    for name, row in (("recompute", plain), ("keep_kv", kept)):
        print(f"  {name:>10} {1e3 * row['suspend_s']:11.2f} {1e3 * row['resume_s']:10.2f} "
              f"{1e3 * row['next_token_s']:12.2f} {row['kept_bytes']:11d} {row['computed']:9d}")
    total = (lambda r: r["suspend_s"] + r["resume_s"] + r["next_token_s"])
    print(f"  keep_kv/recompute: suspend-to-next-token x{total(kept) / total(plain):.2f}, "
          f"tokens computed x{kept['computed'] / plain['computed']:.3f}")


if __name__ == "__main__":
    main()
