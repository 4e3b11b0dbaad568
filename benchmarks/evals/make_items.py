"""Writes the evaluation items kept beside it (``facts_mc.jsonl``, ``facts_gen.jsonl``) from the small tables
below, so that the lm-eval comparison needs no data set download and anyone can see where every item came from.
Deterministic (a fixed seed draws the distractors): running it again writes the same bytes, which a test checks.

    python benchmarks/evals/make_items.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 60

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo", "Greece": "Athens",
    "Canada": "Ottawa", "Australia": "Canberra", "Ireland": "Dublin", "Norway": "Oslo", "Sweden": "Stockholm",
    "Finland": "Helsinki", "Denmark": "Copenhagen", "Poland": "Warsaw", "Austria": "Vienna", "Hungary": "Budapest",
    "Kenya": "Nairobi", "Peru": "Lima", "Argentina": "Buenos Aires", "Mexico": "Mexico City", "India": "New Delhi",
    "Thailand": "Bangkok", "Turkey": "Ankara", "Cuba": "Havana", "Belgium": "Brussels", "Netherlands": "Amsterdam",
}
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "up": "down", "day": "night", "happy": "sad", "light": "dark",
    "open": "closed", "old": "young", "early": "late", "full": "empty", "hard": "soft", "high": "low",
    "left": "right", "wet": "dry", "strong": "weak", "rich": "poor", "loud": "quiet", "long": "short",
    "thick": "thin", "near": "far", "inside": "outside", "first": "last", "win": "lose", "push": "pull",
}
ANIMAL_SOUNDS = {"dog": "bark", "cat": "meow", "cow": "moo", "duck": "quack", "sheep": "baa", "lion": "roar",
                 "horse": "neigh", "pig": "oink", "owl": "hoot", "snake": "hiss", "bee": "buzz", "frog": "croak"}
COLOURS = {"the sky on a clear day": "blue", "grass": "green", "snow": "white", "a ripe banana": "yellow",
           "coal": "black", "a ripe tomato": "red", "an orange": "orange", "a lemon": "yellow",
           "milk": "white", "a fire truck": "red", "a leaf in summer": "green", "the night sky": "black"}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]


def choice_item(rng: random.Random, question: str, answer: str, pool: list[str]) -> dict:
    """A four-way multiple-choice item: the answer among three others drawn from ``pool``, in a drawn order."""
    choices = rng.sample(sorted(set(pool) - {answer}), 3) + [answer]
    rng.shuffle(choices)
    return {"question": question, "choices": choices, "answer": choices.index(answer)}


def distinct_pairs(rng: random.Random, low: int, high: int, count: int) -> list[tuple[int, int]]:
    """``count`` ordered pairs of numbers from ``low`` to ``high``, drawn without replacement: a pair drawn twice
    would ask one question twice and count it twice in the score."""
    numbers = range(low, high + 1)
    return rng.sample([(a, b) for a in numbers for b in numbers], count)


def multiple_choice(rng: random.Random) -> list[dict]:
    items = []
    for country, city in CAPITALS.items():
        items.append(choice_item(rng, f"What is the capital of {country}?", city, list(CAPITALS.values())))
    for city, country in ((c, k) for k, c in CAPITALS.items()):
        items.append(choice_item(rng, f"{city} is the capital of which country?", country, list(CAPITALS)))
    words = sorted(set(OPPOSITES) | set(OPPOSITES.values()))
    for word, opposite in OPPOSITES.items():
        items.append(choice_item(rng, f"What is the opposite of \"{word}\"?", opposite, words))
        items.append(choice_item(rng, f"What is the opposite of \"{opposite}\"?", word, words))
    for animal, sound in ANIMAL_SOUNDS.items():
        items.append(choice_item(rng, f"What sound does a {animal} make?", sound, list(ANIMAL_SOUNDS.values())))
    for thing, colour in COLOURS.items():
        items.append(choice_item(rng, f"What colour is {thing}?", colour, list(COLOURS.values())))
    for i, day in enumerate(DAYS):
        items.append(choice_item(rng, f"Which day comes after {day}?", DAYS[(i + 1) % 7], DAYS))
        items.append(choice_item(rng, f"Which day comes before {day}?", DAYS[i - 1], DAYS))
    for a, b in distinct_pairs(rng, 0, 10, 60):
        items.append(choice_item(rng, f"What is {a} plus {b}?", NUMBER_WORDS[a + b], NUMBER_WORDS))
    for n in range(1, 20):
        items.append(choice_item(rng, f"Which number comes after {NUMBER_WORDS[n]}?", NUMBER_WORDS[n + 1],
                                 NUMBER_WORDS))
    return items


def generation(rng: random.Random) -> list[dict]:
    """Questions with a one-word (or one-number) answer, checked by exact match."""
    items = [{"question": f"What is the capital of {country}? Answer with the city's name only.", "answer": city}
             for country, city in CAPITALS.items()]
    items += [{"question": f"What is the opposite of \"{word}\"? Answer with one word.", "answer": opposite}
              for word, opposite in OPPOSITES.items()]
    items += [{"question": f"Which day comes after {day}? Answer with one word.", "answer": DAYS[(i + 1) % 7]}
              for i, day in enumerate(DAYS)]
    for a, b in distinct_pairs(rng, 1, 20, 40):
        items.append({"question": f"What is {a} + {b}? Answer with the number only.", "answer": str(a + b)})
    return items


def render() -> dict[str, str]:
    """Each file's name and text: the multiple-choice items, then the generation items, from one seeded draw."""
    rng = random.Random(SEED)
    tasks = {"facts_mc.jsonl": multiple_choice(rng), "facts_gen.jsonl": generation(rng)}
    return {name: "".join(json.dumps(item) + "\n" for item in items) for name, items in tasks.items()}


def main() -> None:
    for name, text in render().items():
        (HERE / name).write_text(text)


if __name__ == "__main__":
    main()
