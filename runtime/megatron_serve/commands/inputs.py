"""The commands' inputs, checked before anything starts: addresses, ports, model directories.

A wrong input found after the coordinator and an engine started costs a user 14 s and a traceback;
found here it costs a second and one line that says what to fix (``ValueError`` or
``FileNotFoundError``, which the CLI prints as ``megatron-serve COMMAND: error: ...``). Every
command reads its inputs through these functions, so a new input kind gets its check here.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

from ..wire.protocol import DEFAULT_PORT

#: Checkpoint dtypes the engine loads (``config.json`` ``torch_dtype`` / ``dtype``).
CHECKPOINT_DTYPES = ("float32", "float16", "bfloat16")

_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(?::(?P<port>[^:]*))?$")


def coordinator_address(text: str, flag: str = "--coordinator") -> str:
    """The ZeroMQ address of a coordinator: ``tcp://HOST:PORT`` from ``HOST:PORT``, ``HOST`` (port 5555),
    or ``tcp://HOST[:PORT]``; ``ipc://PATH`` as given."""
    address = text.strip()
    if address.startswith("ipc://") and len(address) > len("ipc://"):
        return address
    rest = address.removeprefix("tcp://")
    match = _HOST_PORT.match(rest)
    if "://" in rest or match is None:
        raise ValueError(f"{flag} must be HOST:PORT or tcp://HOST:PORT (the coordinator's ZeroMQ address), "
                         f"got {text!r}")
    port = match.group("port")
    port_number = DEFAULT_PORT if port is None else parse_port(port, flag, allow_zero=False)
    return f"tcp://{match.group('host')}:{port_number}"


def parse_port(value: int | str, flag: str, *, allow_zero: bool = True) -> int:
    """A TCP port number (0 = any free port, where ``allow_zero``)."""
    try:
        port = int(value)
    except ValueError:
        port = -1
    low = 0 if allow_zero else 1
    if not low <= port <= 65535:
        raise ValueError(f"{flag} must be a port number in {low}..65535, got {value!r}")
    return port


def check_port_free(host: str, port: int, flag: str) -> None:
    """Fail now, not once a child process tries to bind it, when ``host:port`` is taken (0 is always free)."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (choose another {flag}, "
                             "or 0 for any free port)") from None


def check_model_dir(model_dir: str, *, weights: bool = True, tokenizer: bool = True) -> Path:
    """Fail fast when ``model_dir`` cannot be served: its ``config.json`` (architecture and every other
    value the engine must run exactly), its dtype, its safetensors weights and its tokenizer files.

    ``weights=False`` for processes that never load them (the HTTP server reads only the config).
    """
    from ..model.config import ModelConfig  # noqa: PLC0415 - the engine's own parser: both agree
    from ..tokenizer import check_tokenizer_files  # noqa: PLC0415

    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist (make a small one with "
                                "`megatron-serve make-tiny-model DIR`, or point --model at a Hugging Face model "
                                "or a GGUF file)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir} (point --model at a Hugging Face "
                                "model directory)")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_file} is not readable JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file} must hold a JSON object")
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    if dtype is not None and dtype not in CHECKPOINT_DTYPES:
        raise ValueError(f"{config_file}: weights of dtype {dtype!r} are not supported (expected one of "
                         f"{', '.join(CHECKPOINT_DTYPES)})")
    try:
        ModelConfig.from_dict(raw)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{config_file} lacks or mistypes {exc} (is it a decoder-only language model?)") from None
    except ValueError as exc:  # UnsupportedModelError among them
        raise ValueError(f"{model_dir}: {exc}") from None
    if weights:
        from ..model.checkpoint_files import checkpoint_files  # noqa: PLC0415

        checkpoint_files(path)
    if tokenizer:
        check_tokenizer_files(path)
    return path
