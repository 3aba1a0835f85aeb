#!/usr/bin/env python3
"""Build the tiny byte-level BPE tokenizer used by the `tiny` preset and the tests.

Deterministic: the vocabulary, the merges and the added tokens are all spelled out
below, so running it twice writes byte-identical files (the script checks the
round trip and that the files it wrote load back to the same tokenizer).

Layout (320 ids in total, docs/design/spec.md §10 for the special strings):

    0..2      <｜begin▁of▁sentence｜> (BOS), <｜end▁of▁sentence｜> (EOS), <｜▁pad▁｜> (pad)
    3..258    the 256 byte-level base tokens, id = 3 + byte value
    259..312  54 hand-chosen merges (English pieces; "the"/"The"/"THE" with and
              without a leading space are single tokens so Engram's normalization
              has something to merge)
    313..319  <｜System｜>, <｜User｜>, <｜Assistant｜>, <think>, </think>, ｜DSML｜,
              <｜deepseek_image｜>  (all special: skip_special_tokens drops them)

Writes, under dsv41_jax/assets/tiny/ (or --out-dir):
    tokenizer.json         HF `tokenizers` format (ByteLevel pre-tokenizer, add_prefix_space
                           False; ByteLevel decoder; no normalizer, no post-processor)
    tokenizer_config.json  add_bos_token false (prompts carry BOS as literal text, docs/design/spec.md §10)
    special_tokens.json    role name -> id, for the rest of the code base to read

Usage: python scripts/make_tiny_tokenizer.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

TOTAL_VOCAB = 320

# (role, string) in id order. The bar is U+FF5C and "▁" is U+2581, exactly as the
# real checkpoint's tokenizer spells them.
LEADING_SPECIALS = [
    ("bos", "<\uff5cbegin\u2581of\u2581sentence\uff5c>"),
    ("eos", "<\uff5cend\u2581of\u2581sentence\uff5c>"),
    ("pad", "<\uff5c\u2581pad\u2581\uff5c>"),
]
TRAILING_SPECIALS = [
    ("system", "<\uff5cSystem\uff5c>"),
    ("user", "<\uff5cUser\uff5c>"),
    ("assistant", "<\uff5cAssistant\uff5c>"),
    ("think_open", "<think>"),
    ("think_close", "</think>"),
    ("dsml", "\uff5cDSML\uff5c"),
    ("image", "<\uff5cdeepseek_image\uff5c>"),
]

# Merges in rank order (earlier = applied first). Written in the byte-level alphabet:
# "Ġ" is the space byte, "Ċ" the newline byte. The order matters for BPE: "t h" and
# "th e" rank before "Ġ t", so " the" becomes "Ġthe" rather than "Ġt" + "he".
MERGES = [
    ("t", "h"), ("th", "e"),
    ("T", "h"), ("Th", "e"),
    ("T", "H"), ("TH", "E"),
    ("Ġ", "the"), ("Ġ", "The"), ("Ġ", "THE"),
    ("i", "n"), ("e", "r"), ("o", "n"), ("a", "n"), ("an", "d"), ("Ġ", "and"),
    ("in", "g"), ("r", "e"), ("a", "t"), ("e", "n"), ("e", "s"), ("o", "r"),
    ("i", "s"), ("i", "t"), ("a", "l"), ("a", "r"), ("e", "d"), ("o", "u"),
    ("l", "l"), ("h", "e"), ("s", "t"),
    ("Ġ", "in"), ("Ġ", "is"), ("Ġ", "it"), ("Ġ", "on"), ("Ġ", "he"),
    # Single letters after a space rank last, so they never pre-empt the pieces above.
    ("Ġ", "a"), ("Ġ", "t"), ("Ġ", "s"), ("Ġ", "w"), ("Ġ", "o"), ("Ġ", "c"),
    ("Ġ", "b"), ("Ġ", "f"), ("Ġ", "i"), ("Ġ", "p"), ("Ġ", "m"), ("Ġ", "d"),
    ("Ġ", "y"), ("Ġ", "I"),
    ("Ġo", "f"), ("Ġt", "o"), ("Ġy", "ou"),
    ("Ġ", "Ġ"), ("Ċ", "Ċ"),
]

# Words that must come out as exactly one token (checked below).
SINGLE_TOKEN_WORDS = ["the", "The", "THE", " the", " The", " THE", " a", "in", "er",
                      "on", "and", " and", "ing", " in", " is", " it", " on", " he",
                      " of", " to", " you", " I", "  ", "\n\n"]

ROUND_TRIP_TEXT = "Hello, The THE the \u2014 \u00fcn\u00efc\u00f6d\u00e9 \U0001F600"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet), in byte order.

    Computed here rather than taken from `pre_tokenizers.ByteLevel.alphabet()` because
    that returns an unordered list, and the ids must be deterministic (id = 3 + byte).
    """
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD))
                 + list(range(0xAE, 0x100)))
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def add_token(vocab: dict, token: str) -> None:
    """Append `token` at the next id; a duplicate is an error (ids must be what the tables say)."""
    if token in vocab:
        raise ValueError(f"duplicate token {token!r}")
    vocab[token] = len(vocab)


