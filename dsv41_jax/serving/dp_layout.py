"""Rank-major launches of data-parallel attention (issue 46; /work/coord/DP_CONTRACT.md): the host side.

With ``--dp-size D`` every host-chosen index lives in its rank's block (`model.cache.rank_slots`,
`scratch_slot`, `rank_pages`; ids are global). A launch has ``B = D · B_r`` rows, rank-major: rows
``[r·B_r, (r+1)·B_r)`` are rank r's and point only at rank r's slots and pages; a rank with fewer rows
pads with rows at its own scratch slot and null page (`pad_row`). This module holds the rank of an id
and the padding of each rank; the launch's batch arrays are packed by the model's `decode.pack_rows`,
which lays out (and checks) rank-major batches itself — one place packs them.
"""

from __future__ import annotations

import numpy as np

from dsv41_jax.model import cache as kvc
from dsv41_jax.serving.messages import Row

__all__ = ["pad_pages", "pad_row", "pad_slots", "rank_of_row", "rank_of_slot"]


def rank_of_slot(ccfg: kvc.CacheConfig, slot: int) -> int:
    """The dp rank whose block holds slot ``slot`` (its scratch row included)."""
    return slot // (ccfg.max_slots // ccfg.dp + 1)


def rank_of_row(num_rows: int, dp: int, row: int) -> int:
    """The dp rank whose block of a ``num_rows``-row snapshot pool holds row ``row``."""
    return row // (num_rows // dp)


def pad_row(ccfg: kvc.CacheConfig, r: int) -> Row:
    """A padding row of rank r: no tokens (n = 0: nothing written or sampled), its scratch slot, its
    null page. The output processor skips it (its sample is None)."""
    return Row("", -1, kvc.scratch_slot(ccfg, r), 0, 0, (), False, False, 0, (kvc.rank_pages(ccfg, r)[0],), 0)


def pad_slots(ccfg: kvc.CacheConfig, B: int) -> np.ndarray:
    """int32 [B]: the scratch slot of each row's rank (rank-major; D = 1: all ``max_slots``)."""
    per = B // ccfg.dp
    return np.asarray([kvc.scratch_slot(ccfg, b // per) for b in range(B)], np.int32)


def pad_pages(ccfg: kvc.CacheConfig, B: int) -> np.ndarray:
    """int32 [B, max_pages_per_seq]: each row's rank's null page (rank-major; D = 1: zeros)."""
    per = B // ccfg.dp
    null = np.asarray([kvc.rank_pages(ccfg, b // per)[0] for b in range(B)], np.int32)
    return np.repeat(null[:, None], ccfg.max_pages_per_seq, axis=1)
