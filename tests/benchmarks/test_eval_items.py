"""The lm-eval items kept in ``benchmarks/evals`` are what ``make_items.py`` writes (a hand edit, or a change of
its tables without writing them again, would make the figures in docs/benchmarks.md stale), and every
multiple-choice item has one right choice among distinct ones."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import load_script

EVALS = Path(__file__).resolve().parents[2] / "benchmarks" / "evals"


def make_items():
    return load_script("make_items", EVALS / "make_items.py")


def test_the_kept_items_are_what_the_generator_writes():
    rendered = make_items().render()
    assert {name: (EVALS / name).read_text() for name in rendered} == rendered


def test_every_choice_item_has_four_distinct_choices_and_one_answer():
    items = [json.loads(line) for line in (EVALS / "facts_mc.jsonl").read_text().splitlines()]
    assert len(items) >= 200
    assert all(len(set(item["choices"])) == 4 and 0 <= item["answer"] < 4 for item in items)
