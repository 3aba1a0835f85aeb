#!/usr/bin/env python3
"""Build nano's word-level byte BPE tokenizer from its synthetic chat corpus.

Deterministic: the corpus is `training.data` with a fixed seed, the merges are derived from it by a
fixed rule, so running it twice writes byte-identical files (checked: the files load back to the
same tokenizer, every corpus word is one token, every corpus text round-trips).

Why not tiny's tokenizer: its byte-level pieces make a 3-letter key of a look-up 3 tokens and a
tool-calling prompt ~1,000 tokens; a word per token makes a look-up one token match (what an
induction head does) and the text rows 2-3x shorter, which is most of nano's training cost.

Layout (ids in this order; docs/design/spec.md §10 for the special strings):

    0..2      <｜begin▁of▁sentence｜> (BOS), <｜end▁of▁sentence｜> (EOS), <｜▁pad▁｜> (pad)
    3..258    the 256 byte-level base tokens, id = 3 + byte value (any text still encodes)
    259..     the merges: every word of the corpus (GPT-2 ByteLevel word split, digits single)
              seen at least --min-count times becomes exactly one token; each word's merges are
              added in corpus-frequency order, each the merge of the first two pieces the word
              still splits into, so no earlier word's encoding changes
    then      the chat template's constant prose as whole (non-special) tokens: the tools-section
              text before and after its schemas, the effort line's tail, <tool_result> and
              </tool_result> (a 250-word preamble as one token: nano learns its answer, not the
              preamble; any other text around them tokenizes as usual)
    last      <｜System｜>, <｜User｜>, <｜Assistant｜>, <think>, </think>, ｜DSML｜,
              <｜deepseek_image｜>  (special: skip_special_tokens drops them)

Pre-tokenizer: digits split one per piece, then ByteLevel (add_prefix_space False, GPT-2 regex);
ByteLevel decoder. Writes under dsv41_jax/assets/nano/ (or --out-dir): tokenizer.json,
tokenizer_config.json, special_tokens.json.

Usage: python scripts/make_nano_tokenizer.py [--out-dir DIR] [--examples N] [--min-count K]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402

from make_tiny_tokenizer import (LEADING_SPECIALS, TRAILING_SPECIALS, add_token, base_vocab,  # noqa: E402
                                 bytes_to_unicode, check_specials, special_token_ids)

MIN_CHUNK = 40  # characters: shorter template stretches are tokenized as words
CORPUS_SEED = 0  # the training corpus's seed (scripts/train_nano.py --seed default)


def template_chunks() -> list[str]:
    """The chat encoder's constant prose that nano sees in every tool / thinking prompt."""
    from dsv41_jax.chat_format.encoding import DEFAULT_WORDING, TOOL_RESULT_CLOSE, TOOL_RESULT_OPEN

    marker = "\x00SCHEMAS\x00"
    tools = DEFAULT_WORDING.tools_template
    from dsv41_jax.chat_format import encoding as chat

    filled = tools.format(**chat._FORMAT_FIELDS, tool_schemas=marker)
    before, after = filled.split(marker)
    effort = DEFAULT_WORDING.effort_line(0)
    tail = effort[effort.index(" (range"):]
    specials = [s for _, s in LEADING_SPECIALS + TRAILING_SPECIALS]
    # Specials split the text first, so a chunk is a stretch between them; only long stretches (the
    # prose) become chunks: short ones ('" invoke name="') also occur in what the model writes.
    pat = "|".join(re.escape(s) for s in specials)
    chunks = [c for part in (before, after) for c in re.split(pat, part) if len(c) >= MIN_CHUNK]
    return chunks + [tail, TOOL_RESULT_OPEN, TOOL_RESULT_CLOSE]


def pre_tokenizer():
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def corpus_texts(n: int) -> list[str]:
    """Prompt + completion of the first `n` examples of each task kind, both thinking modes."""
    from dsv41_jax.training import data

    out = []
    for kind in data.KINDS:
        for i in range(n):
            ex = data.make_example(CORPUS_SEED, i, kinds=(kind,), thinking=bool(i % 2))
            out.append(ex.prompt + ex.completion)
    # Every word the generators can draw, in every casing the tasks use, whatever the sample saw.
    words = list(data.WORDS) + [w.upper() for w in data.WORDS] + list(data.CITIES) + list(data.SKIES)
    words += list(data.LETTERS)
    out += [" ".join(words), " ".join(words).replace(" ", "\n")]
    return out


def _split_on(text: str, chunks: list[str]) -> list[str]:
    pat = "|".join(re.escape(c) for c in sorted(chunks, key=len, reverse=True))
    return [p for p in re.split(pat, text) if p]


def corpus_words(texts: list[str], chunks: list[str]) -> collections.Counter:
    pre = pre_tokenizer()
    counts: collections.Counter = collections.Counter()
    for t in texts:
        for piece in _split_on(t, chunks):
            for w, _ in pre.pre_tokenize_str(piece):
                counts[w] += 1
    return counts


