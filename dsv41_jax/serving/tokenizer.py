"""Tokenizer loading, incremental detokenization and stop strings.

`load_tokenizer("tiny" | MODEL_DIR | path/to/tokenizer.json)` returns a `Tokenizer`: a thin wrapper
around an HF ``tokenizers.Tokenizer`` that encodes **without** adding special tokens (the chat
encoder places BOS itself), decodes with a ``skip_special_tokens`` flag, and knows the BOS / EOS / pad
ids from, in order of precedence, ``special_tokens.json`` (tiny's ``{"bos": 0, "eos": 1, ...}``),
``tokenizer_config.json`` (``bos_token`` / ``eos_token`` / ``pad_token`` as strings or
``{"content": ...}``) and ``generation_config.json`` (``eos_token_id``, an int or a list; all of them
join `Tokenizer.eos_token_ids`).

`IncrementalDetokenizer` is the one detokenizer: the engine's output processor runs one per sample
and the server uses its text (the server never decodes generated ids itself). It turns a request's
generated ids into text deltas for streaming. It decodes a short window of ids (from the last emitted
character boundary) and emits only text that does not end in U+FFFD, so a multi-byte character split
over byte-level tokens is held back until it is complete: the stream never carries a broken UTF-8
sequence, and the concatenated deltas equal the full decode (`finish` flushes what is still held at
the end, e.g. a truly invalid byte sequence). It also records each token's offset in the text
(``text_offset`` of completions logprobs) and leaves ``drop_ids`` out of the text.

`StopChecker` matches stop strings on the detokenized text, even when a stop string spans tokens. It
holds back the longest tail of the stream that is a proper prefix of some stop string until the next
text resolves it, and on a match returns the text truncated before the stop string (or through it,
with ``include_stop_str_in_output``). `IncrementalDetokenizer` uses one when given ``stop``.

Stop **token ids** are the scheduler's business (`sampling.stop_token_hit`); as in vLLM, the token
that ended the request should not be fed to the detokenizer (its text is not part of the output).
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional, Sequence, Union

from tokenizers import Tokenizer as HFTokenizer

__all__ = ["IncrementalDetokenizer", "StopChecker", "Tokenizer", "TINY_TOKENIZER_DIR", "load_tokenizer"]

TINY_TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tiny")
REPLACEMENT_CHAR = "\ufffd"
# ids of the prompt decoded before the first generated token, so that decoders that drop a leading
# space on the first token of a string (Metaspace / SentencePiece) get the spacing right (as vLLM)
_PROMPT_CONTEXT = 5


def _read_json(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(tok) -> Optional[str]:
    if isinstance(tok, str):
        return tok
    if isinstance(tok, dict):
        return tok.get("content")
    return None


class Tokenizer:
    """Thin wrapper around an HF ``tokenizers.Tokenizer`` (the raw object is ``.hf``)."""

    def __init__(self, hf: HFTokenizer, *, bos_token_id: Optional[int] = None,
                 eos_token_id: Optional[int] = None, pad_token_id: Optional[int] = None,
                 eos_token_ids: Iterable[int] = (), name: str = ""):
        self.hf = hf
        self.name = name
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        eos = [] if eos_token_id is None else [eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos + [int(t) for t in eos_token_ids]))
        added = hf.get_added_tokens_decoder() if hasattr(hf, "get_added_tokens_decoder") else {}
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if getattr(t, "special", False))
        self._bytes_cache: dict[int, bytes] = {}
        self._bmap: Optional[dict] = None

    # -- sizes and lookups -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> Optional[int]:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self.hf.id_to_token(int(token_id))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[Optional[str]]:
        return [self.hf.id_to_token(int(i)) for i in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token (logprobs' ``bytes``): a ByteLevel BPE piece mapped back to
        its bytes (a piece of a multi-byte character is not valid UTF-8 alone), otherwise the token
        decoded alone with special tokens kept. Unknown ids give ``b""``."""
        tid = int(token_id)
        b = self._bytes_cache.get(tid)
        if b is None:
            piece = self.hf.id_to_token(tid)
            bmap = self._byte_map()
            if piece is None:
                b = b""
            elif bmap and tid not in self.special_token_ids and all(ch in bmap for ch in piece):
                b = bytes(bmap[ch] for ch in piece)
            else:
                b = self.hf.decode([tid], skip_special_tokens=False).encode("utf-8")
            self._bytes_cache[tid] = b
        return b

    def token_str(self, token_id: int) -> str:
        """One token as display text (logprobs' ``token``; broken UTF-8 shows as U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _byte_map(self) -> dict:
        """GPT-2's unicode -> byte table when the decoder is ByteLevel, else {} (read once)."""
        if self._bmap is None:
            self._bmap = {}
            try:
                dec = json.loads(self.hf.to_str()).get("decoder") or {}
            except (ValueError, AttributeError):
                dec = {}
            kinds = [dec.get("type")] + [d.get("type") for d in dec.get("decoders") or []]
            if "ByteLevel" in kinds:
                self._bmap = _byte_decoder()
        return self._bmap

    # -- encode / decode ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens are added (special-token text is still parsed)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={self.eos_token_ids}, pad={self.pad_token_id})")


