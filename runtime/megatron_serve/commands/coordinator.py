"""``megatron-serve coordinator``: routes requests to engine groups and runs the lifecycle state machine."""

from __future__ import annotations

import argparse
import os

from ..limits import DEFAULT_MAX_REQUEST_LOGPROBS
from ..heap import pause_collection_until_started
from ..wire.protocol import DEFAULT_PORT, MAX_MESSAGE_BYTES
from .inputs import parse_port
from .model_options import add_model_options, resolve_model_args
from .options import (add_insecure_option, add_log_option, add_routing_options, add_token_option, read_token,
                      setup_logging)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_options(parser, what="the model: a directory or a Hub id (nothing is loaded: the coordinator names "
                                   "its tokenizer directory to clients, which tokenize and make the text)")
    parser.add_argument("--host", default="0.0.0.0", help="interface to bind (0.0.0.0 = all)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="ROUTER port (0 = any free port)")
    add_routing_options(parser)
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0, metavar="S",
                        help="remove an engine silent for this long and re-queue its requests")
    parser.add_argument("--verb-timeout", type=float, default=60.0, metavar="S",
                        help="remove an engine that does not acknowledge a lifecycle verb step for this long "
                             "(its step loop hangs; heartbeats alone do not count) and re-queue its requests, "
                             "so the verb completes with the other engines")
    parser.add_argument("--weights-timeout", type=float, default=900.0, metavar="S",
                        help="the same deadline for steps that move weights (SUSPEND, RESUME, REFIT's load), "
                             "which take as long as reading the checkpoint")
    parser.add_argument("--stall-timeout", type=float, default=120.0, metavar="S",
                        help="while the fleet runs, remove an engine with requests whose step loop made no "
                             "progress for this long (it hangs; heartbeats alone do not count) and re-queue its "
                             "requests; generous, since one step may be a long prefill")
    parser.add_argument("--client-timeout", type=float, default=600.0, metavar="S",
                        help="forget requests of a client disconnected for this long")
    parser.add_argument("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES, metavar="N",
                        help="drop frames larger than this")
    parser.add_argument("--max-request-image-bytes", type=int, default=12 * 1024 * 1024, metavar="N",
                        help="image file bytes one request may carry (vision-language models); "
                             "larger requests are refused with an error naming the limit")
    parser.add_argument("--max-request-logprobs", type=int, default=DEFAULT_MAX_REQUEST_LOGPROBS, metavar="N",
                        help="most log-prob entries one engine request may ask for (prompt positions x "
                             "(prompt_logprobs + 1) + tokens to generate x (logprobs + 1)); larger requests are "
                             "refused with an error naming the budget and the request's figure")
    parser.add_argument("--address-file", metavar="PATH",
                        help="write the bound address here once listening (default: nowhere)")
    add_token_option(parser, default="none: refused unless --insecure")
    add_insecure_option(parser)
    add_log_option(parser)


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
