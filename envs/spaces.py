"""A Gymnasium text space that admits any Unicode string up to a length bound."""

from __future__ import annotations

from typing import Any

from gymnasium import spaces

# Sampling draws from ASCII letters, protocol punctuation and a few non-ASCII letters, so random actions
# exercise the parser; `contains` itself accepts every Unicode string.
_SAMPLE_CHARSET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 <>/._-éüßøçñ中文日本語한국어"


class UnicodeText(spaces.Text):
    """`gymnasium.spaces.Text` whose `contains` admits any `str` of at most `max_length` characters.

    The stock Text space only admits characters of its charset; model outputs and Wikipedia passages
    hold any Unicode, so membership here checks type and length only.
    """

    def __init__(self, max_length: int, seed: int | None = None) -> None:
        super().__init__(max_length=max_length, min_length=0, charset=_SAMPLE_CHARSET, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"UnicodeText(max_length={self.max_length})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, UnicodeText) and other.max_length == self.max_length

    def __hash__(self) -> int:
        # equal spaces (same class and max_length) must hash alike, so spaces can key dicts and sets
        return hash((UnicodeText, self.max_length))
