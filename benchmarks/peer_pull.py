"""How fast a late joiner pulls the fleet's weights from a live engine (``megatron_serve.weights.peer_pull``).

For each model size a random Llama checkpoint is written once (``--dir`` keeps them) and loaded in two processes,
a donor and a joiner (float32, CPU). Each round the donor shares its state under a fresh prefix and the joiner
pulls it (``PeerSource``): from reaching the donor's store to the commit, the whole of what a joiner's registration
adds. The baseline is this machine's memory copy of the same bytes, measured in the same run. Prints one row per
size: bytes, the pull's median seconds of ``--rounds``, its bytes/s, and the ratio to the memory copy.

    python benchmarks/peer_pull.py                                  # hidden sizes 512, 1024, 2048; 8 layers
    python benchmarks/peer_pull.py --hidden-sizes 1024 --layers 16 --rounds 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_serve.model.loader import load_model
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.weights.peer_pull import PeerSource, PeerWeights
from megatron_serve.wire.rendezvous import PeerShare

sys.path.insert(0, str(Path(__file__).parent))
from weight_sync import memory_copy_bandwidth  # noqa: E402


def donor(path: str, rounds: int, to_joiner: "mp.Queue", from_joiner: "mp.Queue") -> None:
    peers = PeerWeights(load_model(path, torch.float32, "cpu"))
    to_joiner.put(peers.address("127.0.0.1"))
    for _ in range(rounds):
        prefix = from_joiner.get()
        peers.share(PeerShare(engine_id="joiner", prefix=prefix, epoch=1, timeout_s=120.0), 1)


def joiner(path: str, rounds: int, from_donor: "mp.Queue", to_donor: "mp.Queue", results: "mp.Queue") -> None:
    model = load_model(path, torch.float32, "cpu")
    address = from_donor.get()
    for _ in range(rounds):
        prefix = secrets.token_hex(16)
        to_donor.put(prefix)
        started = time.perf_counter()
        list(PeerSource(address, prefix, 1, 120.0, "rendezvous://benchmark").tensors(model))
        results.put(time.perf_counter() - started)
    results.put(sum(t.numel() * t.element_size() for t in model.state_dict().values()))


def one_size(path: str, rounds: int) -> tuple[int, float, float]:
    """Bytes pulled, the median seconds, this machine's memory copy (bytes/s) for the same bytes."""
    spawn = mp.get_context("spawn")
    there, back, results = spawn.Queue(), spawn.Queue(), spawn.Queue()
    procs = [spawn.Process(target=donor, args=(path, rounds, there, back)),
             spawn.Process(target=joiner, args=(path, rounds, there, back, results))]
    for proc in procs:
        proc.start()
    seconds = [results.get(timeout=600) for _ in range(rounds)]
    nbytes = results.get(timeout=60)
    for proc in procs:
        proc.join(60)
    return nbytes, statistics.median(seconds), memory_copy_bandwidth(nbytes, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where to write (or find) the checkpoints (default: a temporary directory)")
    parser.add_argument("--hidden-sizes", default="512,1024,2048")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="peer-pull-"))
    print("| state | pull (s) | pull (GB/s) | memory copy (GB/s) | pull vs memory copy |")
    print("|---|---|---|---|---|")
    for hidden in (int(size) for size in args.hidden_sizes.split(",")):
        path = root / f"h{hidden}"
        if not (path / "config.json").exists():
            print(f"writing checkpoint {path} ...", file=sys.stderr)
            make_tiny_model(path, hidden_size=hidden, num_layers=args.layers, num_heads=16, num_kv_heads=4,
                            intermediate_size=hidden * 11 // 4)
        nbytes, seconds, copy = one_size(str(path), args.rounds)
        print(f"| {nbytes / 2**20:.0f} MiB | {seconds:.3f} | {nbytes / seconds / 1e9:.2f} | {copy / 1e9:.2f} | "
              f"{nbytes / seconds / copy:.0%} |", flush=True)


if __name__ == "__main__":
    main()
