"""Direct mode's engine thread when a step raises: every caller waiting on it gets the error, none waits forever."""

from __future__ import annotations

import pytest

from megatron_serve import MegatronLLM, SamplingParams
from megatron_serve.engine.sequence import Sequence

pytestmark = pytest.mark.timeout(120)  # the bug was a hang: a caller waiting forever fails here instead


def test_a_final_record_that_cannot_be_built_fails_its_request_and_the_engine_serves_on(tiny_model, monkeypatch):
    """The step that finishes a request builds its final record; when that raised, the request was no longer
    among the engine's unfinished ones, so nobody failed it and ``generate`` never returned."""
    llm = MegatronLLM(tiny_model)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    try:
        expected = llm.generate(["Hello there"], params)[0].generated_tokens
        built = Sequence.final_record

        def broken(self: Sequence):
            raise RuntimeError("the record could not be built")

        monkeypatch.setattr(Sequence, "final_record", broken)
        with pytest.raises(RuntimeError, match="engine step failed: the record could not be built"):
            llm.generate(["Hello there"], params)
        monkeypatch.setattr(Sequence, "final_record", built)
        assert llm.generate(["Hello there"], params)[0].generated_tokens == expected
    finally:
        llm.close()
