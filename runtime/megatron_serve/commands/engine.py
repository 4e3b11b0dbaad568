"""``megatron-serve engine``: one engine group serving a coordinator."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from typing import TYPE_CHECKING

# Before torch is imported (engine_options -> config imports it): OpenMP worker threads that spin
# after every op starve this process's coordinator link and everything sharing the host's cores
# (measured on 2 cores: p99 request latency through the coordinator 197 ms spinning, 16 ms passive).
# setdefault: an explicit OMP_WAIT_POLICY from the user wins. The fleet's launcher (commands/launcher.py) imports this
# module first, so its forked engines ran their imports with these too.
IMPORT_DEFAULTS: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE"}
for _name, _value in IMPORT_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

from ..fleet.argv import kv_transfer_config  # noqa: E402
from ..heap import pause_collection_until_started  # noqa: E402
from .engine_options import add_engine_options, capacity_line, inference_config_from_args  # noqa: E402
from .flags import add_flags  # noqa: E402
from .inputs import check_model_dir, coordinator_address, parse_port  # noqa: E402
from .model_options import add_model_options, resolve_model_args  # noqa: E402
from .options import add_coordinator_option, add_token_option, read_token, setup_logging  # noqa: E402

if TYPE_CHECKING:
    from ..config import InferenceConfig

logger = logging.getLogger("megatron_serve.engine_process")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_options(parser)
    add_coordinator_option(parser)
    add_flags(parser, "engine_command")
    add_engine_options(parser)
    add_token_option(parser)
    add_flags(parser, "log")


def layout_config(args: argparse.Namespace) -> "InferenceConfig":
    """The engine's config with its group layout checked; the data-parallel rank from ``RANK`` unless given (the
    operator's pods set ``RANK`` to their first rank: one pod per data-parallel rank, tests/operator check it)."""
    if args.tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel must be >= 1, got {args.tensor_parallel}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1 and not args.enable_expert_parallel:
        raise ValueError(f"--data-parallel-size {args.data_parallel_size} is data-parallel attention, which shares "
                         "MoE layers: add --enable-expert-parallel (replicas of a model are engine groups: --engines)")
    meet_at(args)
    rank = args.data_parallel_rank
    if rank is None:
        rank = int(os.environ.get("RANK", "0")) // args.tensor_parallel if args.data_parallel_size > 1 else 0
    if not 0 <= rank < args.data_parallel_size:
        raise ValueError(f"--data-parallel-rank must be in [0, {args.data_parallel_size}), got {rank}")
    return dataclasses.replace(inference_config_from_args(args, tensor_parallel_size=args.tensor_parallel),
                               data_parallel_size=args.data_parallel_size, data_parallel_rank=rank)


def meet_at(args: argparse.Namespace) -> None:
    """vLLM's multi-host flags as this engine's rendezvous (``MASTER_ADDR``/``MASTER_PORT``, which its worker ranks
    inherit); refused where they mean more than one rank per command, or nothing."""
    if args.data_parallel_size_local != 1:
        raise ValueError(f"--data-parallel-size-local must be 1, got {args.data_parallel_size_local}: each "
                         "data-parallel rank is an engine command of its own (--data-parallel-rank D)")
    given = [(flag, value) for flag, value in (("--data-parallel-address", args.data_parallel_address),
                                               ("--data-parallel-rpc-port", args.data_parallel_rpc_port))
             if value is not None]
    if given and args.data_parallel_size == 1:
        raise ValueError(f"{given[0][0]} is where data-parallel attention ranks meet: it needs --data-parallel-size "
                         "> 1")
    if args.data_parallel_address is not None:
        if not args.data_parallel_address.strip():
            raise ValueError("--data-parallel-address is empty")
        os.environ["MASTER_ADDR"] = args.data_parallel_address.strip()
    if args.data_parallel_rpc_port is not None:
        os.environ["MASTER_PORT"] = str(parse_port(args.data_parallel_rpc_port, "--data-parallel-rpc-port",
                                                   allow_zero=False))


