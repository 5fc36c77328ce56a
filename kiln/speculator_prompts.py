"""More chat prompts for draft heads' training replies, made from templates and subjects.

The heads learn what the model itself says, so the corpus' size is the number of replies; the
192 hand-written prompts (kiln/data/speculator_prompts.txt) give ~45k tokens, on which eagle heads
guess a third of the model's tokens on held-out replies and fit their training replies twice as
well (docs/generation.md). `kiln train-speculator --prompts N` asks for N prompts: the bundled ones
first, then these, in a fixed order (so a corpus cached for N is found again). Prose requests about
everyday subjects and small programming tasks, about one in six of them code, as the bundled ones.
"""

from __future__ import annotations

import random

PROSE = (
    "Write a short story about {}.",
    "Explain how {} works.",
    "Describe {} to someone who has never seen it.",
    "Give me three interesting facts about {}.",
    "What are the pros and cons of {}?",
    "Write a poem about {}.",
    "Summarize the history of {} in a few sentences.",
    "Write a short blog post about {}.",
    "Explain {} to a ten-year-old.",
    "List five tips related to {}.",
    "Write a dialogue between two friends about {}.",
    "Why is {} important?",
)

SUBJECTS = (
    "the moon", "volcanoes", "honey bees", "a lighthouse", "coffee", "the printing press", "rainbows",
    "electric cars", "a city park", "the human heart", "glaciers", "chess", "the piano", "solar panels",
    "baking bread", "trains", "penguins", "the Roman Empire", "clouds", "a public library", "recycling",
    "earthquakes", "the immune system", "gardening", "a thunderstorm", "bicycles", "the ocean", "owls",
    "maps", "batteries", "a farmers market", "kites", "the stock market", "sleep", "dinosaurs",
    "the Olympic Games", "coral reefs", "a helpful robot", "snow", "the internet", "wind turbines",
    "cheese", "a haunted house", "time zones", "music", "friendship", "the desert", "airplanes",
    "a rainforest", "the brain", "photography", "running a marathon", "tea", "the telescope", "bridges",
    "a space station", "compost", "elephants", "a small bakery", "the seasons", "memory", "lightning",
    "a museum", "submarines", "mushrooms", "the alphabet", "a medieval castle", "bird migration",
    "clocks", "soap", "the compass", "rivers", "a school garden", "vaccines", "the violin",
    "traffic lights", "a lost key", "yoga", "the Great Wall of China", "hot air balloons", "a dragon",
    "a clever fox", "the post office", "ice cream", "autumn", "camping", "an old map",
    "the solar system", "wolves", "a train station", "origami", "a snowstorm", "the first day of school",
    "a city at night", "a volcanic island", "learning a new language", "saving money",
    "a birthday party", "the water cycle", "democracy", "video games",
)  # fmt: skip

CODE = (
    "Write a Python function that {}.",
    "Write a JavaScript function that {}.",
    "Write a unit test in Python for a function that {}.",
    "Write a C function that {}.",
    "Explain step by step how to write a Python function that {}.",
)

TASKS = (
    "reverses a list", "counts the vowels in a string", "checks whether a number is prime",
    "merges two sorted lists", "removes duplicates from a list while keeping the order",
    "returns the n-th Fibonacci number", "converts Celsius to Fahrenheit",
    "finds the longest word in a sentence", "flattens a nested list", "counts word frequencies in a text",
    "checks whether an email address looks valid", "computes the factorial of a number",
    "sorts a list of dictionaries by a key", "reads a JSON file and returns its contents",
    "checks whether two strings are anagrams", "returns the largest number in a list without using max",
    "transposes a matrix", "computes the average of a list of numbers",
    "capitalizes the first letter of each word", "finds the second largest number in a list",
    "checks whether the parentheses in a string are balanced", "converts a binary string to an integer",
    "groups words by their first letter", "returns the digits of a number", "implements binary search",
    "rotates a list by k positions", "computes the greatest common divisor of two numbers",
    "removes the whitespace from a string", "counts the lines in a file",
    "finds the common elements of two lists", "splits a list into chunks of size n",
    "checks whether a year is a leap year", "computes the sum of the squares of a list",
    "returns the unique characters of a string", "implements a stack with push and pop",
    "computes the distance between two points", "sums the even numbers of a list",
)  # fmt: skip

CODE_EVERY = 6  # one prompt in this many is a programming task


def generated_prompts(seed: int = 0) -> list[str]:
    """Every template with every subject (prose) or task (code), shuffled once with `seed` and
    interleaved so that every CODE_EVERY-th prompt is code while both last."""
    rng = random.Random(seed)
    prose = [t.format(s) for t in PROSE for s in SUBJECTS]
    code = [t.format(s) for t in CODE for s in TASKS]
    rng.shuffle(prose)
    rng.shuffle(code)
    out = []
    while prose or code:
        take_code = code and (not prose or len(out) % CODE_EVERY == CODE_EVERY - 1)
        out.append((code if take_code else prose).pop())
    return out


def every_prompt(bundled: list[str]) -> list[str]:
    """The bundled prompts, then the generated ones not among them: what `--prompts N` cuts from."""
    seen = set(bundled)
    return bundled + [p for p in generated_prompts() if p not in seen]


def most_prompts() -> int:
    """How many prompts `prompts_for` can give."""
    from kiln.speculator_data import read_prompts

    return len(every_prompt(read_prompts()))


def prompts_for(count: int, bundled: list[str]) -> list[str]:
    """The first `count` prompts: the bundled ones first, then generated ones."""
    return every_prompt(bundled)[:count]