def base_vocab() -> dict:
    """The leading specials (ids 0..2) and the 256 byte-level base tokens (id = 3 + byte)."""
    vocab: dict[str, int] = {}
    for _, s in LEADING_SPECIALS:
        add_token(vocab, s)
    byte_map = bytes_to_unicode()
    for b in range(256):
        add_token(vocab, byte_map[b])
    return vocab


def build_tokenizer() -> Tokenizer:
    """Assemble the tokenizer from the fixed tables above."""
    vocab = base_vocab()

    def add(token: str) -> None:
        add_token(vocab, token)

    for left, right in MERGES:
        if left not in vocab or right not in vocab:
            raise ValueError(f"merge ({left!r}, {right!r}) uses an unknown token")
        add(left + right)
    # The trailing specials sit in the model vocab too, so their ids are fixed by the
    # vocab (add_special_tokens reuses an existing id instead of appending).
    for _, s in TRAILING_SPECIALS:
        add(s)
    if len(vocab) != TOTAL_VOCAB:
        raise ValueError(f"vocab has {len(vocab)} tokens, want {TOTAL_VOCAB}; "
                         f"adjust MERGES ({len(MERGES)} now)")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # normalized=False: the literal marker text must match byte for byte in prompts.
    specials = [AddedToken(s, special=True, normalized=False)
                for _, s in LEADING_SPECIALS + TRAILING_SPECIALS]
    tok.add_special_tokens(specials)
    return tok


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """Role name -> id for every special token."""
    out = {}
    for role, s in LEADING_SPECIALS + TRAILING_SPECIALS:
        tid = tok.token_to_id(s)
        if tid is None:
            raise ValueError(f"special token {s!r} missing")
        out[role] = tid
    return out


def check(tok: Tokenizer) -> None:
    """Sanity checks on the built (or reloaded) tokenizer; raises on any failure."""
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != TOTAL_VOCAB:
        raise AssertionError(f"len(tokenizer) = {size}, want {TOTAL_VOCAB}")
    ids = special_token_ids(tok)
    want = {role: i for i, (role, _) in enumerate(LEADING_SPECIALS)}
    want.update({role: TOTAL_VOCAB - len(TRAILING_SPECIALS) + i
                 for i, (role, _) in enumerate(TRAILING_SPECIALS)})
    if ids != want:
        raise AssertionError(f"special ids {ids} != {want}")
    for word in SINGLE_TOKEN_WORDS:
        enc = tok.encode(word, add_special_tokens=False).ids
        if len(enc) != 1:
            raise AssertionError(f"{word!r} encodes to {enc}, want a single token")
    enc = tok.encode(ROUND_TRIP_TEXT, add_special_tokens=False).ids
    dec = tok.decode(enc, skip_special_tokens=True)
    if dec != ROUND_TRIP_TEXT:
        raise AssertionError(f"round trip {ROUND_TRIP_TEXT!r} -> {enc} -> {dec!r}")
    check_specials(tok)


def check_specials(tok: Tokenizer) -> None:
    """Special markers are single tokens when they appear as literal text, vanish on a
    skip_special_tokens decode and decode to themselves otherwise."""
    for _, s in LEADING_SPECIALS + TRAILING_SPECIALS:
        enc = tok.encode("a" + s + "b", add_special_tokens=False).ids
        if len(enc) != 3 or enc[1] != tok.token_to_id(s):
            raise AssertionError(f"{s!r} is not one token in context: {enc}")
        if tok.decode(enc, skip_special_tokens=True) != "ab":
            raise AssertionError(f"{s!r} survives skip_special_tokens")
        if tok.decode(enc, skip_special_tokens=False) != "a" + s + "b":
            raise AssertionError(f"{s!r} does not decode to itself")


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=root / "dsv41_jax" / "assets" / "tiny")
    args = parser.parse_args(argv)

    tok = build_tokenizer()
    check(tok)
    ids = special_token_ids(tok)
    roles = dict(LEADING_SPECIALS + TRAILING_SPECIALS)

    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    config = {
        # docs/design/spec.md §10: the checkpoint adds no tokens; BOS is written into the prompt text.
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": roles["bos"],
        "eos_token": roles["eos"],
        "pad_token": roles["pad"],
        "unk_token": None,
        # Cleanup would rewrite single-token decodes (" ." -> "."), which would change
        # the Engram token map; the real DeepSeek config turns it off too.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "special_tokens.json").write_text(
        json.dumps(ids, indent=2) + "\n", encoding="utf-8")

    # What was written must load back to the same behaviour.
    check(Tokenizer.from_file(str(out / "tokenizer.json")))

    for role, tid in ids.items():
        print(f"{role:12s} {tid:4d}  {roles[role]}")
    print(f"wrote {out}/tokenizer.json, tokenizer_config.json, special_tokens.json "
          f"({TOTAL_VOCAB} tokens, {len(MERGES)} merges)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
