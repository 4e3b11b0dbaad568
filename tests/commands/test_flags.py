"""The serving commands' options table (``commands/flags.yaml``): every row reaches a command, the names it uses
are the code's values, and a row the table does not understand is refused by name."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_serve.cli import COMMANDS
from megatron_serve.commands import flags
from megatron_serve.limits import FIRST_REQUEST_IDLE, STATUS_INTERVAL
from megatron_serve.wire.protocol import DEFAULT_PORT


def command_parser(name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=name, allow_abbrev=False)
    importlib.import_module(COMMANDS[name][0]).add_arguments(parser)
    return parser


def option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(action for action in parser._actions if flag in action.option_strings)


def test_every_row_reaches_a_command_with_its_help() -> None:
    """No row is dead: each is an option of some command, with the row's own help (the same flag may be two rows,
    ``--host`` of the coordinator and of the HTTP server)."""
    offered = {(flag, action.help) for name in COMMANDS for action in command_parser(name)._actions
               for flag in action.option_strings}
    offered_flags = {flag for flag, _ in offered}
    rows = [row for rows in flags.SECTIONS.values() for row in rows if "flags" in row]
    assert len(rows) > 60
    for row in rows:
        assert set(row["flags"]) <= offered_flags, row["flags"]
        if "{" not in row["help"]:
            assert (row["flags"][0], row["help"]) in offered, row["flags"]


def test_named_values_are_the_codes() -> None:
    """A default or a figure in a help is the constant the code uses, not a copy of it."""
    coordinator, server = command_parser("coordinator"), command_parser("server")
    assert option(coordinator, "--port").default == DEFAULT_PORT
    assert option(server, "--status-interval").default == STATUS_INTERVAL
    assert f"stay idle {FIRST_REQUEST_IDLE:g} s" in option(server, "--timeout-keep-alive").help
    assert "$MEGATRON_SERVE_API_KEY" in option(server, "--api-key-file").help
    assert option(server, "--host").default == "0.0.0.0" and option(command_parser("run"), "--host").default == \
        "127.0.0.1"
    # A caller's value overrides the table's: the images section, with another fetch timeout.
    parser = argparse.ArgumentParser()
    flags.add_flags(parser, "images", IMAGES=SimpleNamespace(fetch_timeout=2.5))
    assert option(parser, "--image-fetch-timeout").default == 2.5
    assert "(default 2.5)" in option(parser, "--image-fetch-timeout").help
    # A JSON example in a help is text, not a name.
    assert '{"kv_connector": ' in option(command_parser("engine"), "--kv-transfer-config").help


def test_exclusive_rows_refuse_each_other() -> None:
    parser = command_parser("server")
    base = ["--model", "/m", "--coordinator", "tcp://h:5555"]
    assert parser.parse_args([*base, "--api-key", "k"]).api_key == "k"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--api-key", "k", "--api-key-file", "/f"])
    assert parser.parse_args([*base, "--api-key", "k", "--admin-key", "a"]).admin_key == "a"  # another group


def test_aliases_come_with_the_rows() -> None:
    """vLLM's names are added beside ours (commands/aliases.py), both setting one attribute."""
    parser = command_parser("engine")
    base = ["--model", "/m", "--coordinator", "tcp://h:5555"]
    assert parser.parse_args([*base, "--max-model-len", "99"]).max_sequence_length == 99
    assert parser.parse_args([*base, "--enforce-eager"]).cuda_graphs is False


def test_a_row_the_table_does_not_know_is_refused(tmp_path: Path) -> None:
    table = tmp_path / "flags.yaml"
    table.write_text("http:\n- flags: [--port]\n  defualt: 8000\n")
    with pytest.raises(ValueError, match=r"flags.yaml http: row \['--port'\]: unknown key\(s\) defualt"):
        flags._load(table)
    table.write_text("http:\n- type: int\n")
    with pytest.raises(ValueError, match="flags.yaml http: row .*: a row has flags, or is an include alone"):
        flags._load(table)
    table.write_text("http:\n- {include: log, help: h}\n")
    with pytest.raises(ValueError, match="an include alone"):
        flags._load(table)


def test_an_unknown_name_or_section_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flags, "SECTIONS", {"x": [{"flags": ["--x"], "default": "{NOPE}"}]})
    with pytest.raises(KeyError, match=r"\{NOPE\}, which is not given"):
        flags.add_flags(argparse.ArgumentParser(), "x")
    with pytest.raises(KeyError, match="no section 'y'"):
        flags.add_flags(argparse.ArgumentParser(), "y")
