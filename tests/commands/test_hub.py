"""Models by Hub id, resolved from a Hugging Face cache laid out on disk; no network anywhere.

The cache is built the way ``huggingface_hub`` writes it (``models--org--name/snapshots/<commit>/``
plus ``refs/<branch>`` holding the commit), with a real tiny model in the snapshot, and resolved
through ``huggingface_hub`` itself. Subprocess tests set ``HF_HUB_CACHE`` (read when
``huggingface_hub`` is imported) and either ``HF_HUB_OFFLINE=1`` or an ``HF_ENDPOINT`` nobody
listens on, so that a download attempt fails at once instead of reaching the Internet.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_serve.commands.model_options import resolve_model_args
from megatron_serve.model.hub import HubId, ModelNotFoundError, parse_hub_id, resolve_model
from megatron_serve.server.modelinfo import default_model_name
from tests.helpers import free_port

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def hub_cache(root: Path, repo_id: str, model_dir: str | None, commit: str = COMMIT, ref: str | None = "main") -> Path:
    """A cache holding ``model_dir``'s files as ``repo_id`` at ``commit`` (named by ``refs/<ref>``)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    if model_dir is not None:
        shutil.copytree(model_dir, snapshot)
    else:
        snapshot.mkdir()
        (snapshot / "config.json").write_text("{}")
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def cli(*argv: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return subprocess.run([sys.executable, "-m", "megatron_serve.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env={**full, **env}, stdin=subprocess.DEVNULL)


def test_hub_ids_and_paths_are_told_apart():
    assert parse_hub_id("Qwen/Qwen3-0.6B") == HubId("Qwen/Qwen3-0.6B")
    assert parse_hub_id("meta-llama/Llama-3.2-1B@v1.0").revision == "v1.0"
    assert str(parse_hub_id("org/name@" + COMMIT)) == "org/name@" + COMMIT
    for not_an_id in ("/models/llama", "./org/name", "a/b/c", "name", "org/", "/name", "org--x/name", "org/na..me",
                      "~/org/name"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_an_existing_directory_wins_over_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/name", cache_dir=tmp_path / "cache") == Path("org/name")
    with pytest.raises(ValueError, match="--revision"):
        resolve_model("org/name", revision="v1", cache_dir=tmp_path / "cache")


def test_resolves_from_the_cache_by_branch_tag_and_commit_without_network(tmp_path):
    cache = tmp_path / "hub"
    main = hub_cache(cache, "org/tiny", None)
    tagged = hub_cache(cache, "org/tiny", None, commit=OTHER_COMMIT, ref="v2")
    assert resolve_model("org/tiny", cache_dir=cache) == main
    assert resolve_model("org/tiny@v2", cache_dir=cache) == tagged
    assert resolve_model("org/tiny", revision="v2", cache_dir=cache) == tagged
    assert resolve_model(f"org/tiny@{OTHER_COMMIT}", cache_dir=cache) == tagged
    with pytest.raises(ValueError, match="give one"):
        resolve_model("org/tiny@v2", revision="main", cache_dir=cache)
    with pytest.raises(ModelNotFoundError) as missing:
        resolve_model("org/tiny@v3", cache_dir=cache, download=False)
    assert "megatron-serve download org/tiny@v3" in str(missing.value) and "\n" not in str(missing.value)


def test_a_served_hub_model_is_named_by_its_id(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, "my-org/tiny.v2", None)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    args = argparse.Namespace(model="my-org/tiny.v2", revision=None, tokenizer="my-org/tiny.v2", download_dir=None)
    resolve_model_args(args)
    assert (args.model, args.tokenizer) == (str(snapshot), str(snapshot))
    assert default_model_name(args.model) == "my-org/tiny.v2"
    assert default_model_name(tmp_path / "models" / "llama-3.2-1b") == "llama-3.2-1b"


@pytest.mark.slow
def test_generate_serves_a_hub_id_from_the_cache_offline_with_the_tokenizer_from_elsewhere(tiny_llama, tmp_path):
    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, "org/tiny-llama", tiny_llama)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (snapshot / name).unlink(missing_ok=True)  # --tokenizer supplies them
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    done = cli("generate", "--model", "org/tiny-llama", "--tokenizer", tiny_llama, "--max-tokens", "3",
               "--ignore-eos", "Hello", env=env)
    assert done.returncode == 0, done.stderr
    assert f"loading model from {snapshot}" in done.stderr and "3 tokens in" in done.stderr
    without = cli("generate", "--model", "org/tiny-llama", "--max-tokens", "3", "Hello",
                  env={**env, "PYTHONPROFILEIMPORTTIME": "1"})
    assert without.returncode == 1 and "no tokenizer.json or tokenizer_config.json" in without.stderr
    assert not re.search(r"\| +torch$", without.stderr, re.MULTILINE)  # refused before the model's imports


@pytest.mark.slow
@pytest.mark.parametrize("network", ["offline", "unreachable"])
def test_a_model_that_cannot_be_had_fails_with_one_line_that_says_how_to_get_it(tmp_path, network):
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    if network == "offline":
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    for argv in (["run", "--model", "org/absent"], ["download", "org/absent"]):
        done = cli(*argv, env=env, timeout=120)
        assert done.returncode == 1
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert "org/absent" in lines[0] and "megatron-serve download org/absent" in lines[0], lines[0]
        assert ("HF_HUB_OFFLINE" if network == "offline" else "cannot be reached") in lines[0]
