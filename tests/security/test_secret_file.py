"""A secret kept in a file is read one way: the fleet's ``--token-file``, an ``--api-key-file`` and the operator's
token key file each give the file's content without surrounding whitespace, and refuse a missing or an empty file
naming what named it."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_operator.config import ENV_TOKEN_KEY_FILE, token_key_from_env
from megatron_serve.cli import parse_args
from megatron_serve.commands.options import read_token
from megatron_serve.commands.server import read_api_key
from megatron_serve.wire.security import read_secret_file

SECRET = "s" * 40


def test_the_content_is_read_without_surrounding_whitespace(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(f"\n {SECRET}\n")
    assert read_secret_file(str(path), "--x") == SECRET.encode()
    assert read_token(parse_args(["engine", "--model", "/m", "--coordinator", "tcp://h:1", "--token-file",
                                  str(path)])) == SECRET
    assert read_api_key(parse_args(["run", "--model", "/m", "--api-key-file", str(path)])) == SECRET
    assert token_key_from_env({ENV_TOKEN_KEY_FILE: str(path)}) == SECRET.encode()


@pytest.mark.parametrize("content", [None, " \n"])
def test_a_missing_or_empty_file_is_refused_naming_its_source(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "secret"
    if content is not None:
        path.write_text(content)
    problem = "is empty" if content is not None else "cannot read"
    with pytest.raises(ValueError, match=f"^--token-file: .*{problem}"):
        read_token(parse_args(["engine", "--model", "/m", "--coordinator", "tcp://h:1", "--token-file", str(path)]))
    with pytest.raises(ValueError, match=f"^--api-key-file: .*{problem}"):
        read_api_key(parse_args(["run", "--model", "/m", "--api-key-file", str(path)]))
    with pytest.raises(ValueError, match=f"^{ENV_TOKEN_KEY_FILE}: .*{problem}"):
        token_key_from_env({ENV_TOKEN_KEY_FILE: str(path)})
