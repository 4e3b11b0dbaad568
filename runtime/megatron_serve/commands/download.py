"""``megatron-serve download ORG/NAME[@REV] [--local-dir DIR]``: fetch a Hub model ahead of serving.

Without ``--local-dir`` the files go to the Hugging Face cache, where ``--model ORG/NAME`` finds
them later, also offline. With it they go to a plain directory: what the operator's init
container does to fill a model volume from ``spec.model.hub`` (``--skip-weights`` in the coordinator
pod, which reads only config and tokenizer). Served files only (safetensors,
config, tokenizer, generation config; :data:`megatron_serve.model.hub.ALLOW_PATTERNS`), with
``huggingface_hub``'s progress bars; ``HF_TOKEN`` is honoured for gated and private models.
"""

from __future__ import annotations

import argparse

from .flags import add_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="ORG/NAME[@REV]", help="the Hub id, optionally with a branch, tag or commit")
    add_flags(parser, "download")


def run(args: argparse.Namespace) -> int:
    from ..model.hub import fetch, parse_hub_id  # noqa: PLC0415

    hub = parse_hub_id(args.model)
    if hub is None:
        raise ValueError(f"{args.model!r} is not a Hub id: expected ORG/NAME or ORG/NAME@REVISION")
    hub = hub.with_revision(args.revision)
    path = fetch(hub, local_dir=args.local_dir, weights=not args.skip_weights)
    print(f"{hub} is in {path}")
    return 0
