"""Engram lookup tables and the n-gram row hash (docs/design/spec.md §5).

Everything here except `engram_hash_rows` is host-side (numpy and plain Python) and runs
once at model build time:

* `normalize_token_text` / `build_engram_token_map` / `load_engram_token_map`: the
  compressed-vocabulary map, token id -> dense id of its normalized text.
* `engram_multipliers`: the per-layer odd int64 hash multipliers.
* `engram_primes` / `engram_row_offsets` / `engram_rows_per_layer`: the per-(order, head)
  table sizes (distinct primes) and where each sub-table starts in a layer's `engram.embed`.

`engram_hash_rows` is the jax.numpy part: compressed ids [B, T] -> the
(max_ngram - 1) * n_heads table rows of every token, computed in exact int64.

All of it follows the public reference implementation bit for bit (its quirks included,
each marked below), because the checkpoint's tables were trained against those exact rows.
"""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

INT64_MAX = int(np.iinfo(np.int64).max)
INT32_MAX = int(np.iinfo(np.int32).max)

# ---------------------------------------------------------------------------------------
# Token normalization and the compressed vocabulary
# ---------------------------------------------------------------------------------------

# The sentinel the reference uses to shield a text that is exactly " " from Strip.
_SENTINEL = "\ue000"


@functools.lru_cache(maxsize=1)
def _reference_normalizer():
    """The reference's normalizer, built from the same HF `tokenizers` pieces.

    Why not plain `unicodedata`: the checkpoint's compressed vocabulary (99092 ids) was
    derived with these Rust normalizers, whose Unicode tables differ from Python's
    (e.g. StripAccents does not know marks assigned after Unicode ~9, and NFKC misses
    newer compatibility decompositions), and Python's tables also change between 3.11
    and 3.12. Reusing the same library keeps the map identical to the reference's and
    independent of the Python version. `tokenizers` is needed to load the tokenizer
    anyway. tests/test_engram_tables.py checks the pipeline against a pure-Python
    restatement of docs/design/spec.md §5 on long-assigned characters.
    """
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),  # drops General_Category=Mark (Mn, Mc, Me)
        normalizers.Lowercase(),     # per character: no Greek final-sigma rule
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(),         # Unicode White_Space (not U+001C..U+001F)
        # Quirk kept on purpose: this also turns any U+E000 already in the text into " ".
        normalizers.Replace(_SENTINEL, " "),
    ])


def normalize_token_text(s: str) -> str:
    """docs/design/spec.md §5 normalization of one token's decoded text.

    NFKC -> NFD -> drop combining marks -> lowercase -> each run of [ \\t\\r\\n] becomes
    one space -> a text that is exactly " " is protected (kept) -> strip whitespace.
    Implemented with the reference's own HF `tokenizers` normalizer sequence (see
    `_reference_normalizer` for why), including its quirk that a U+E000 in the input
    also becomes a space.

    Args:
      s: the decoded token text.
    Returns:
      The normalized text (may be empty).
    """
    return _reference_normalizer().normalize_str(s)


def _tokenizer_access(tokenizer: Any):
    """(V, decode_one, raw_token) for an HF `tokenizers.Tokenizer` or a transformers one.

    V counts added tokens (the reference's `len(tokenizer)`); `decode_one(i)` decodes id i
    alone with special tokens kept; `raw_token(i)` is the vocab string of id i.
    """
    if hasattr(tokenizer, "get_vocab_size") and hasattr(tokenizer, "id_to_token"):
        # tokenizers.Tokenizer
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        return (size,
                lambda i: tokenizer.decode([i], skip_special_tokens=False),
                tokenizer.id_to_token)
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        # transformers PreTrainedTokenizer(Fast): what the reference itself calls.
        return (len(tokenizer),
                lambda i: tokenizer.decode([i], skip_special_tokens=False),
                tokenizer.convert_ids_to_tokens)
    raise TypeError(f"unsupported tokenizer type {type(tokenizer).__name__}")


