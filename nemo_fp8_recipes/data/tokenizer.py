"""Byte-level tokenizer: every UTF-8 byte is a token, plus a few special tokens.

No vocabulary file, no download, lossless on any text, and the same on every machine — what the
embedded trainer needs to run anywhere. Ids ``0..255`` are the bytes; ``256`` is EOS (appended
to every document when packing), ``257`` BOS and ``258`` PAD (reserved). A model's
``vocab_size`` may be larger (e.g. 512, a multiple of 128 keeps the output head GEMM aligned);
the extra rows are simply never targeted.
"""

from __future__ import annotations

from typing import Iterable, List, Union

import numpy as np

__all__ = ["ByteTokenizer"]


class ByteTokenizer:
    """UTF-8 bytes as token ids, with EOS/BOS/PAD after the 256 byte values."""

    #: Bumped whenever the mapping changes; part of the token-cache key.
    VERSION = 1
    EOS = 256
    BOS = 257
    PAD = 258

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can emit (256 bytes + 3 specials)."""
        return 259

    @property
    def name(self) -> str:
        """Identifier recorded in caches and checkpoints."""
        return f"byte-v{self.VERSION}"

    def token_dtype(self) -> np.dtype:
        """Smallest unsigned dtype that holds every id (uint16)."""
        return np.dtype(np.uint16)

    def encode(self, text: Union[str, bytes], *, eos: bool = False) -> np.ndarray:
        """Token ids of ``text`` (``str`` is UTF-8 encoded) as a uint16 array; ``eos`` appends EOS."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = np.frombuffer(data, dtype=np.uint8).astype(self.token_dtype())
        if eos:
            ids = np.append(ids, np.array([self.EOS], dtype=self.token_dtype()))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: bytes decoded as UTF-8 (invalid sequences replaced), EOS shown as a
        newline, other specials and out-of-range ids dropped."""
        out: List[int] = []
        for i in ids:
            i = int(i)
            if i < 256:
                out.append(i)
            elif i == self.EOS:
                out.append(0x0A)
        return bytes(out).decode("utf-8", errors="replace")
