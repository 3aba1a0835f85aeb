"""Rank-major launches of data-parallel attention (issue 46; /work/coord/DP_CONTRACT.md): the host side.

With ``--dp-size D`` every host-chosen index lives in its rank's block (`model.cache.rank_slots`,
`scratch_slot`, `rank_pages`; ids are global). A launch has ``B = D · B_r`` rows, rank-major: rows
``[r·B_r, (r+1)·B_r)`` are rank r's and point only at rank r's slots and pages; a rank with fewer rows
pads with rows at its own scratch slot and null page (`pad_row`). This module holds a snapshot row's rank
and a rank's padding row (slots' ranks and padded batch ids: `model.cache`); the launch's batch arrays are packed by the model's `decode.pack_rows`,
which lays out (and checks) rank-major batches itself — one place packs them.
"""

from __future__ import annotations

from dsv41_jax.model import cache as kvc
from dsv41_jax.serving.messages import Row

__all__ = ["pad_row", "rank_of_row"]


def rank_of_row(num_rows: int, dp: int, row: int) -> int:
    """The dp rank whose block of a ``num_rows``-row snapshot pool holds row ``row``."""
    return row // (num_rows // dp)


def pad_row(ccfg: kvc.CacheConfig, r: int) -> Row:
    """A padding row of rank r: no tokens (n = 0: nothing written or sampled), its scratch slot, its
    null page. The output processor skips it (its sample is None)."""
    return Row("", -1, kvc.scratch_slot(ccfg, r), 0, 0, (), False, False, 0, (kvc.rank_pages(ccfg, r)[0],), 0)
