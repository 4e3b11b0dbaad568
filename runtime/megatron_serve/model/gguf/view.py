"""A GGUF file served as a model directory: its config, its tokenizer and a link to the file, made once.

Every process of a fleet reads a model as a directory (``config.json``, the tokenizer files, the weights), so a
GGUF file becomes one before anything starts (:func:`gguf_view`, from :func:`megatron_serve.model.hub.resolve_model`):
``config.json`` read from the file's metadata (:mod:`.metadata`), the tokenizer and chat template as
``transformers`` builds them from the file (``gguf_file=``, as vLLM does), and ``model.gguf``, a link to the file
itself, whose tensors the loader dequantizes at load (:mod:`.tensors`), and the file's tensor table, so that a load
reads none of its metadata (:func:`.tensors.save_table`). Building reads the file's metadata
(seconds for a large vocabulary), so the directory is kept in the user's cache, keyed by the file's path, size and
modification time, and made in a scratch directory renamed into place: processes that start together share it.
The directory is named after the file, which is what a model served from it is called by default.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ModelConfig
from ..errors import UnsupportedModelError

if TYPE_CHECKING:
    from gguf import GGUFReader

GGUF_SUFFIX = ".gguf"  # what tells a GGUF file (vLLM tells them by the suffix too)
#: The link to the GGUF file inside its directory (the loader's weights).
WEIGHTS_LINK = "model.gguf"
#: What a directory holds, in its cache key: a change to what :func:`_build` writes bumps it, so that directories made
#: before are made again (the package's version keyed them before, and was this value).
VIEW_FORMAT = "0.1.0"


def cache_root() -> Path:
    """Where the directories are kept: ``$XDG_CACHE_HOME/megatron-serve/gguf`` (``~/.cache`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "megatron-serve" / "gguf"


def gguf_view(path: str | os.PathLike, *, tokenizer: bool = True) -> Path:
    """The model directory of the GGUF file ``path``, made on first use; ``tokenizer=False`` leaves out the
    tokenizer (vLLM's ``--tokenizer`` names another), whose building can fail where ``transformers`` cannot
    convert the file's vocabulary. A file this engine cannot serve is refused here, naming what it holds."""
    path = Path(path).expanduser().resolve()
    stat = path.stat()
    identity = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{tokenizer}\0{VIEW_FORMAT}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:20]
    root = cache_root()
    view = root / key / path.name
    if (view / "config.json").is_file():
        return view
    scratch = root / f".{key}.{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        _build(path, scratch / path.name, tokenizer)
        try:
            scratch.rename(root / key)
        except OSError:  # another process made it first: theirs is the same
            if not (view / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return view


def _build(path: Path, view: Path, tokenizer: bool) -> None:
    from gguf import GGUFReader  # noqa: PLC0415 - the library only where a GGUF file is served

    from .metadata import hf_config  # noqa: PLC0415
    from .tensors import check_tensors, save_table  # noqa: PLC0415

    reader = GGUFReader(path)
    config = hf_config(reader)
    ModelConfig.from_dict(config)  # the config's own refusals, before anything is written
    check_tensors(reader)
    view.mkdir(parents=True)
    (view / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (view / WEIGHTS_LINK).symlink_to(path)
    save_table(reader, path, view)
    if tokenizer:
        _save_tokenizer(path, view, reader)


@contextlib.contextmanager
def _read(path: Path, reader: GGUFReader) -> Iterator[None]:
    """``transformers`` given ``reader`` where it reads ``path`` again (it calls ``gguf.GGUFReader`` on the file):
    the metadata read once, not twice (a large vocabulary's strings are seconds of CPU). Other files it reads."""
    import gguf  # noqa: PLC0415

    original = gguf.GGUFReader

    def read(file: str | os.PathLike, *args: object, **kwargs: object) -> GGUFReader:
        return reader if not args and not kwargs and Path(file).resolve() == path else original(file, *args, **kwargs)

    gguf.GGUFReader = read
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _save_tokenizer(path: Path, view: Path, reader: GGUFReader) -> None:
    """The file's tokenizer and chat template, as ``transformers`` builds them from the file's metadata (``reader``,
    already read), saved into ``view``."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    try:
        with _read(path, reader):
            built = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (KeyError, ValueError, NotImplementedError) as exc:  # a vocabulary transformers cannot convert, or none
        raise UnsupportedModelError(f"{path.name}: transformers cannot build a tokenizer from the file "
                                    f"({type(exc).__name__}: {exc}): pass --tokenizer DIR, a directory with the "
                                    "model's tokenizer files") from exc
    built.save_pretrained(str(view))
