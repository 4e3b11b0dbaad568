"""The lm-eval items kept in ``benchmarks/evals`` are what ``make_items.py`` writes (a hand edit, or a change of
its tables without writing them again, would make the figures in docs/benchmarks.md stale), and every
multiple-choice item has one right choice among distinct ones; no task asks one question twice (a repeat would
count twice in its score)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import load_script

EVALS = Path(__file__).resolve().parents[2] / "benchmarks" / "evals"


def make_items():
    return load_script("make_items", EVALS / "make_items.py")


def test_the_kept_items_are_what_the_generator_writes():
    rendered = make_items().render()
    assert {name: (EVALS / name).read_text() for name in rendered} == rendered


def kept_items(name: str) -> list[dict]:
    return [json.loads(line) for line in (EVALS / name).read_text().splitlines()]


@pytest.mark.parametrize("name", ["facts_mc.jsonl", "facts_gen.jsonl"])
def test_no_question_repeats_in_a_task(name):
    questions = [item["question"] for item in kept_items(name)]
    assert len(questions) >= 100
    assert len(set(questions)) == len(questions)


def test_every_choice_item_has_four_distinct_choices_and_one_answer():
    items = kept_items("facts_mc.jsonl")
    assert len(items) >= 200
    assert all(len(set(item["choices"])) == 4 and 0 <= item["answer"] < 4 for item in items)
