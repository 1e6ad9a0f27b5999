"""Batch-invariant matrix products: a row's result does not depend on the rows it is computed with.

A BLAS library picks its kernel, blocking and reduction order from the matrix shapes, so one sample's
logits can differ in the last bits with the number of other samples (or packed tokens) in its micro-batch.
Under `batch_invariant()` every `mm` / `addmm` runs on fixed-size tiles of `TILE_ROWS` rows (the last one
zero-padded): every call the library sees has the same shape, so each row goes through the same kernel and
the same reductions whatever its companions. Attention's products are per sequence already. The price is
the padding and the smaller calls; `trainer.deterministic=true` pays it in the actor's and the reference's
forwards (and backwards), with torch's deterministic algorithms on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TILE_ROWS", "batch_invariant"]

TILE_ROWS = 64
_aten = torch.ops.aten


def _by_tiles(rows: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`product(rows)`, computed tile by tile on `TILE_ROWS`-row blocks of `rows`."""
    count = rows.shape[0]
    pad = -count % TILE_ROWS
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])])
    return torch.cat([product(tile) for tile in rows.split(TILE_ROWS)])[:count]


class _TiledMatmul(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten.mm.default:
            left, right = args
            return _by_tiles(left, lambda tile: _aten.mm.default(tile, right))
        if func is _aten.addmm.default:
            bias, left, right = args
            if bias.dim() == 2 and bias.shape[0] != 1:  # a per-row bias would need tiling too: not in a linear
                return func(*args, **kwargs)
            return _by_tiles(left, lambda tile: _aten.addmm.default(bias, tile, right, **kwargs))
        return func(*args, **kwargs)


@contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Tiled matrix products and torch's deterministic algorithms for the duration (nothing when not
    `enabled`); the caller's deterministic setting is restored."""
    if not enabled:
        yield
        return
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with _TiledMatmul():
            yield
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
