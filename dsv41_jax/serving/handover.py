"""A request's whole state after its prefill, moved from one engine to another (prefill/decode
disaggregation), and its wire form.

A *prefill* engine runs a request with ``max_tokens=1`` and ``handover=True`` (`Engine.add_request`):
it prefills the prompt and samples the first token as usual; when the request finishes, before its
pages and slot are freed, the engine exports its cache state (`Runner.export_slot`: the slot's
per-request rows — window rings, the compressor's partial groups, Engram history, DSpark rings — and
per page its compressed latents and index keys) into a `PrefilledState`, which the final
`RequestOutput` carries. A *decode* engine takes it (``Engine.add_request(..., prefilled=state)``):
on admission it writes the state into its own slot and pages (`Runner.import_slot`, an `ImportOp`
dispatched before the plan's launches) and continues with the first token's decode step: it
prefills nothing (``imported_prompt_tokens`` counts what it received instead).

Wire form (`pack` / `unpack`): one contiguous ``uint8`` buffer (every leaf's bytes, in a fixed
order: the rows' leaves, then each page's) and a small JSON manifest (prompt and first token, seed,
logprobs, per leaf its shape and dtype, the byte count and a BLAKE2b digest of the buffer). The
buffer is what a transport (NIXL in `dsv41_jax.dynamo.transfer`) moves; the manifest travels with
the request. `unpack` checks everything against the receiving engine's own layout
(`Runner.handover_layout`): the same model, page size, numerics and speculation state give the same
leaves, and anything else — another model, a truncated or corrupted buffer, a state without the DSpark
rings a DSpark engine needs — is refused with `HandoverError` (an `EngineError`: HTTP 400 on a
server), never imported.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

import jax
import numpy as np

from dsv41_jax.serving.request import EngineError

__all__ = ["HandoverError", "PrefilledState", "check_layout", "pack", "unpack"]

WIRE_VERSION = 1


class HandoverError(EngineError):
    """A prefilled state this engine cannot take (incompatible, truncated, corrupted, or not the request's)."""


@dataclass
class PrefilledState:
    """A prefilled request's state. prompt_ids: the prompt the state covers (every token's cache
    entries are in it); first_token: the token the prefill engine sampled after it (with its logprob
    and top logprobs when the request asked for them); seed: the sampling seed the prefill engine used
    (the decode engine continues its key stream); rows: the slot's per-request rows (pytree of numpy
    arrays, `Runner.export_slot`); pages: per page ``ceil(len(prompt_ids) / page_size)`` of them, its
    pool entries (pytrees of numpy arrays)."""

    prompt_ids: list
    first_token: int
    seed: int
    rows: dict
    pages: list
    first_logprob: Optional[float] = None
    first_top: Optional[list] = None
    meta: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves((self.rows, self.pages)))


def _leaves(rows, pages) -> list:
    return jax.tree_util.tree_leaves(rows) + [x for p in pages for x in jax.tree_util.tree_leaves(p)]


def pack(state: PrefilledState) -> tuple:
    """(manifest: a JSON-able dict, buffer: uint8 [nbytes]) of ``state`` (see the module doc)."""
    leaves = [np.ascontiguousarray(np.asarray(x)) for x in _leaves(state.rows, state.pages)]
    buf = np.empty(sum(x.nbytes for x in leaves), np.uint8)
    off = 0
    for x in leaves:
        buf[off:off + x.nbytes] = x.reshape(-1).view(np.uint8)
        off += x.nbytes
    n_row_leaves = len(jax.tree_util.tree_leaves(state.rows))
    manifest = {
        "version": WIRE_VERSION, "prompt_ids": [int(t) for t in state.prompt_ids],
        "first_token": int(state.first_token), "seed": int(state.seed),
        "first_logprob": state.first_logprob,
        "first_top": [[int(t), float(v)] for t, v in state.first_top] if state.first_top is not None else None,
        "num_pages": len(state.pages),
        "leaves": [[list(x.shape), x.dtype.name] for x in leaves], "row_leaves": n_row_leaves,
        "nbytes": int(buf.nbytes), "digest": hashlib.blake2b(buf.tobytes(), digest_size=16).hexdigest(),
        **state.meta,
    }
    return manifest, buf


