"""Sequence packing and a stateless, resumable batch order.

The token stream (documents separated by EOS) is cut into non-overlapping windows of
``seq_len + 1`` tokens (inputs = the first ``seq_len``, targets = the last ``seq_len``), so
documents are packed back to back and no token is padding. The window used for sample ``g`` of
the run (``g = (step · grad_accum + micro) · micro_batch + i``) is a pure function of
``(seed, g)``: epoch ``g // n`` visits a seeded permutation of the ``n`` windows. Resuming at
step ``s`` therefore needs no iterator state beyond ``s`` itself, and any step's batch can be
recomputed — which is what makes resume exact.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Tuple

import numpy as np
import torch

from .corpus import DataError

__all__ = ["PackedTokens", "TrainBatches", "ValBatches"]

_FULL_PERMUTATION_MAX = 1 << 26  # beyond this many windows, use an affine permutation (no memory)


class PackedTokens:
    """Non-overlapping ``seq_len + 1`` windows over a flat token array (``np.memmap`` is fine)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, split: str = "train") -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.split = split
        self.num_windows = max(0, (len(tokens) - 1) // self.seq_len)

    def __len__(self) -> int:
        return self.num_windows

    def window(self, i: int) -> np.ndarray:
        """Tokens of window ``i`` (``seq_len + 1`` of them)."""
        start = int(i) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1])

    def batch(self, indices: List[int], device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` int64 tensors ``[len(indices), seq_len]`` on ``device``."""
        arr = np.stack([self.window(i) for i in indices]).astype(np.int64)
        t = torch.from_numpy(arr)
        if device.type == "cuda":
            t = t.pin_memory().to(device, non_blocking=True)
        else:
            t = t.to(device)
        return t[:, :-1], t[:, 1:]


class TrainBatches:
    """Training micro-batches as a pure function of ``(seed, step, micro)``.

    ``get(step, micro)`` returns micro-batch ``micro`` (of ``grad_accum``) of optimizer step
    ``step`` (0-based). Epochs are seeded permutations of the windows; there is no hidden
    iterator state to checkpoint.
    """

    def __init__(self, packed: PackedTokens, *, seed: int, micro_batch_size: int, grad_accum: int) -> None:
        if len(packed) == 0:
            raise DataError(
                f"the {packed.split} split has {len(packed.tokens)} tokens, fewer than one sequence "
                f"of seq_len + 1 = {packed.seq_len + 1}; add text (data.paths / data.max_files / "
                "data.max_bytes) or lower trainer.seq_len"
            )
        self.packed = packed
        self.seed = int(seed)
        self.micro_batch_size = int(micro_batch_size)
        self.grad_accum = int(grad_accum)
        self._perms: "OrderedDict[int, object]" = OrderedDict()

    @property
    def samples_per_step(self) -> int:
        """Sequences consumed per optimizer step (the global batch)."""
        return self.micro_batch_size * self.grad_accum

    def epoch_of(self, step: int) -> float:
        """Fractional epoch reached at the start of ``step``."""
        return step * self.samples_per_step / len(self.packed)

    def _perm(self, epoch: int):
        if epoch in self._perms:
            self._perms.move_to_end(epoch)
            return self._perms[epoch]
        n = len(self.packed)
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
        if n <= _FULL_PERMUTATION_MAX:
            perm = rng.permutation(n)
        else:  # i -> (a·i + b) mod n with gcd(a, n) = 1: a bijection that needs no memory
            while True:
                a = int(rng.integers(1, n))
                if np.gcd(a, n) == 1:
                    break
            perm = (a, int(rng.integers(0, n)))
        self._perms[epoch] = perm
        if len(self._perms) > 2:
            self._perms.popitem(last=False)
        return perm

    def sample_index(self, g: int) -> int:
        """Window index of global sample ``g``."""
        n = len(self.packed)
        epoch, r = divmod(int(g), n)
        perm = self._perm(epoch)
        if isinstance(perm, tuple):
            a, b = perm
            return (a * r + b) % n
        return int(perm[r])

    def indices(self, step: int, micro: int) -> List[int]:
        """Window indices of micro-batch ``micro`` of step ``step``."""
        if not 0 <= micro < self.grad_accum:
            raise IndexError(f"micro {micro} out of range [0, {self.grad_accum})")
        g0 = (int(step) * self.grad_accum + micro) * self.micro_batch_size
        return [self.sample_index(g) for g in range(g0, g0 + self.micro_batch_size)]

    def get(self, step: int, micro: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of micro-batch ``micro`` of step ``step`` on ``device``."""
        return self.packed.batch(self.indices(step, micro), device)


class ValBatches:
    """A fixed validation set: ``num_batches`` micro-batches of windows spread evenly over the
    validation stream (the same windows at every evaluation and on every resume)."""

    def __init__(self, packed: PackedTokens, *, micro_batch_size: int, num_batches: int) -> None:
        if len(packed) == 0:
            raise DataError(
                f"the validation split has {len(packed.tokens)} tokens, fewer than one sequence of "
                f"seq_len + 1 = {packed.seq_len + 1}; raise data.val_fraction, add text, lower "
                "trainer.seq_len, or disable validation with trainer.val_interval=0"
            )
        self.packed = packed
        want = max(1, int(micro_batch_size) * int(num_batches))
        n = len(packed)
        count = min(want, n)
        idx = np.unique(np.linspace(0, n - 1, count).round().astype(np.int64))
        self.batches = [idx[i : i + micro_batch_size].tolist() for i in range(0, len(idx), micro_batch_size)]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        raise TypeError("use ValBatches.iter(device)")

    def iter(self, device: torch.device):
        """Yield ``(inputs, targets)`` for every validation micro-batch."""
        for b in self.batches:
            yield self.packed.batch(b, device)
