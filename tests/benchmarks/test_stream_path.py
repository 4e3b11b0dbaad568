"""``benchmarks/stream_path.py`` runs end to end on a few streams, and its ``--check`` reads what the server wrote:
every answer's text is its tokens' decoding (and a changed byte in an answer fails the check)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.benchmarks.scripts import run_script
from tests.helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "stream_path.py"


def _module():
    return load_script("stream_path_benchmark", SCRIPT)


@pytest.mark.parametrize("ids", [(), ("--random-ids",)], ids=["text", "random-ids"])
def test_every_measure_runs_and_every_answer_is_its_tokens_text(tmp_path, ids):
    # --hot: the caches are not filled between frames (a copy of twice the last level, 0.1-0.2 s a frame here, is
    # most of the run's time and none of what it checks); test_the_evictor_fills_twice_the_last_level holds that.
    # --random-ids: a quarter of the tokens are bytes of split characters (a request starting on one waited for a
    # first chunk that never came)
    result = run_script("stream_path.py", "--streams", "4", "--requests", "12", "--steps", "3", "--single-requests",
                        "3", "--repeats", "1", "--check", "--json", "--hot", *ids, timeout=300,
                        env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert not list(tmp_path.iterdir())  # its scratch directory is gone (a suite's runs left one each in $TMPDIR)
    lines = result.stdout.strip().splitlines()
    checked = int(lines[0].split()[1])
    assert checked == 8 + 4 + 3 + 12  # the warm-up's, the token measure's, the request measure's, the mix's
    figures = json.loads(lines[-1])
    assert set(figures) == {"token", "intake", "end", "mix"}
    assert all(value > 0 for value in figures.values())


def _answer(text: str, tokens: int) -> bytes:
    events = [{"choices": [{"index": 0, "text": text}], "usage": None},
              {"choices": [], "usage": {"completion_tokens": tokens}}]
    body = b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in events) + b"data: [DONE]\n\n"
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)


class _Written(SimpleNamespace):
    """What a connection's transport kept."""

    def count(self) -> "_Written":
        return self


def test_the_check_fails_on_an_answer_that_is_not_the_tokens_text():
    module = _module()
    bench = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda tokens: "ab" * len(tokens)))
    good = SimpleNamespace(transport=_Written(data=_answer("abab", 2)), expected=[[1, 2]])
    assert module.check(bench, [good]) == 1
    changed = SimpleNamespace(transport=_Written(data=_answer("abac", 2)), expected=[[1, 2]])
    with pytest.raises(AssertionError, match="streamed"):
        module.check(bench, [changed])
    miscounted = SimpleNamespace(transport=_Written(data=_answer("abab", 3)), expected=[[1, 2]])
    with pytest.raises(AssertionError, match="usage"):
        module.check(bench, [miscounted])


def test_the_evictor_fills_twice_the_last_level(monkeypatch):
    module = _module()
    monkeypatch.setattr(module, "last_level_cache_bytes", lambda: 4096)
    evictor = module.Evictor(True)
    evictor._source[:] = b"x" * 8192
    evictor()
    assert len(evictor._target) == 8192 and evictor._target == evictor._source
    assert len(module.Evictor(False)._source) == 0  # --hot: nothing copied


def test_calls_counts_a_requests_python_calls_without_the_benchmarks_own(tmp_path):
    result = run_script("stream_path.py", "--streams", "2", "--requests", "4", "--single-requests", "3", "--hot",
                        "--calls", "5", timeout=300, env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    head, *top = result.stdout.strip().splitlines()
    assert head.startswith("Python calls per request (intake to the body's end, 3 requests): ")
    assert float(head.rsplit(" ", 1)[1]) > 100  # a request runs hundreds of calls through the real server
    assert len(top) == 5 and not any("stream_path.py" in line for line in top)