def build_engram_token_map(tokenizer: Any) -> tuple[np.ndarray, int]:
    """Token id -> compressed (normalized-text) id, docs/design/spec.md §5.

    Each id 0..V-1 is decoded alone with special tokens kept. A decode containing U+FFFD
    (a partial UTF-8 sequence) is keyed by the raw token string instead; otherwise the key
    is the normalized text, or the decoded text itself when that normalizes to empty (so
    e.g. "\\x0b" and "\\x0c" stay apart). Raw and normalized keys share one dictionary, as
    in the reference. Dense ids are handed out in first-seen order over ids 0..V-1.

    Args:
      tokenizer: an HF `tokenizers.Tokenizer` (or a transformers tokenizer).
    Returns:
      (token_map, count): token_map is int32 [V] with values in [0, count); count is the
      compressed vocab size (must equal config engram_compressed_vocab_size).
    """
    size, decode_one, raw_token = _tokenizer_access(tokenizer)
    key_to_id: dict[str, int] = {}
    token_map = np.empty((size,), dtype=np.int32)
    for tid in range(size):
        text = decode_one(tid)
        if "\ufffd" in text:
            key = raw_token(tid)
            if key is None:  # a hole in the id space: nothing better than the decode
                key = text
        else:
            key = normalize_token_text(text) or text
        token_map[tid] = key_to_id.setdefault(key, len(key_to_id))
    return token_map, len(key_to_id)


@functools.lru_cache(maxsize=8)
def _load_engram_token_map_cached(path: str, mtime_ns: int, file_size: int
                                  ) -> tuple[np.ndarray, int]:
    del mtime_ns, file_size  # only part of the cache key: a rewritten file is re-read
    from tokenizers import Tokenizer  # imported lazily: only host build code needs it

    token_map, count = build_engram_token_map(Tokenizer.from_file(path))
    token_map.flags.writeable = False  # shared by every caller through the cache
    return token_map, count


