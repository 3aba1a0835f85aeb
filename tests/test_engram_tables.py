"""Tests for dsv41_jax.model.engram_tables (docs/design/spec.md §5) and the tiny tokenizer assets (§10)."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer

from dsv41_jax.model import engram_tables as et

TINY_DIR = Path(__file__).resolve().parent.parent / "dsv41_jax" / "assets" / "tiny"
TINY_TOKENIZER = TINY_DIR / "tokenizer.json"

# Flash Engram config (docs/design/spec.md §1).
FLASH_LAYERS = [1, 14]
FLASH_MAX_NGRAM = 4
FLASH_HEADS = 8
FLASH_VOCAB = 16_000_000
FLASH_COMPRESSED_VOCAB = 99092
FLASH_ROWS = {1: 384006168, 14: 384016682}

# Compressed vocab of the tiny tokenizer, derived by hand from the layout in
# scripts/make_tiny_tokenizer.py (first-seen order over ids 0..319):
#   3   BOS, EOS, pad (distinct normalized strings)
#   99  the 128 ASCII bytes: 52 letters -> 26; space, \t, \n, \r -> the protected " " (1);
#       \x0b, \x0c normalize to "" and are keyed by themselves (2); the other 28 controls
#       (0x00-0x08, 0x0e-0x1f, 0x7f) stay as they are (28); 10 digits + 32 punctuation (42)
#   128 the bytes 0x80-0xff decode to U+FFFD alone, so each is keyed by its raw token string
#   25  new strings among the 54 merges: th (th/Th/TH), the (the/The/THE/Ġthe/ĠThe/ĠTHE),
#       in er on an and ing re at en es or is it al ar ed ou ll he st of to you; every other
#       merge ("Ġand", "Ġin", "Ġa", "ĠI", "ĠĠ", "ĊĊ", ...) normalizes to an existing string
#   7   the trailing special tokens
TINY_COMPRESSED_VOCAB = 3 + 99 + 128 + 25 + 7  # = 262


@pytest.fixture(scope="module")
def tiny_tok() -> Tokenizer:
    return Tokenizer.from_file(str(TINY_TOKENIZER))


@pytest.fixture(scope="module")
def tiny_map():
    return et.load_engram_token_map(TINY_TOKENIZER)


# --------------------------------------------------------------------------- tiny assets

def test_tiny_tokenizer_assets(tiny_tok):
    special = json.loads((TINY_DIR / "special_tokens.json").read_text(encoding="utf-8"))
    assert special == {"bos": 0, "eos": 1, "pad": 2, "system": 313, "user": 314,
                       "assistant": 315, "think_open": 316, "think_close": 317,
                       "dsml": 318, "image": 319}
    assert tiny_tok.get_vocab_size(with_added_tokens=True) == 320
    assert tiny_tok.token_to_id("<｜begin▁of▁sentence｜>") == 0
    assert tiny_tok.token_to_id("｜DSML｜") == special["dsml"]
    text = "Hello, The THE the — ünïcödé 😀"
    ids = tiny_tok.encode(text, add_special_tokens=False).ids
    assert tiny_tok.decode(ids) == text
    prompt = "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    ids = tiny_tok.encode(prompt, add_special_tokens=False).ids
    assert ids[:2] == [0, 314] and ids[-2:] == [315, 317]
    assert tiny_tok.decode(ids, skip_special_tokens=True) == "Hi"
    config = json.loads((TINY_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["add_bos_token"] is False
    assert config["bos_token"] == "<｜begin▁of▁sentence｜>"


# --------------------------------------------------------------------------- normalization

@pytest.mark.parametrize("text,want", [
    (" The", "the"), ("the", "the"), ("THE", "the"), ("É", "e"), ("ÉCOLE", "ecole"),
    ("naïve café", "naive cafe"),
    ("a \t\r\n  b", "a b"),           # a whitespace run becomes one space
    (" ", " "), ("\t", " "), ("\n\n", " "), ("   ", " "),  # the protected lone space
    ("  x  ", "x"), ("\xa0a\u3000", "a"),
    ("\x0b", ""), ("", ""),            # empty results: the map keys these by their text
    ("\x1c", "\x1c"),                  # not White_Space, so Strip keeps it
    ("ﬁ", "fi"), ("｜DSML｜", "|dsml|"),  # NFKC compatibility forms
    ("ΟΣ", "οσ"),                      # per-character lowercase: no final sigma
    ("a\ue000", "a "),                 # the reference's sentinel quirk, kept
])
def test_normalize_token_text(text, want):
    assert et.normalize_token_text(text) == want


def _spec_restatement(s: str) -> str:
    """docs/design/spec.md §5 normalization written out with `unicodedata` (valid for old code points)."""
    s = unicodedata.normalize("NFKC", s)
    s = unicodedata.normalize("NFD", s)
    s = "".join(c for c in s if unicodedata.category(c)[0] != "M")
    s = "".join(c.lower() for c in s)
    out, prev_ws = [], False
    for c in s:
        if c in " \t\r\n":
            if not prev_ws:
                out.append(" ")
            prev_ws = True
        else:
            out.append(c)
            prev_ws = False
    s = "".join(out)
    if s == " ":
        return s
    white = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000" + "".join(
        chr(c) for c in range(0x2000, 0x200B))
    return s.strip(white).replace("\ue000", " ")


def test_normalize_matches_spec_restatement():
    # Blocks whose contents predate Unicode 9, where Python's tables and the Rust ones
    # that the reference (and we) use agree; newer code points may legitimately differ.
    blocks = [(0x0000, 0x0250), (0x0300, 0x0370), (0x0370, 0x0400), (0x0400, 0x0500),
              (0x1E00, 0x1F00), (0x2000, 0x2065), (0x2070, 0x2190), (0x3000, 0x3040),
              (0xFB00, 0xFB07), (0xFF00, 0xFFEF)]
    chars = [chr(c) for lo, hi in blocks for c in range(lo, hi)
             if unicodedata.category(chr(c)) != "Cn"]
    for c in chars:
        assert et.normalize_token_text(c) == _spec_restatement(c), ascii(c)
    rng = np.random.default_rng(0)
    pool = chars + list(" \t\n\r") * 50
    for _ in range(2000):
        s = "".join(pool[i] for i in rng.integers(0, len(pool), size=int(rng.integers(1, 7))))
        assert et.normalize_token_text(s) == _spec_restatement(s), ascii(s)


# --------------------------------------------------------------------------- token map

def test_tiny_token_map(tiny_tok, tiny_map):
    token_map, count = tiny_map
    assert count == TINY_COMPRESSED_VOCAB == 262
    assert token_map.dtype == np.int32 and token_map.shape == (320,)
    assert int(token_map.max()) == count - 1 and int(token_map.min()) == 0

    def cid(token: str) -> int:
        tid = tiny_tok.token_to_id(token)
        assert tid is not None, token
        return int(token_map[tid])

    the = cid("the")
    assert all(cid(t) == the for t in ["The", "THE", "Ġthe", "ĠThe", "ĠTHE"])
    # encoding the words in running text lands on the same compressed id
    for word in [" The", "the", "THE"]:
        (tid,) = tiny_tok.encode(word, add_special_tokens=False).ids
        assert token_map[tid] == the
    assert cid("th") == cid("Th") == cid("TH") != the
    assert cid("a") == cid("A") == cid("Ġa")
    assert cid("Ġand") == cid("and")
    space = cid("Ġ")
    assert all(cid(t) == space for t in ["ĉ", "Ċ", "č", "ĠĠ", "ĊĊ"])  # \t \n \r, runs
    assert cid("ċ") != cid("Č")   # \x0b and \x0c normalize to "" and are keyed by text
    high = [int(token_map[3 + b]) for b in range(0x80, 0x100)]
    assert len(set(high)) == 128  # raw-token keys for the lone non-ASCII bytes
    # dense ids in first-seen order: BOS, EOS, pad, then byte 0x00 ...
    assert token_map[:4].tolist() == [0, 1, 2, 3]
    specials = json.loads((TINY_DIR / "special_tokens.json").read_text(encoding="utf-8"))
    assert len({int(token_map[i]) for i in specials.values()}) == len(specials)
    assert token_map[specials["system"]] == count - 7  # first trailing special, new key


def test_token_map_cache_and_object_api(tiny_tok, tiny_map):
    again = et.load_engram_token_map(str(TINY_TOKENIZER))
    assert again[0] is tiny_map[0]  # cached: same array object
    assert not tiny_map[0].flags.writeable
    built, count = et.build_engram_token_map(tiny_tok)
    assert count == tiny_map[1]
    np.testing.assert_array_equal(built, tiny_map[0])


# --------------------------------------------------------------------------- multipliers

@pytest.mark.parametrize("layer_id,cv", [(1, 99092), (14, 99092), (1, 262), (4, 262), (3, 1)])
def test_multipliers(layer_id, cv):
    m = et.engram_multipliers(layer_id, 4, cv)
    bound = max(1, (np.iinfo(np.int64).max // cv) // 2)
    direct = np.random.default_rng(10007 * layer_id).integers(0, bound, size=4, dtype=np.int64)
    assert m.dtype == np.int64 and m.shape == (4,)
    np.testing.assert_array_equal(m, direct * 2 + 1)
    assert all(int(v) % 2 == 1 for v in m)
    # no int64 overflow: the largest id times any multiplier stays below 2^63
    assert all((cv - 1) * int(v) < 2 ** 63 for v in m)
    np.testing.assert_array_equal(m, et.engram_multipliers(layer_id, 4, cv))


# --------------------------------------------------------------------------- primes

def test_primes_small_by_hand():
    # Primes above 49: 53 59 61 67 71 73 79 83 89 97 101 103 ...
    # layer 1, order 2 starts at 49: 53, then 59; order 3 restarts at 49, skips the used
    # 53 and 59: 61, 67; order 4: 71, 73. Layer 4 continues past everything used: 79, 83 |
    # 89, 97 | 101, 103.
    primes = et.engram_primes([1, 4], 4, 2, 50)
    assert primes == {1: [[53, 59], [61, 67], [71, 73]], 4: [[79, 83], [89, 97], [101, 103]]}
    assert et.engram_rows_per_layer(primes[1]) == 53 + 59 + 61 + 67 + 71 + 73 == 384
    assert et.engram_rows_per_layer(primes[4]) == 79 + 83 + 89 + 97 + 101 + 103 == 552
    offs = et.engram_row_offsets(primes[1])
    assert offs.dtype == np.int64
    assert offs.tolist() == [0, 53, 112, 173, 240, 311]
    assert et.engram_row_offsets(primes[4]).tolist() == [0, 79, 162, 251, 348, 449]
    # returned lists are copies: mutating them must not poison the cache
    primes[1][0][0] = 0
    assert et.engram_primes([1, 4], 4, 2, 50)[1][0][0] == 53


def _trial_division_primes(lo: int, count: int) -> list[int]:
    """The first `count` primes > lo, by plain trial division."""
    out, n = [], lo + 1
    while len(out) < count:
        if n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1)):
            out.append(n)
        n += 1
    return out


def test_primes_flash():
    et._engram_primes_cached.cache_clear()
    primes = et.engram_primes(FLASH_LAYERS, FLASH_MAX_NGRAM, FLASH_HEADS, FLASH_VOCAB)  # no wall-clock bound
    assert list(primes) == FLASH_LAYERS
    flat = [p for lid in FLASH_LAYERS for heads in primes[lid] for p in heads]
    assert len(flat) == 2 * 3 * 8 and len(set(flat)) == len(flat)
    assert all(p > FLASH_VOCAB - 1 for p in flat)
    # Every (layer, order) restarts at vocab - 1 and skips used primes, so in creation
    # order the tables take the consecutive primes above vocab - 1.
    assert flat == _trial_division_primes(FLASH_VOCAB - 1, len(flat))
    for lid, rows in FLASH_ROWS.items():
        assert et.engram_rows_per_layer(primes[lid]) == rows
        offs = et.engram_row_offsets(primes[lid])
        assert offs.shape == (24,) and int(offs[-1]) + primes[lid][-1][-1] == rows
        assert rows < 2 ** 31


def test_rows_must_fit_int32():
    with pytest.raises(ValueError):
        et.engram_row_offsets([[2 ** 30 + 3, 2 ** 30 + 7]])


# --------------------------------------------------------------------------- hash rows

def _ref_rows(seq, mult, primes, offsets, pad, history=None):
    """Expected rows for one sequence with plain Python ints (docs/design/spec.md §5 verbatim)."""
    mult = [int(v) for v in mult]
    offsets = [int(v) for v in offsets]
    n_heads = len(primes[0])
    max_ngram = len(mult)
    before = list(history) if history is not None else [pad] * (max_ngram - 1)
    ext = [int(v) for v in before] + [int(v) for v in seq]
    base = len(before)
    out = []
    for t in range(len(seq)):
        tok = [ext[base + t - k] for k in range(max_ngram)]
        rolling = tok[0] * mult[0]
        row = []
        for k in range(1, max_ngram):
            rolling ^= tok[k] * mult[k]
            assert 0 <= rolling < 2 ** 63  # the int64 range argument of docs/design/spec.md §5
            for h in range(n_heads):
                row.append(rolling % primes[k - 1][h] + offsets[(k - 1) * n_heads + h])
        out.append(row)
    return out


def _flash_layer(layer_id):
    primes = et.engram_primes(FLASH_LAYERS, FLASH_MAX_NGRAM, FLASH_HEADS, FLASH_VOCAB)[layer_id]
    mult = et.engram_multipliers(layer_id, FLASH_MAX_NGRAM, FLASH_COMPRESSED_VOCAB)
    return mult, primes, et.engram_row_offsets(primes)


# ids near the top of the compressed vocab make products near 2^63: a float or int32
# computation would get these wrong.
SEQS = [[5, 17, 99091, 0, 42, 7, 7, 99090, 3, 61234],
        [99091, 99091, 99091, 1, 2, 3, 4, 5, 6, 98765]]
FLASH_PAD = 2


@pytest.mark.parametrize("layer_id", FLASH_LAYERS)
def test_hash_rows_flash_exact(layer_id):
    mult, primes, offs = _flash_layer(layer_id)
    got = et.engram_hash_rows(jnp.asarray(SEQS, jnp.int32), mult, primes, offs, FLASH_PAD)
    assert got.dtype == jnp.int32 and got.shape == (2, 10, 24)
    want = [_ref_rows(s, mult, primes, offs, FLASH_PAD) for s in SEQS]
    assert np.asarray(got).tolist() == want
    assert int(np.asarray(got).max()) < FLASH_ROWS[layer_id]
    # sequence start: t = 0 sees pad at t-1, t-2, t-3 (written out by hand)
    m = [int(v) for v in mult]
    r2 = (SEQS[0][0] * m[0]) ^ (FLASH_PAD * m[1])
    r4 = r2 ^ (FLASH_PAD * m[2]) ^ (FLASH_PAD * m[3])
    assert int(got[0, 0, 0]) == r2 % primes[0][0]
    assert int(got[0, 0, 17]) == r4 % primes[2][1] + int(offs[17])
    # t = 1: the 4-gram still has two pad slots
    r = (SEQS[0][1] * m[0]) ^ (SEQS[0][0] * m[1]) ^ (FLASH_PAD * m[2]) ^ (FLASH_PAD * m[3])
    assert int(got[0, 1, 23]) == r % primes[2][7] + int(offs[23])


def test_hash_rows_tiny_config(tiny_map):
    token_map, count = tiny_map
    primes = et.engram_primes([1, 4], 4, 2, 50)
    pad = int(token_map[2])
    ids = token_map[np.array([[0, 259, 290, 62, 316, 1, 3], [71, 72, 73, 74, 75, 76, 77]])]
    for lid in (1, 4):
        mult = et.engram_multipliers(lid, 4, count)
        offs = et.engram_row_offsets(primes[lid])
        got = et.engram_hash_rows(jnp.asarray(ids), mult, primes[lid], offs, pad)
        want = [_ref_rows(s, mult, primes[lid], offs, pad) for s in ids.tolist()]
        assert np.asarray(got).tolist() == want
        assert int(np.asarray(got).max()) < et.engram_rows_per_layer(primes[lid])


def test_hash_rows_history_continuation():
    mult, primes, offs = _flash_layer(14)
    full = jnp.asarray(SEQS, jnp.int32)
    whole = np.asarray(et.engram_hash_rows(full, mult, primes, offs, FLASH_PAD))
    # all-pad history is the same as no history
    pad_hist = jnp.full((2, 3), FLASH_PAD, jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(et.engram_hash_rows(full, mult, primes, offs, FLASH_PAD, pad_hist)), whole)
    for split in (1, 2, 3, 6, 9):
        hist = [([FLASH_PAD] * 3 + s[:split])[-3:] for s in SEQS]
        tail = et.engram_hash_rows(full[:, split:], mult, primes, offs, FLASH_PAD,
                                   jnp.asarray(hist, jnp.int32))
        np.testing.assert_array_equal(np.asarray(tail), whole[:, split:])
        want = [_ref_rows(s[split:], mult, primes, offs, FLASH_PAD, h)
                for s, h in zip(SEQS, hist)]
        assert np.asarray(tail).tolist() == want


def test_hash_rows_jit_and_decode_steps():
    mult, primes, offs = _flash_layer(1)
    x64_before = jax.config.jax_enable_x64

    @jax.jit
    def step(ids, hist):
        return et.engram_hash_rows(ids, mult, primes, offs, FLASH_PAD, hist)

    full = jnp.asarray(SEQS, jnp.int32)
    whole = np.asarray(et.engram_hash_rows(full, mult, primes, offs, FLASH_PAD))
    hist = jnp.full((2, 3), FLASH_PAD, jnp.int32)
    for t in range(full.shape[1]):  # one-token decode steps carrying the history
        out = step(full[:, t:t + 1], hist)
        assert out.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(out), whole[:, t:t + 1])
        hist = jnp.concatenate([hist[:, 1:], full[:, t:t + 1]], axis=1)
    chunk = jax.jit(lambda ids: et.engram_hash_rows(ids, mult, primes, offs, FLASH_PAD))
    np.testing.assert_array_equal(np.asarray(chunk(full)), whole)
    assert jax.config.jax_enable_x64 == x64_before  # x64 stayed local to the hash
    # int64 constants passed through jit would be truncated: refused loudly
    with pytest.raises(TypeError):
        jax.jit(lambda ids, m: et.engram_hash_rows(ids, m, primes, offs, FLASH_PAD))(
            full, mult)
