"""``benchmarks/serving.py`` reads server-sent events as the specification says, wherever the bytes are cut.

Its earlier reader split lines wherever Python does (``str.splitlines``: U+2028, U+0085 ...) and crashed on
``JSONDecodeError: Unterminated string`` at concurrency 64 when a random model emitted U+2028.
"""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.scripts import run_script, script_fixture

serving = script_fixture("serving", "serving_benchmark", "serving.py")


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_events_are_read_whole_wherever_the_stream_is_cut(serving, newline):
    texts = ["one\u2028two", "three\u0085four\u2029", "plain"]
    stream = b"".join(b": a comment" + newline + b"data: " + json.dumps({"text": t}, ensure_ascii=False).encode()
                      + newline + newline for t in texts)
    stream += b"data: first" + newline + b"data:second" + newline + newline + b"data: [DONE]" + newline + newline
    for cut in range(1, len(stream)):
        events = serving.EventStream()
        data = events.feed(stream[:cut]) + events.feed(stream[cut:])
        assert [json.loads(d)["text"] for d in data[:3]] == texts, cut
        assert data[3:] == ["first\nsecond", "[DONE]"], cut


def test_staggered_lengths_spread_around_the_uniform_length(serving):
    uniform = serving.workload(64, 8, 128, 512, "uniform", 0)
    staggered = serving.workload(64, 8, 128, 512, "staggered", 0)
    assert uniform.prompts == staggered.prompts and all(0 <= t < 512 for p in uniform.prompts for t in p)
    assert uniform.lengths == [128] * 64
    assert min(staggered.lengths) == 64 and max(staggered.lengths) == 192 and len(set(staggered.lengths)) > 32
    assert abs(staggered.tokens - uniform.tokens) <= 64


def test_a_small_level_runs_end_to_end_with_every_column(tiny_llama):
    """The benchmark the front end's goals are read from starts a stack, streams through its aiohttp client and
    prints a full row: the served and offline rates, the stack's CPU by process and the client's own. ``--model``:
    the suite's tiny Llama, the model the script makes without one (the script's interpreter spent ~3 CPU-s
    importing transformers' model classes to make it)."""
    result = run_script("serving.py", "--model", tiny_llama, "--concurrency", "2", "--requests", "4", "--lengths",
                        "uniform", "--output-tokens", "4", "--prompt-tokens", "8")
    assert result.returncode == 0, result.stderr[-3000:]
    header, *rows = [line for line in result.stdout.splitlines() if line.startswith("|") and "---" not in line]
    assert header.split("|")[-2].strip() == "client CPU ms/1k tok", header
    cells = [cell.strip() for cell in rows[0].split("|")[1:-1]]
    assert cells[:3] == ["uniform", "2", "4"], rows
    assert all(cell not in ("", "-") for cell in cells), rows  # offline, the stack's CPU and the client's all measured


def test_the_url_mode_measures_the_cpu_of_the_stack_listening_there(tiny_llama, tmp_path):
    """``--url`` printed ``-`` in the CPU columns the docs call the stable measure (issue 54): it now finds the
    stack by the process listening on the URL's port, and reads its processes' CPU as for a stack it started."""
    from tests.run_stack import start_run  # noqa: PLC0415

    stack = start_run(tiny_llama, tmp_path / "run", engines=1)
    try:
        result = run_script("serving.py", "--url", stack.url, "--model", tiny_llama,
                            # 1,024 tokens (4,096 before): still enough CPU in the server and the engine, the two
                            # processes asserted on, for their clock ticks (10 ms) to count
                            "--no-offline", "--concurrency", "8", "--requests", "64", "--lengths", "uniform",
                            "--output-tokens", "16", "--prompt-tokens", "8")
    finally:
        stack.kill()
    assert result.returncode == 0, result.stderr[-3000:]
    header, *rows = [line for line in result.stdout.splitlines() if line.startswith("|") and "---" not in line]
    columns = [cell.strip() for cell in header.split("|")[1:-1]]
    cells = dict(zip(columns, [cell.strip() for cell in rows[0].split("|")[1:-1]]))
    server, coordinator, engines = cells["CPU ms/1k tok: server / coord. / engines"].split(" / ")
    assert float(server) > 0 and float(engines) > 0, rows  # the run process and its engine, found by the port


def test_logprobs_are_asked_for_only_when_set(serving):
    """``--logprobs`` (host_ceiling.py's sampled mode) puts the completion API's field in every request; without it the
    body is the one the earlier figures were measured with."""
    assert "logprobs" not in serving.Sampling(temperature=1.0, n=4).body()
    body = serving.Sampling(temperature=1.0, n=4, logprobs=1).body()
    assert body["logprobs"] == 1 and body["n"] == 4
    assert serving.Sampling(logprobs=0).describe() == "greedy, logprobs 0"
