"""Models named by a Hugging Face Hub id (``org/name[@revision]``), resolved to a local directory.

Everything goes through ``huggingface_hub`` (its cache layout, locking, resumable downloads,
progress bars, tokens and offline mode); nothing here speaks HTTP. The order is the one that
makes a first run unable to trip:

1. a path that exists is a model directory, whatever it looks like (as in vLLM and transformers), or a GGUF
   file, served through a directory made from it (:mod:`megatron_serve.model.gguf.view`);
2. a Hub id is looked up in the local cache first (``models--org--name/snapshots/<commit>``
   through ``refs/<revision>``), with no network call at all: offline machines and air-gapped
   pods serve what is cached, and a cached model starts without waiting on the Hub;
3. otherwise it is downloaded (weights in safetensors, config, tokenizer and generation files
   only), with ``huggingface_hub``'s progress bars, unless ``HF_HUB_OFFLINE`` is set;
4. when none of that works, :class:`ModelNotFoundError` says in one line how to get the files.

``megatron-serve download`` (and the operator's init container) run step 3 on purpose.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

#: What a served model needs from a repository: no ``*.bin``/``*.pth`` duplicates, no GGUF/ONNX.
#: The weights are the ``*.safetensors``; the rest is what the coordinator and the server read.
WEIGHT_PATTERNS = ("*.safetensors",)
ALLOW_PATTERNS = ("*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja", *WEIGHT_PATTERNS)

# org/name as the Hub accepts them (no "--" or ".." inside, which the Hub refuses too), then an
# optional @revision: a branch, a tag or a commit hash.
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9])?/[\w.-]*[\w])(?:@(?P<revision>[\w./-]+))?")


class ModelNotFoundError(FileNotFoundError):
    """The model is neither a local directory nor obtainable from the Hub; ``str()`` says what to do."""


@dataclass(frozen=True)
class HubId:
    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")

    def with_revision(self, revision: str | None) -> "HubId":
        """This id at ``revision`` (vLLM's ``--revision``); a different ``@revision`` in the id is an error."""
        if revision is None:
            return self
        if self.revision is not None and self.revision != revision:
            raise ValueError(f"{self} names revision {self.revision} but --revision says {revision}: give one")
        return HubId(self.repo_id, revision)


def parse_hub_id(text: str) -> HubId | None:
    """``HubId`` for ``org/name[@revision]``, else ``None`` (then ``text`` can only be a path)."""
    match = _HUB_ID.fullmatch(text)
    if match is None or "--" in match["repo"] or ".." in match["repo"]:
        return None
    return HubId(match["repo"], match["revision"])


def resolve_model(model: str | os.PathLike, *, revision: str | None = None, cache_dir: str | os.PathLike | None = None,
                  download: bool = True, tokenizer: bool = True) -> Path:
    """The local directory of ``model``: the path itself, a GGUF file's directory, or a Hub id's snapshot (cached
    or downloaded).

    ``revision`` (vLLM's ``--revision``) is an alternative to ``@revision`` in the id; giving both
    is an error. ``cache_dir`` is the Hugging Face hub cache (default: ``$HF_HUB_CACHE``, usually
    ``~/.cache/huggingface/hub``). ``download=False`` only looks in the cache. ``tokenizer=False``: the
    tokenizer comes from elsewhere (``--tokenizer``), so a GGUF file's directory is made without one.
    Anything that is not a Hub id comes back as a ``Path`` unchanged, for the directory checks to judge.
    """
    path = Path(model).expanduser()
    hub = parse_hub_id(str(model))
    if path.exists() or hub is None:
        if revision is not None:
            raise ValueError(f"--revision {revision} applies to Hub ids (org/name), not to the directory {model}")
        if path.suffix.lower() != ".gguf" or not path.is_file():
            return path
        from .gguf.view import gguf_view  # noqa: PLC0415 - torch and gguf only for a GGUF file

        return gguf_view(path, tokenizer=tokenizer)
    hub = hub.with_revision(revision)
    cached = _from_cache(hub, cache_dir)
    if cached is not None:
        return cached
    return fetch(hub, cache_dir=cache_dir) if download else _missing(hub, cache_dir, "it is not downloaded here")


def fetch(hub: HubId, *, cache_dir: str | os.PathLike | None = None, local_dir: str | os.PathLike | None = None,
          weights: bool = True) -> Path:
    """Download ``hub`` (with progress bars) into the cache, or into ``local_dir``; returns its directory.

    ``weights=False`` leaves out the safetensors (a coordinator pod reads only config and tokenizer).
    """
    from huggingface_hub import constants, snapshot_download  # noqa: PLC0415 - only when a Hub id is used
    from huggingface_hub.errors import (  # noqa: PLC0415
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if constants.HF_HUB_OFFLINE:
        return _missing(hub, cache_dir, "HF_HUB_OFFLINE is set")
    patterns = [p for p in ALLOW_PATTERNS if weights or p not in WEIGHT_PATTERNS]
    try:
        return Path(snapshot_download(hub.repo_id, revision=hub.revision, cache_dir=cache_dir, local_dir=local_dir,
                                      allow_patterns=patterns))
    except GatedRepoError:
        raise ModelNotFoundError(f"{hub} is gated on the Hugging Face Hub: accept its terms on https://huggingface.co/"
                                 f"{hub.repo_id} and set HF_TOKEN (or run `hf auth login`)") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"the Hugging Face Hub has no revision {hub.revision!r} of {hub.repo_id}") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"{hub.repo_id} is not a local directory, and the Hugging Face Hub has no such "
                                 "model (or it is private: set HF_TOKEN)") from None
    except LocalEntryNotFoundError as exc:  # the Hub could not be reached and nothing is cached
        return _missing(hub, cache_dir, f"the Hub cannot be reached ({_first_line(exc)})")
    except (HfHubHTTPError, OSError) as exc:
        return _missing(hub, cache_dir, f"the download failed ({_first_line(exc)})")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    from huggingface_hub import constants  # noqa: PLC0415

    return Path(cache_dir or constants.HF_HUB_CACHE)


def _from_cache(hub: HubId, cache_dir: str | os.PathLike | None) -> Path | None:
    """The cached snapshot of ``hub`` (no network call), or ``None``."""
    from huggingface_hub import snapshot_download  # noqa: PLC0415
    from huggingface_hub.errors import LocalEntryNotFoundError  # noqa: PLC0415

    try:
        return Path(snapshot_download(hub.repo_id, revision=hub.revision, cache_dir=cache_dir, local_files_only=True))
    except LocalEntryNotFoundError:
        return None


def _missing(hub: HubId, cache_dir: str | os.PathLike | None, why: str) -> NoReturn:
    raise ModelNotFoundError(
        f"{hub} is not a local directory and not in the Hugging Face cache ({cache_root(cache_dir)}), and {why}: "
        f"run `megatron-serve download {hub}` (or `hf download {hub.repo_id}`) where the network "
        "reaches huggingface.co, or pass --model DIR with the files")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
