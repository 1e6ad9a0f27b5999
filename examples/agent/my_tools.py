"""Example function tools: plain Python functions whose keyword arguments are the schema's parameters.

`tools_example.yaml` beside this file names them as ``function: my_tools.py:word_count``. A function
returns the text the model sees (anything else is sent as JSON); it may be sync (run in a thread) or
async. What it raises reaches the model as ``Error: <Type>: <message>``.
"""

import asyncio


def word_count(text: str) -> int:
    """How many words `text` has (split on white space)."""
    return len(text.split())


async def letter_count(word: str, letter: str, case_sensitive: bool = False) -> str:
    """How many times `letter` occurs in `word` (the model's classic blind spot: the r's in strawberry)."""
    await asyncio.sleep(0)  # an async tool would await its I/O here
    if len(letter) != 1:
        raise ValueError(f"letter must be one character, got {letter!r}")
    if not case_sensitive:
        word, letter = word.lower(), letter.lower()
    return f"{word.count(letter)}"
