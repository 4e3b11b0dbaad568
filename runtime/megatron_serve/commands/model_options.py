"""Where a command's model comes from: ``--model`` (a directory, a GGUF file or a Hub id), ``--tokenizer``,
``--revision``.

:func:`resolve_model_args` turns Hub ids into local directories (cache first, then a download
with progress; :mod:`megatron_serve.model.hub`), and a GGUF file into the directory made from it, and runs before
anything checks the model directory or starts a process, so that every later step, and every child process,
sees plain directories.
A model served from a Hub id is named by the id (``Qwen/Qwen3-0.6B``), as in vLLM, not by the
snapshot directory (:func:`megatron_serve.server.modelinfo.default_model_name` reads it from the
cache layout).
"""

from __future__ import annotations

import argparse

MODEL_METAVAR = "DIR|FILE.gguf|ORG/NAME[@REV]"


def add_model_options(parser: argparse.ArgumentParser, *, positional: bool = False,
                      what: str = "the model: a Hugging Face model directory, a GGUF file, or a Hub id (cached, else "
                                "downloaded)",
                      tokenizer: bool = True) -> None:
    """``--model`` (or a positional ``model`` for ``serve``), ``--revision`` and (``tokenizer``) ``--tokenizer``."""
    if positional:
        parser.add_argument("model", metavar=MODEL_METAVAR, help=what)
    else:
        parser.add_argument("--model", required=True, metavar=MODEL_METAVAR, help=what)
    parser.add_argument("--revision", metavar="REV", default=None,
                        help="Hub branch, tag or commit of a Hub id (default: main; same as ORG/NAME@REV)")
    parser.add_argument("--download-dir", metavar="DIR", default=None,
                        help="the Hugging Face cache Hub ids are read from and downloaded to (default: "
                             "$HF_HUB_CACHE, usually ~/.cache/huggingface/hub)")
    if tokenizer:
        parser.add_argument("--tokenizer", metavar=MODEL_METAVAR, default=None,
                            help="take the tokenizer files from here instead (default: the model's own; a GGUF "
                                 "file's is built from the file)")


def resolve_model_args(args: argparse.Namespace) -> None:
    """Replace Hub ids and GGUF files in ``args.model`` / ``args.tokenizer`` by their local directories (in place)."""
    from ..model.hub import resolve_model  # noqa: PLC0415

    tokenizer = getattr(args, "tokenizer", None)
    args.model = str(resolve_model(args.model, revision=args.revision, cache_dir=args.download_dir,
                                   tokenizer=tokenizer is None))
    if tokenizer is not None:
        args.tokenizer = str(resolve_model(args.tokenizer, cache_dir=args.download_dir))
