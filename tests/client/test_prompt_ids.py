"""What a SUBMIT carries for a prompt of token ids (``client/prompts.prompt_for_fleet``): a copy of plain ints,
whatever kind of ints the caller gave (checked in C when they are Python's own, else each turned into one)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_serve.client.prompts import prompt_for_fleet


@pytest.mark.parametrize("prompt", [[5, 6, 7], (5, 6, 7), np.array([5, 6, 7]), [np.int64(5), 6, 7], [5.0, 6, True + 6]],
                         ids=["list", "tuple", "numpy", "numpy-items", "floats-and-bools"])
def test_token_ids_go_as_a_copy_of_plain_ints(prompt):
    tokens, images = prompt_for_fleet(prompt, [], None)
    assert tokens == [5, 6, 7] and images == []
    assert all(type(token) is int for token in tokens)
    assert tokens is not prompt


def test_an_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="prompt is empty"):
        prompt_for_fleet([], [], None)