def data_parallel_info(config: "InferenceConfig") -> dict[str, int]:
    """What HELLO says of a data-parallel attention rank: the coordinator holds the group's ranks as engines of one
    group, each its rank of it (``run`` starts them all with one ``--group``, as the operator's pods of a gang)."""
    if config.data_parallel_size == 1:
        return {}
    return {"data_parallel_rank": config.data_parallel_rank, "data_parallel_size": config.data_parallel_size}


def refused(reason: str) -> None:
    """The coordinator refused this engine's handshake before its model was loaded: the line its link would log,
    and exit 1 at once (from the watching thread, while the main one imports or loads)."""
    logger.error("%s", reason)
    logging.shutdown()
    os._exit(1)


def run(args: argparse.Namespace) -> int:
    pause_collection_until_started()  # until it serves (freeze_startup_heap)
    setup_logging(args.log_level)
    address = coordinator_address(args.coordinator)
    if args.group is not None and args.group < 0:
        raise ValueError(f"--group must be >= 0, got {args.group}")
    if not args.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout (vLLM's --shutdown-timeout) must be >= 0, got {args.drain_timeout}")
    config = layout_config(args)
    if config.data_parallel_size > 1:  # where its gang meets: /proc's environment of a forked engine is its launcher's
        logger.info("data-parallel rank %d of %d (pid %d): its group meets at %s:%s", config.data_parallel_rank,
                    config.data_parallel_size, os.getpid(), os.environ.get("MASTER_ADDR", "(unset)"),
                    os.environ.get("MASTER_PORT", "(unset)"))
    kv_role = "kv_both" if args.kv_transfer_config is None else kv_transfer_config(args.kv_transfer_config)
    if kv_role != "kv_both" and config.data_parallel_size > 1:
        raise ValueError(f"--kv-transfer-config kv_role {kv_role} is not implemented with data-parallel attention yet")
    resolve_model_args(args)  # a Hub id becomes its local directory before the directory is checked
    check_model_dir(args.model, tokenizer=args.tokenizer is None)
    token = read_token(args)
    from ..wire.security import fleet_secret  # noqa: PLC0415 - zmq: only when the command runs
    from ..wire.transport import RefusalWatch  # noqa: PLC0415

    # A coordinator that refuses this engine's secret ends it now, not after seconds of torch import and model load
    # (a single-rank engine: a group's followers may never talk to the coordinator)
    refusal = RefusalWatch(address, fleet_secret(token), refused) if config.world_size == 1 else None
    from ..engine import DynamicInferenceEngine  # noqa: PLC0415 - torch import is slow
    from ..engine.group.spawn import fork_ranks_here, remove_fork_server_directory  # noqa: PLC0415

    fork_ranks_here()  # this process's own __main__, and no thread yet when a group starts
    from ..engine.process.loop import run_engine_process  # noqa: PLC0415

    def make_engine() -> DynamicInferenceEngine:
        started = time.monotonic()
        logger.info("loading model from %s (device %s)", args.model, config.device)
        try:
            engine = DynamicInferenceEngine.from_model_dir(args.model, config, tokenizer_dir=args.tokenizer,
                                                           vocabulary_only=True)
        finally:
            if refusal is not None:
                refusal.close()  # loaded, the engine's own link takes over; failed, nothing is left watching
        logger.info("model loaded in %.1fs: %s", time.monotonic() - started, capacity_line(engine))
        return engine

    rc = run_engine_process(make_engine, address, token=token, group=args.group,
                            drain_timeout=args.drain_timeout, coordinator_timeout=args.coordinator_timeout,
                            info={"model": args.model, "kv_role": kv_role, **data_parallel_info(config)})
    # Everything is handed back and flushed: skip the interpreter's slow teardown of torch (seconds),
    # so that "the engine exited" follows "the engine acknowledged STOP" closely (what of it leaves a file, here).
    remove_fork_server_directory()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
