"""Rank-major launches of data-parallel attention (issue 46; /work/coord/DP_CONTRACT.md): the host side.

With ``--dp-size D`` every host-chosen index lives in its rank's block (`model.cache.rank_slots`,
`scratch_slot`, `rank_pages`; ids are global). A launch has ``B = D · B_r`` rows, rank-major: rows
``[r·B_r, (r+1)·B_r)`` are rank r's and point only at rank r's slots and pages; a rank with fewer rows
pads with rows at its own scratch slot and null page (`pad_row`). This module packs such a launch into
the step's batch arrays without recomputing the layout: each rank's rows are packed by the model's
`decode.pack_rows` in rank-local ids (its scratch = its local ``max_slots``, its null page = local 0),
then moved to the rank's block. With D = 1 it is `decode.pack_rows` itself (today's batch, bit for bit).
"""

from __future__ import annotations

import numpy as np

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import decode as dec
from dsv41_jax.serving.messages import Row

__all__ = ["pack_launch", "pad_pages", "pad_row", "pad_slots", "rank_of_row", "rank_of_slot"]


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


def _local(ccfg: kvc.CacheConfig) -> kvc.CacheConfig:
    """One rank's view of the cache: its slots and pages as a single-rank layout."""
    return ccfg.replace(max_slots=ccfg.max_slots // ccfg.dp, num_pages=ccfg.num_pages // ccfg.dp, dp=1)


def pack_launch(rows: list, T: int, B: int, ccfg: kvc.CacheConfig) -> dict:
    """The step's batch (`decode.pack_rows`'s dict of numpy arrays) for a launch's rows (`decode.pack_rows`'s
    row dicts). D = 1: rows in
    order, padded to B. D > 1: ``rows`` are the launch's B rank-major rows (padding rows included, as the
    DP controller makes them); each rank's B / D rows must lie in its own block (ValueError otherwise)."""
    D = ccfg.dp
    if D == 1:
        return dec.pack_rows(rows, T, B, ccfg)
    if len(rows) != B or B % D:
        raise ValueError(f"a dp={D} launch needs its {B} rank-major rows given (got {len(rows)})")
    per, loc = B // D, _local(ccfg)
    parts = []
    for r in range(D):
        s0, p0 = kvc.rank_slots(ccfg, r)[0], kvc.rank_pages(ccfg, r)[0]
        mine = []
        for x in rows[r * per:(r + 1) * per]:
            pages = [p - p0 for p in x["page_table"]]
            if not 0 <= x["slot"] - s0 <= loc.max_slots or any(not 0 <= p < loc.num_pages for p in pages):
                raise ValueError(f"rank {r}'s rows must use its own slots and pages (slot {x['slot']}, "
                                 f"pages {list(x['page_table'])})")
            mine.append(dict(x, slot=x["slot"] - s0, page_table=pages))
        b = dec.pack_rows(mine, T, per, loc)
        b["slot"] = b["slot"] + np.int32(s0)
        b["page_table"] = b["page_table"] + np.int32(p0)
        parts.append(b)
    return {k: np.concatenate([b[k] for b in parts]) for k in parts[0]}