def load_engram_token_map(tokenizer_json_path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """`build_engram_token_map` for a tokenizer.json file, cached per (path, mtime, size).

    The real tokenizer needs ~1e5 decodes (about a second), so the map is built once per
    process. The returned array is read-only because it is shared.

    Args:
      tokenizer_json_path: path of an HF tokenizer.json.
    Returns:
      (token_map int32 [V], count), as `build_engram_token_map`.
    """
    path = os.path.realpath(os.fspath(tokenizer_json_path))
    st = os.stat(path)
    return _load_engram_token_map_cached(path, st.st_mtime_ns, st.st_size)


# ---------------------------------------------------------------------------------------
# Multipliers and table sizes
# ---------------------------------------------------------------------------------------

def engram_multipliers(layer_id: int, max_ngram: int, compressed_vocab: int) -> np.ndarray:
    """The odd hash multipliers of one Engram layer, docs/design/spec.md §5.

    bound = max(1, (INT64_MAX // compressed_vocab) // 2) keeps every product
    token_id * multiplier below 2^63 (token_id < compressed_vocab, multiplier < 2*bound),
    so the int64 hash never overflows.

    Args:
      layer_id: the transformer layer index (seeds the generator: 10007 * layer_id).
      max_ngram: engram_max_ngram_size (one multiplier per lookback k = 0..max_ngram-1).
      compressed_vocab: engram_compressed_vocab_size.
    Returns:
      int64 [max_ngram], every entry odd.
    """
    if compressed_vocab < 1:
        raise ValueError(f"compressed_vocab must be >= 1, got {compressed_vocab}")
    bound = max(1, (INT64_MAX // compressed_vocab) // 2)
    rng = np.random.default_rng(10007 * layer_id)
    values = rng.integers(0, bound, size=max_ngram, dtype=np.int64)
    return values * 2 + 1


# Deterministic Miller-Rabin: these bases decide every n < 3.3e24, far above any table.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@functools.lru_cache(maxsize=32)
def _engram_primes_cached(layer_ids: tuple[int, ...], max_ngram: int, n_heads: int,
                          vocab_size: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    seen: set[int] = set()
    out = []
    for _ in layer_ids:
        per_order = []
        for _order in range(2, max_ngram + 1):
            # The reference restarts the search at vocab_size - 1 for every (layer, order)
            # and skips primes taken anywhere before, so later tables walk further up.
            current = vocab_size - 1
            heads = []
            for _head in range(n_heads):
                candidate = current + 1
                while candidate in seen or not _is_prime(candidate):
                    candidate += 1
                seen.add(candidate)
                heads.append(candidate)
                current = candidate
            per_order.append(tuple(heads))
        out.append(tuple(per_order))
    return tuple(out)


def engram_primes(layer_ids: Sequence[int], max_ngram: int, n_heads: int,
                  vocab_size: int) -> dict[int, list[list[int]]]:
    """Per-layer table sizes: distinct primes, docs/design/spec.md §5 (cached; fast for 16M vocab).

    For each layer in order, each order n = 2..max_ngram, each head: the smallest prime
    strictly above `current` not used anywhere before; `current` restarts at
    vocab_size - 1 for each (layer, order) and moves to each prime found.

    Args:
      layer_ids: engram_layer_ids, in config order (the order changes the primes).
      max_ngram: engram_max_ngram_size (>= 2).
      n_heads: engram_n_heads.
      vocab_size: engram_vocab_size.
    Returns:
      {layer_id: primes[order - 2][head]} as fresh lists of Python ints.
    """
    if max_ngram < 2:
        raise ValueError(f"engram max_ngram must be >= 2, got {max_ngram}")
    if n_heads < 1:
        raise ValueError(f"engram n_heads must be >= 1, got {n_heads}")
    layer_ids = tuple(int(i) for i in layer_ids)
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"engram layer ids repeat: {layer_ids}")
    cached = _engram_primes_cached(layer_ids, int(max_ngram), int(n_heads), int(vocab_size))
    return {lid: [list(heads) for heads in per_order]
            for lid, per_order in zip(layer_ids, cached)}


def _flat_primes(primes_for_layer: Sequence[Sequence[int]]) -> list[int]:
    """Order-major flattening: [order - 2][head] -> [(order - 2) * n_heads + head]."""
    return [int(p) for heads in primes_for_layer for p in heads]


def engram_rows_per_layer(primes_for_layer: Sequence[Sequence[int]]) -> int:
    """Rows of one layer's `engram.embed` table = sum of its primes (engram_num_embeddings).

    Raises ValueError when the rows do not fit int32, because `engram_hash_rows` returns
    int32 row indices (flash: 384,016,682 < 2^31 - 1).

    Args:
      primes_for_layer: primes[order - 2][head] of one layer (from `engram_primes`).
    Returns:
      The row count, a Python int.
    """
    total = sum(_flat_primes(primes_for_layer))
    if total > INT32_MAX + 1:
        raise ValueError(f"engram table has {total} rows; int32 row indices need <= 2^31")
    return total


def engram_row_offsets(primes_for_layer: Sequence[Sequence[int]]) -> np.ndarray:
    """Start row of each (order, head) sub-table: exclusive cumsum of the flat primes.

    Args:
      primes_for_layer: primes[order - 2][head] of one layer.
    Returns:
      int64 [(max_ngram - 1) * n_heads], entry (order - 2) * n_heads + head.
    """
    engram_rows_per_layer(primes_for_layer)  # the int32 range check
    flat = np.asarray(_flat_primes(primes_for_layer), dtype=np.int64)
    return np.concatenate([np.zeros((1,), np.int64), np.cumsum(flat)[:-1]])


# ---------------------------------------------------------------------------------------
# The hash (jax.numpy)
# ---------------------------------------------------------------------------------------

def _x64_scope():
    """Context manager that turns on 64-bit types for the enclosed trace only.

    `jax.enable_x64` is the config context manager (JAX 0.10+); older releases spelled it
    `jax.experimental.enable_x64`. Inside jax.jit it applies to the ops traced in its
    body, so the surrounding program stays 32-bit.
    """
    fn = getattr(jax, "enable_x64", None)
    if fn is not None:
        return fn(True)
    from jax.experimental import enable_x64  # pragma: no cover - old JAX only
    return enable_x64(True)


def _host_int64(name: str, value: Any) -> np.ndarray:
    """`value` as a host int64 array; rejects traced or already-narrowed arrays.

    Multipliers and offsets exceed int32, so they must reach the hash as host constants:
    passed through a jit argument without x64 they would be truncated silently.
    """
    if isinstance(value, (list, tuple)):
        return np.asarray(value, dtype=np.int64)
    try:
        arr = np.asarray(value)
    except Exception as e:  # a tracer: the caller passed it through jit
        raise TypeError(f"{name} must be a host (numpy) int64 array closed over by the "
                        f"jitted function, not a traced value") from e
    if arr.dtype != np.int64:
        raise TypeError(f"{name} must be int64, got {arr.dtype} (int32 would have "
                        f"truncated the values)")
    return arr


def engram_hash_rows(compressed_ids: jax.Array, multipliers: np.ndarray,
                     primes_for_layer: Sequence[Sequence[int]], offsets: np.ndarray,
                     pad_id: int, history: jax.Array | None = None) -> jax.Array:
    """Table rows of every token's n-gram hashes for one Engram layer, docs/design/spec.md §5.

    tok[k] = compressed id at t - k (k = 0..max_ngram-1); slots before the start of the
    sequence take `pad_id`, or, when `history` is given, the ids before this chunk.
    rolling = tok[0]*m[0]; for k = 1..max_ngram-1: rolling ^= tok[k]*m[k] and
    row[(k-1)*n_heads + head] = rolling mod primes[k-1][head] + offsets[(k-1)*n_heads + head].

    The hash is exact int64 (x64 is enabled for this computation only, also under jit):
    products stay below 2^63 by the multiplier bound and XOR of non-negatives stays
    non-negative, so truncating remainder equals the reference's floor modulo.

    Args:
      compressed_ids: int32 [B, T], already mapped through the token map (ids >= V
        mapped to the pad's compressed id by the caller).
      multipliers: host int64 [max_ngram] (`engram_multipliers`).
      primes_for_layer: primes[order - 2][head], (max_ngram - 1) x n_heads Python ints.
      offsets: host int64 [(max_ngram - 1) * n_heads] (`engram_row_offsets`).
      pad_id: the compressed id of engram_pad_token_id (token_map[pad_token_id]); a Python
        int or a traced int32 scalar.
      history: optional int32 [B, max_ngram - 1], compressed ids preceding this chunk,
        most recent last; pad_id where the sequence has fewer tokens. All-pad history
        gives the same rows as no history (a fresh sequence).
    Returns:
      int32 [B, T, (max_ngram - 1) * n_heads] rows into the layer's `engram.embed`,
      order-major (n-gram order outer, head inner) as the rows are gathered.
    """
    mult = _host_int64("multipliers", multipliers)
    offs = _host_int64("offsets", offsets)
    max_ngram = int(mult.shape[0])
    if max_ngram < 2 or len(primes_for_layer) != max_ngram - 1:
        raise ValueError(f"{len(primes_for_layer)} prime orders for {max_ngram} multipliers "
                         f"(need max_ngram - 1 >= 1)")
    n_heads = len(primes_for_layer[0])
    if any(len(h) != n_heads for h in primes_for_layer):
        raise ValueError("every n-gram order needs the same number of heads")
    if offs.shape != ((max_ngram - 1) * n_heads,):
        raise ValueError(f"offsets shape {offs.shape}, want ({(max_ngram - 1) * n_heads},)")
    engram_rows_per_layer(primes_for_layer)  # raises if rows + offsets overflow int32
    if isinstance(pad_id, (int, np.integer)):
        pad_id = operator.index(pad_id)
    # else: a traced scalar (e.g. token_map[pad_token_id] read from the params inside jit).
    if compressed_ids.ndim != 2:
        raise ValueError(f"compressed_ids must be [B, T], got shape {compressed_ids.shape}")
    batch, seq = compressed_ids.shape
    lookback = max_ngram - 1
    if history is not None and tuple(history.shape) != (batch, lookback):
        raise ValueError(f"history shape {tuple(history.shape)}, want {(batch, lookback)}")

    with _x64_scope():
        ids = jnp.asarray(compressed_ids).astype(jnp.int64)
        if history is None:
            hist = jnp.broadcast_to(jnp.asarray(pad_id).astype(jnp.int64), (batch, lookback))
        else:
            hist = jnp.asarray(history).astype(jnp.int64)
        # ext[:, j] is the id at position j - lookback of this chunk; the shift by k is
        # then a static slice, and the first `lookback` slots supply the lookback.
        ext = jnp.concatenate([hist, ids], axis=1)  # [B, lookback + T]
        rolling = ids * jnp.int64(mult[0])
        rows = []
        for k in range(1, max_ngram):
            tok_k = ext[:, lookback - k: lookback - k + seq]  # id at t - k, [B, T]
            rolling = rolling ^ (tok_k * jnp.int64(mult[k]))
            primes = jnp.asarray(np.asarray(primes_for_layer[k - 1], dtype=np.int64))
            start = offs[(k - 1) * n_heads: k * n_heads]
            lhs = jnp.broadcast_to(rolling[..., None], (batch, seq, n_heads))
            rem = jax.lax.rem(lhs, jnp.broadcast_to(primes, (batch, seq, n_heads)))
            rows.append(rem + jnp.asarray(start))
        out = jnp.concatenate(rows, axis=-1).astype(jnp.int32)  # [B, T, lookback*H]
    return out