def _bpe(word: str, ranks: dict) -> list[str]:
    """BPE of one pre-tokenized word (byte-level alphabet) under ranked merges."""
    parts = list(word)
    while len(parts) > 1:
        best = min(range(len(parts) - 1), key=lambda i: ranks.get((parts[i], parts[i + 1]), 1 << 30))
        if (parts[best], parts[best + 1]) not in ranks:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return parts


def build_merges(counts: collections.Counter, min_count: int) -> list[tuple[str, str]]:
    """Merges making every word seen >= min_count times one token (digits stay single)."""
    merges: list[tuple[str, str]] = []
    ranks: dict = {}
    words = [w for w, c in counts.items() if c >= min_count and len(w) > 1]
    for w in sorted(words, key=lambda w: (-counts[w], w)):
        while True:
            parts = _bpe(w, ranks)
            if len(parts) == 1:
                break
            pair = (parts[0], parts[1])
            ranks[pair] = len(merges)
            merges.append(pair)
    return merges


def build_tokenizer(n_examples: int = 400, min_count: int = 2) -> tuple[Tokenizer, dict]:
    chunks = template_chunks()
    texts = corpus_texts(n_examples)
    counts = corpus_words(texts, chunks + [s for _, s in LEADING_SPECIALS + TRAILING_SPECIALS])
    merges = build_merges(counts, min_count)
    vocab = base_vocab()
    for left, right in merges:
        add_token(vocab, left + right)
    for c in chunks:  # in the vocab by their text (as the specials), so the added tokens keep these ids
        add_token(vocab, c)
    for _, s in TRAILING_SPECIALS:
        add_token(vocab, s)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    # Added tokens are matched on the raw text before the word split; an added token whose text is
    # already in the vocab keeps that id.
    tok.add_tokens([AddedToken(c, special=False, normalized=False) for c in chunks])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for _, s in LEADING_SPECIALS + TRAILING_SPECIALS])
    info = {"merges": len(merges), "words": sum(1 for c in counts.values() if c >= min_count),
            "chunks": chunks, "texts": texts, "counts": counts, "min_count": min_count}
    return tok, info


def check(tok: Tokenizer, info: dict) -> None:
    """Every frequent corpus word is one token, the template chunks are one token each, every corpus
    text round-trips, specials behave as tiny's."""
    pre = pre_tokenizer()
    for w, c in info["counts"].items():
        if c < info["min_count"] or len(w) < 2:
            continue
        text = bytes(_byte_decode(w)).decode("utf-8")
        got = tok.encode(text, add_special_tokens=False).ids
        if len(got) != 1 or pre.pre_tokenize_str(text)[0][0] != w:
            raise AssertionError(f"corpus word {text!r} encodes to {got}, want one token")
    for c in info["chunks"]:
        got = tok.encode("x" + c + "y", add_special_tokens=False).ids
        if len(got) != 3:
            raise AssertionError(f"template chunk {c[:30]!r}... is not one token in context: {got}")
    for t in info["texts"]:
        if tok.decode(tok.encode(t, add_special_tokens=False).ids, skip_special_tokens=False) != t:
            raise AssertionError(f"round trip fails for {t[:80]!r}")
    check_specials(tok)
    size = tok.get_vocab_size(with_added_tokens=True)
    ids = special_token_ids(tok)
    if ids["image"] != size - 1 or ids["bos"] != 0:
        raise AssertionError(f"special ids {ids} are not at the vocab's ends (size {size})")


_INV = None


def _byte_decode(w: str) -> list[int]:
    global _INV
    if _INV is None:
        _INV = {c: b for b, c in bytes_to_unicode().items()}
    return [_INV[ch] for ch in w]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "dsv41_jax" / "assets" / "nano",
                    help="where to write (default dsv41_jax/assets/nano)")
    ap.add_argument("--examples", type=int, default=400,
                    help="corpus examples per task kind the words are counted on (default 400)")
    ap.add_argument("--min-count", type=int, default=2,
                    help="a word seen this many times becomes one token (default 2)")
    args = ap.parse_args(argv)
    if args.examples < 1 or args.min_count < 1:
        print("error: --examples and --min-count must be >= 1", file=sys.stderr)
        return 2
    tok, info = build_tokenizer(args.examples, args.min_count)
    check(tok, info)
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    roles = dict(LEADING_SPECIALS + TRAILING_SPECIALS)
    config = {"add_bos_token": False, "add_eos_token": False, "bos_token": roles["bos"],
              "eos_token": roles["eos"], "pad_token": roles["pad"], "unk_token": None,
              "clean_up_tokenization_spaces": False, "model_max_length": 1048576,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    ids = special_token_ids(tok)
    (out / "special_tokens.json").write_text(json.dumps(ids, indent=2) + "\n", encoding="utf-8")
    check(Tokenizer.from_file(str(out / "tokenizer.json")), info)
    size = tok.get_vocab_size(with_added_tokens=True)
    print(f"wrote {out}/tokenizer.json, tokenizer_config.json, special_tokens.json: {size} tokens "
          f"({info['merges']} merges for {info['words']} words, {len(info['chunks'])} template chunks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