def unpack(manifest: dict, buf, layout: tuple) -> PrefilledState:
    """The `PrefilledState` of ``pack``'s (manifest, buffer), checked against ``layout`` (the receiving
    runner's ``(rows, page)`` structures: pytrees of ``jax.ShapeDtypeStruct``, `Runner.handover_layout`).
    Raises `HandoverError` for anything that does not match."""
    try:
        version = manifest["version"]
        prompt = [int(t) for t in manifest["prompt_ids"]]
        first = int(manifest["first_token"])
        seed = int(manifest["seed"])
        n_pages = int(manifest["num_pages"])
        described = [(tuple(s), str(d)) for s, d in manifest["leaves"]]
        nbytes, digest = int(manifest["nbytes"]), str(manifest["digest"])
        top = manifest.get("first_top")
        lp = manifest.get("first_logprob")
    except (KeyError, TypeError, ValueError) as e:
        raise HandoverError(f"prefilled state: malformed manifest ({type(e).__name__}: {e})") from None
    if version != WIRE_VERSION:
        raise HandoverError(f"prefilled state: wire version {version}, this engine reads {WIRE_VERSION}")
    rows_l, page_l = layout
    row_struct = jax.tree_util.tree_structure(rows_l)
    page_struct = jax.tree_util.tree_structure(page_l)
    specs = _specs(layout, n_pages)
    _compare(described, _described(specs))
    buf = np.asarray(buf)
    if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes != nbytes:
        raise HandoverError(f"prefilled state: {buf.nbytes} bytes received, the manifest says {nbytes} (truncated?)")
    if hashlib.blake2b(buf.tobytes(), digest_size=16).hexdigest() != digest:
        raise HandoverError("prefilled state: the bytes received do not match the manifest's digest (corrupted)")
    sizes = [int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in specs]
    if sum(sizes) != nbytes:
        raise HandoverError(f"prefilled state: {nbytes} bytes for arrays of {sum(sizes)} bytes")
    arrays, off = [], 0
    for x, n in zip(specs, sizes):
        arrays.append(buf[off:off + n].view(np.dtype(x.dtype)).reshape(x.shape))
        off += n
    n_rows = row_struct.num_leaves
    rows = jax.tree_util.tree_unflatten(row_struct, arrays[:n_rows])
    per = page_struct.num_leaves
    pages = [jax.tree_util.tree_unflatten(page_struct, arrays[n_rows + i * per:n_rows + (i + 1) * per])
             for i in range(n_pages)]
    if not prompt:
        raise HandoverError("prefilled state: empty prompt")
    meta = {k: v for k, v in manifest.items() if k not in _FIELDS}
    return PrefilledState(prompt, first, seed, rows, pages, None if lp is None else float(lp),
                          None if top is None else [(int(t), float(v)) for t, v in top], meta)


def _specs(layout: tuple, n_pages: int) -> list:
    """The leaves (``ShapeDtypeStruct``s) of a state of ``n_pages`` pages, in wire order."""
    rows_l, page_l = layout
    return jax.tree_util.tree_leaves(rows_l) + jax.tree_util.tree_leaves(page_l) * n_pages


def _described(specs: list) -> list:
    """(shape, dtype name) of each leaf: what a manifest lists."""
    return [(tuple(x.shape), np.dtype(x.dtype).name) for x in specs]


def _expected(layout: tuple, n_pages: int) -> list:
    return _described(_specs(layout, n_pages))


def _compare(described: list, want: list) -> None:
    if described == want:
        return
    i = next((i for i, (a, b) in enumerate(zip(described, want)) if a != b), min(len(described), len(want)))
    got = described[i] if i < len(described) else None
    exp = want[i] if i < len(want) else None
    raise HandoverError(
        f"prefilled state: its layout does not match this engine's ({len(described)} arrays for {len(want)}; "
        f"first difference at array {i}: {got} vs {exp}): another model, page size, numerics mode or DSpark "
        "setting on the prefill side")


def check_layout(state: PrefilledState, layout: tuple) -> None:
    """Raise `HandoverError` unless ``state``'s arrays have the structure, shapes and dtypes this
    engine's ``layout`` (`Runner.handover_layout`) gives (the page count is the engine's to check)."""
    rows_l, page_l = layout
    if jax.tree_util.tree_structure(state.rows) != jax.tree_util.tree_structure(rows_l) or any(
            jax.tree_util.tree_structure(p) != jax.tree_util.tree_structure(page_l) for p in state.pages):
        raise HandoverError("prefilled state: its structure does not match this engine's (another model, or a "
                            "prefill engine with another DSpark setting)")
    _compare([(tuple(np.shape(x)), np.asarray(x).dtype.name) for x in _leaves(state.rows, state.pages)],
             _expected(layout, len(state.pages)))


_FIELDS = ("version", "prompt_ids", "first_token", "seed", "first_logprob", "first_top", "num_pages", "leaves",
           "row_leaves", "nbytes", "digest")
