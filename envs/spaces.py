"""A Gymnasium text space that admits any Unicode string up to a length bound.

Its characters are all of Unicode, indexed by code point, so Gymnasium's flattening and the shared memory of
``gym.make_vec(..., vectorization_mode="async")`` (a Text space's characters as int32 indexes into its character set)
carry any text an env returns: the index of a character is ``ord(c)``, and ``0x110000`` (one past the last code point)
pads a string shorter than ``max_length``. Gymnasium reads a Text space's shared memory once, when the vector env is
built, into immutable strings; this space's reader returns a view that decodes the buffer when it is read or copied,
so each reset and step returns what the workers wrote.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.spaces.utils import flatten, unflatten
from gymnasium.vector.utils import read_from_shared_memory, write_to_shared_memory

# Sampling draws from ASCII letters, protocol punctuation and a few non-ASCII letters, so random actions
# exercise the parser; `contains` itself accepts every Unicode string.
_SAMPLE_CHARSET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 <>/._-éüßøçñ中文日本語한국어"

CODE_POINTS = 0x110000
"""Unicode's code points: U+0000 to U+10FFFF."""


class _AllCharacters:
    """Every Unicode character, as a Text space's character set and list: a character's index is its code point."""

    def __len__(self) -> int:
        return CODE_POINTS

    def __contains__(self, char: object) -> bool:
        return isinstance(char, str) and len(char) == 1

    def __getitem__(self, index: Any) -> str:
        return chr(int(index))

    def __iter__(self) -> Iterator[str]:
        return (chr(i) for i in range(CODE_POINTS))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _AllCharacters)

    def __hash__(self) -> int:
        return hash(_AllCharacters)


_ALL = _AllCharacters()


class UnicodeText(spaces.Text):
    """`gymnasium.spaces.Text` whose characters are all of Unicode: it admits any `str` of at most `max_length`.

    The stock Text space only admits characters of its charset; model outputs and Wikipedia passages hold any
    Unicode. `character_set`, `character_list` and `character_index` speak of every character (by code point), so
    Gymnasium's `flatten`/`unflatten` and the async vector env's shared memory carry any text; `sample` draws from a
    small charset of letters and protocol punctuation (`characters`), so random actions exercise the parser.
    """

    def __init__(self, max_length: int, seed: int | None = None) -> None:
        super().__init__(max_length=max_length, min_length=0, charset=_SAMPLE_CHARSET, seed=seed)
        self._sample_list = np.array(list(_SAMPLE_CHARSET))

    @property
    def character_set(self) -> Any:  # every character: `len` is the number of code points
        return _ALL

    @property
    def character_list(self) -> Any:  # indexed by code point
        return _ALL

    def character_index(self, char: str) -> np.int32:
        return np.int32(ord(char))

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        """A random string of the sample charset (`characters`), of a random length up to `max_length`, or of the
        length the first item of `mask` or `probability` gives; a per-character mask is not supported (it would
        span every code point)."""
        given = mask if mask is not None else probability
        if given is not None and given[1] is not None:
            raise ValueError("UnicodeText samples from its own charset: give a length only, as (length, None)")
        length = given[0] if given is not None and given[0] is not None else None
        if length is None:
            length = int(self.np_random.integers(self.min_length, self.max_length + 1))
        return "".join(self.np_random.choice(self._sample_list, size=length))

    def __repr__(self) -> str:
        return f"UnicodeText(max_length={self.max_length})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, UnicodeText) and other.max_length == self.max_length

    def __hash__(self) -> int:
        # equal spaces (same class and max_length) must hash alike, so spaces can key dicts and sets
        return hash((UnicodeText, self.max_length))


def _codes(space: UnicodeText, text: str) -> np.ndarray:
    """`text` as `max_length` int32 code points, padded with `CODE_POINTS` (Gymnasium's flat form of a Text)."""
    if len(text) > space.max_length:
        raise ValueError(f"a string of {len(text)} characters is longer than {space!r} admits")
    codes = np.full(space.max_length, CODE_POINTS, dtype=np.int32)
    codes[: len(text)] = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    return codes


def _text(codes: np.ndarray) -> str:
    """The string of `max_length` code points padded with `CODE_POINTS`."""
    end = np.flatnonzero(codes >= CODE_POINTS)
    used = codes[: end[0] if end.size else len(codes)]
    return used.astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")


@flatten.register(UnicodeText)
def _flatten_unicode(space: UnicodeText, x: str) -> np.ndarray:
    return _codes(space, x)


@unflatten.register(UnicodeText)
def _unflatten_unicode(space: UnicodeText, x: np.ndarray) -> str:
    return _text(np.asarray(x))


class SharedTexts(Sequence[str]):
    """The strings of a vector env's shared observation buffer, decoded when read: what `read_from_shared_memory`
    gives for a `UnicodeText` (Gymnasium reads the buffer once, when the vector env is built). A copy of it (the
    vector env returns ``deepcopy(observations)`` unless ``copy=False``) is a tuple of the strings at that moment."""

    def __init__(self, space: UnicodeText, shared_memory: Any, n: int) -> None:
        self._codes = np.frombuffer(shared_memory.get_obj(), dtype=np.int32).reshape((n, space.max_length))

    def __len__(self) -> int:
        return self._codes.shape[0]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self)[index]
        return _text(self._codes[index])

    def __deepcopy__(self, memo: dict) -> tuple[str, ...]:
        return tuple(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __repr__(self) -> str:
        return repr(tuple(self))


@read_from_shared_memory.register(UnicodeText)
def _read_unicode(space: UnicodeText, shared_memory: Any, n: int = 1) -> SharedTexts:
    return SharedTexts(space, shared_memory, n)


@write_to_shared_memory.register(UnicodeText)
def _write_unicode(space: UnicodeText, index: int, values: str, shared_memory: Any) -> None:
    destination = np.frombuffer(shared_memory.get_obj(), dtype=np.int32)
    destination[index * space.max_length : (index + 1) * space.max_length] = _codes(space, values)
