"""``megatron-serve coordinator``: routes requests to engine groups and runs the lifecycle state machine."""

from __future__ import annotations

import argparse
import os

from ..heap import pause_collection_until_started
from .inputs import parse_port
from .model_options import add_model_options, resolve_model_args
from ..coordinator.routing import KNOWN_POLICIES
from .flags import add_flags
from .options import add_token_option, read_token, setup_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_options(parser, what="the model: a directory or a Hub id (nothing is loaded: the coordinator names "
                                   "its tokenizer directory to clients, which tokenize and make the text)")
    add_flags(parser, "coordinator", KNOWN_POLICIES=KNOWN_POLICIES)
    add_token_option(parser, default="none: refused unless --insecure")
    add_flags(parser, "insecure", "log")


def run(args: argparse.Namespace) -> int:
    pause_collection_until_started()  # until it serves (freeze_startup_heap)
    setup_logging(args.log_level)
    from ..coordinator import Coordinator, check_secret, serve  # noqa: PLC0415 - keep --help fast
    from ..coordinator.routing import make_routing_policy  # noqa: PLC0415
    from ..tokenizer import check_tokenizer_files  # noqa: PLC0415 - a file check only: no transformers

    parse_port(args.port, "--port")
    if args.heartbeat_timeout <= 0:
        raise ValueError(f"--heartbeat-timeout must be > 0, got {args.heartbeat_timeout}")
    if args.session_affinity_ttl < 0:
        raise ValueError(f"--session-affinity-ttl must be >= 0, got {args.session_affinity_ttl}")
    if args.max_request_image_bytes < 1:
        raise ValueError(f"--max-request-image-bytes must be >= 1, got {args.max_request_image_bytes}")
    if args.max_request_logprobs < 1:
        raise ValueError(f"--max-request-logprobs must be >= 1, got {args.max_request_logprobs}")
    for flag in ("verb_timeout", "weights_timeout", "stall_timeout"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    make_routing_policy(args.routing)  # fail before loading anything
    resolve_model_args(args)
    tokenizer_dir = args.tokenizer or args.model
    check_tokenizer_files(tokenizer_dir)  # a wrong path fails the start; clients load it, never this process
    token = read_token(args)
    check_secret(token, args.insecure)  # no secret and no --insecure: one line saying what to pass
    coordinator = Coordinator(
        host=args.host, port=args.port, token=token, insecure=args.insecure, routing=args.routing,
        heartbeat_timeout=args.heartbeat_timeout, client_timeout=args.client_timeout,
        verb_timeout=args.verb_timeout, weights_timeout=args.weights_timeout, stall_timeout=args.stall_timeout,
        max_message_bytes=args.max_message_bytes, model=args.model, max_image_bytes=args.max_request_image_bytes,
        max_request_logprobs=args.max_request_logprobs, tokenizer_dir=os.path.abspath(tokenizer_dir),
        session_ttl=args.session_affinity_ttl,
    )
    import zmq  # noqa: PLC0415

    try:
        coordinator.bind()
    except zmq.ZMQError as exc:  # e.g. address in use
        raise RuntimeError(f"cannot listen on {args.host}:{args.port}: {exc} (choose another --port)") from None
    serve(coordinator, address_file=args.address_file)
    return 0