def _byte_decoder() -> dict:
    """GPT-2's ByteLevel table reversed: the unicode character of a token piece -> its byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def load_tokenizer(model_dir_or_name: str = "tiny") -> Tokenizer:
    """Load ``tokenizer.json`` from a model directory ("tiny" = the bundled tiny tokenizer), or a
    ``tokenizer.json`` path, with the BOS / EOS / pad ids from the files beside it."""
    from dsv41_jax.model.config import resolve_model

    src = TINY_TOKENIZER_DIR if model_dir_or_name == "tiny" else resolve_model(os.fspath(model_dir_or_name))
    if os.path.isfile(src):
        tok_path, d = src, os.path.dirname(src)
    else:
        d = src
        tok_path = os.path.join(d, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise FileNotFoundError(f"load_tokenizer: no tokenizer.json in {d!r}")
    hf = HFTokenizer.from_file(tok_path)

    ids = {"bos": None, "eos": None, "pad": None}
    extra_eos: list[int] = []
    special = _read_json(os.path.join(d, "special_tokens.json"))
    if isinstance(special, dict):
        for k in ids:
            v = special.get(k)
            if isinstance(v, int):
                ids[k] = v
            elif isinstance(v, str):
                ids[k] = hf.token_to_id(v)
    cfg = _read_json(os.path.join(d, "tokenizer_config.json"))
    if isinstance(cfg, dict):
        for k in ids:
            if ids[k] is None:
                content = _token_content(cfg.get(f"{k}_token"))
                if content is not None:
                    ids[k] = hf.token_to_id(content)
    gen = _read_json(os.path.join(d, "generation_config.json"))
    if isinstance(gen, dict):
        e = gen.get("eos_token_id")
        e = [e] if isinstance(e, int) else (e or [])
        extra_eos = [int(t) for t in e if isinstance(t, int)]
        if ids["eos"] is None and extra_eos:
            ids["eos"] = extra_eos[0]
        if ids["bos"] is None and isinstance(gen.get("bos_token_id"), int):
            ids["bos"] = gen["bos_token_id"]
    return Tokenizer(hf, bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
                     eos_token_ids=extra_eos, name="tiny" if model_dir_or_name == "tiny" else d)


# ----------------------------------------------------------------------------------------------------
# Stop strings
# ----------------------------------------------------------------------------------------------------


class StopChecker:
    """Stop-string matching on a text stream.

    ``process(delta) -> (text to emit, stopped)``. Text that might be the start of a stop string is
    held back until resolved; on a match the emitted text ends right before the stop string (through
    it with ``include_stop_str_in_output``) and ``.matched`` names the stop string. Matches start at
    the earliest position; at equal starts, the first listed stop string wins. After a stop every
    further call returns ``("", True)``. ``flush()`` releases the held-back tail at the end of a
    request that did not stop on a string."""

    def __init__(self, stop: Union[str, Sequence[str], None] = None, include_stop_str_in_output: bool = False):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or s == "" for s in stops):
            raise ValueError("stop: stop strings must be non-empty strings")
        self.stops = stops
        self.include_stop_str_in_output = include_stop_str_in_output
        self.held = ""
        self.stopped = False
        self.matched: Optional[str] = None

    def process(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        buf = self.held + delta
        best = None  # (start, order, stop)
        for order, s in enumerate(self.stops):
            pos = buf.find(s)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, order, s)
        if best is not None:
            pos, _, s = best
            self.stopped, self.matched, self.held = True, s, ""
            return buf[: pos + (len(s) if self.include_stop_str_in_output else 0)], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out


# ----------------------------------------------------------------------------------------------------
# Incremental detokenization
# ----------------------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Per-sample streaming detokenizer (the one the engine and the server share).

    ``add(token_ids) -> str`` takes one id or a list (several committed at once, e.g. by DSpark) and
    returns the new text safe to stream: complete characters only, and with ``stop`` nothing from a
    stop string on. ``finish() -> str`` returns what is still held back (call at the end of a request;
    it is empty after a stop-string match). ``.text`` is everything emitted, ``.token_ids`` every id
    added, ``.stopped`` / ``.stop_str`` report a stop-string match. Stop strings are only searched
    once ``min_tokens`` ids have been added (vLLM's rule).

    ``drop_ids``: ids left out of the text (the server keeps special tokens for its parsers while
    tools or thinking are on, but not all of them; `reasoning.chat_text_specials`). ``.offsets``: per
    added id, the offset in ``.text`` where its text starts (a dropped or skipped special token adds
    nothing, the pieces of one multi-byte character share its offset; a token cut off with a matched
    stop string gets the length of the text) -- completions' ``logprobs.text_offset``. The stop
    *token* that ends a sample is never text: callers do not `add` it."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Optional[Sequence[int]] = None, *,
                 skip_special_tokens: bool = True, stop: Union[str, Sequence[str], None] = None,
                 include_stop_str_in_output: bool = False, min_tokens: int = 0, drop_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        ctx = list(prompt_ids or [])[-_PROMPT_CONTEXT:]
        self._ids: list[int] = [int(t) for t in ctx]  # window context + generated ids (drop_ids left out)
        self._prefix = 0  # start of the decode window
        self._read = len(self._ids)  # ids before this are already emitted
        self._n_ctx = len(ctx)
        self.stop_checker = StopChecker(stop, include_stop_str_in_output)
        self.min_tokens = int(min_tokens)
        self.drop_ids = frozenset(int(t) for t in drop_ids)
        self.text = ""
        self.offsets: list[int] = []
        self._n_added = 0
        self._decoded = 0  # characters decoded so far (before stop strings cut or hold any)

    @classmethod
    def for_params(cls, tokenizer: Tokenizer, prompt_ids: Optional[Sequence[int]], p,
                   drop_ids: Iterable[int] = ()) -> "IncrementalDetokenizer":
        """The detokenizer of one sample with `SamplingParams` `p` (stop strings, special tokens)."""
        return cls(tokenizer, prompt_ids, skip_special_tokens=p.skip_special_tokens, stop=p.stop,
                   include_stop_str_in_output=p.include_stop_str_in_output, min_tokens=p.min_tokens,
                   drop_ids=drop_ids)

    @property
    def token_ids(self) -> list[int]:
        """The ids decoded (``drop_ids`` left out)."""
        return self._ids[self._n_ctx:]

    @property
    def stopped(self) -> bool:
        return self.stop_checker.stopped

    @property
    def stop_str(self) -> Optional[str]:
        return self.stop_checker.matched

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            if new_text.startswith(prefix_text):
                delta = new_text[len(prefix_text):]
            else:  # decoder changed earlier text (rare): emit past the common prefix
                n = 0
                while n < min(len(new_text), len(prefix_text)) and new_text[n] == prefix_text[n]:
                    n += 1
                delta = new_text[max(n, len(prefix_text)):]
            self._prefix, self._read = self._read, len(self._ids)
            return delta
        return ""

    def _emit(self, delta: str) -> str:
        if not delta:
            return ""
        self._decoded += len(delta)
        if self._n_added < self.min_tokens:
            out, stopped = delta, False
        else:
            out, stopped = self.stop_checker.process(delta)
        self.text += out
        if stopped:  # tokens of the cut stop string start where the text ends
            n = len(self.text)
            self.offsets = [min(o, n) for o in self.offsets]
        return out

    def add(self, token_ids: Union[int, Sequence[int]]) -> str:
        if self.stopped:
            return ""
        ids = [token_ids] if isinstance(token_ids, int) or not hasattr(token_ids, "__iter__") else token_ids
        out = []
        for t in ids:
            if self.stopped:
                break
            t = int(t)
            self.offsets.append(self._decoded)
            self._n_added += 1
            if t in self.drop_ids:
                continue
            self._ids.append(t)
            out.append(self._emit(self._step()))
        return "".join(out)

    def finish(self) -> str:
        """Flush the held-back text at the end of the request (a trailing invalid byte sequence
        comes out as U+FFFD here, never mid-stream)."""
        if self.stopped:
            return ""
        out = ""
        if self._read < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix:self._read])
            new_text = self._decode(self._ids[self._prefix:])
            out = new_text[len(prefix_text):] if new_text.startswith(prefix_text) else new_text
            self._prefix = self._read = len(self._ids)
        out = self._emit(out) if out else ""
        if not self.stopped:
            tail = self.stop_checker.flush()
            self.text += tail
            out += tail
        return out
