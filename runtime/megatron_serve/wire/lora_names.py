"""What a LoRA adapter's name and path may be, checked wherever one enters (the HTTP routes, ``--lora-modules``,
a LOAD_LORA verb, a request's ``LoRARequest``, a trainer's push), and how names and paths appear in logs.

A name is what requests give as their ``model``, a label in ``/v1/models`` and metrics, and a directory under
``--lora-push-dir``: so no path separator, no control character, not ``.`` or ``..``, at most
:data:`MAX_NAME_CHARS` characters. A path is at most :data:`MAX_PATH_CHARS` characters (Linux's ``PATH_MAX``)
without a control character (a NUL byte ends a path in the C library: what was checked would not be what is
opened). Whatever reaches a log or an error message anyway goes through :func:`shown`: escaped and truncated.
Standard library only: the HTTP server imports it without torch.
"""

from __future__ import annotations

import re
from pathlib import Path

MAX_NAME_CHARS = 128
MAX_PATH_CHARS = 4096
SHOWN_CHARS = 160  # of a name or path in a log line or an error message

# C0 and C1 control characters and DEL
_CONTROL = "\x00-\x1f\x7f-\x9f"
NAME_PATTERN = re.compile(rf"(?!\.\.?$)[^/\\{_CONTROL}]{{1,{MAX_NAME_CHARS}}}")
_CONTROL_CHAR = re.compile(f"[{_CONTROL}]")


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` quoted for a log line or a message: control characters escaped, cut at ``limit`` characters with
    how many there were."""
    quoted = repr(text[:limit])
    return quoted if len(text) <= limit else f"{quoted}... ({len(text)} characters)"


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot name an adapter, or None."""
    if not isinstance(name, str) or not name:
        return "a LoRA adapter needs a non-empty name"
    if NAME_PATTERN.fullmatch(name) is None:
        return (f"LoRA adapter name {shown(name)} is not allowed: at most {MAX_NAME_CHARS} characters, no '/', '\\' "
                "or control characters, not '.' or '..'")
    return None


def path_problem(name: str, path: object) -> str | None:
    """Why ``path`` cannot be an adapter's directory (before anything looks at the file system), or None."""
    if not isinstance(path, str) or not path:
        return f"LoRA adapter {shown(name)} needs a non-empty path"
    if len(path) > MAX_PATH_CHARS or _CONTROL_CHAR.search(path):
        return (f"LoRA adapter {shown(name)}: path {shown(path)} is not allowed: at most {MAX_PATH_CHARS} characters, "
                "no control characters")
    return None


def directory_problem(name: str, path: str | Path) -> str | None:
    """Why the adapter directory at ``path`` cannot be read (missing, or not a directory), or None: a look at the
    file system only, so that ``run`` says it before any slow step (a model's conversion, torch's import)."""
    directory = Path(path)
    if not directory.exists():
        return f"LoRA adapter {name!r}: {shown(str(directory))} does not exist"
    if not directory.is_dir():
        return f"LoRA adapter {name!r}: {shown(str(directory))} is not a directory"
    return None
