"""The synthetic chat corpus the `nano` model is trained on (scripts/train_nano.py).

Every example is an OpenAI-style conversation whose last message is the assistant turn to learn,
rendered with the project's own V4.1 chat encoder (`chat_format.encoding.encode_messages`): the prompt is the
conversation without that turn (exactly what the server would send the model), the completion is
what the model must generate after it — ``reasoning + "</think>" + answer + EOS`` with thinking on,
``answer + EOS`` with thinking off, ``"\\n\\n" + DSML calls block + EOS`` for a tool call. That the
two concatenate to the encoder's rendering of the whole conversation is checked for every example,
so training and serving see the same text.

Tasks are ones a small model can truly learn from the prompt alone: copying and reformatting,
look-ups in a table given in the prompt, small-number arithmetic, counting, "Reply with exactly: X",
short multi-turn exchanges, and `get_weather` tool calls (the call, then the answer from the result).

Determinism: example ``i`` of a corpus with seed ``s`` comes from ``numpy.random.default_rng([s, i])``
alone, so any example can be regenerated on its own (random access for Grain) and the same seed
always gives the same corpus. Held-out sets use another seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from dsv41_jax.chat_format.dsml import render_calls_block
from dsv41_jax.chat_format.encoding import EOS, THINK_CLOSE, encode_messages

WORDS = ("cat", "dog", "owl", "fox", "bee", "ant", "elk", "yak", "cow", "pig", "hen", "ram", "bat", "eel")
LETTERS = "abcdefghij"
CITIES = ("Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Delhi", "Quito", "Bern", "Baku")
SKIES = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

# Task kinds and their default sampling weights (tool turns are long: see `Example.n_tokens`).
KINDS = ("copy", "upper", "lookup", "add", "sub", "count", "exact", "multi", "tool_call", "tool_answer")
DEFAULT_WEIGHTS = {"copy": 1.0, "upper": 1.0, "lookup": 1.5, "add": 1.5, "sub": 1.0, "count": 1.0,
                   "exact": 1.0, "multi": 1.0, "tool_call": 1.0, "tool_answer": 1.0}


@dataclass
class Example:
    """One training / evaluation example.

    messages: the conversation *without* the target turn (what a client sends); tools: the request's
    tools (None without); thinking: the request's thinking switch; target: the assistant message to
    produce ({"content", "reasoning_content"?, "tool_calls"?}); answer: the exact expected ``content``
    (or for tool calls the expected (name, arguments)); prompt / completion: the rendered texts.
    """

    kind: str
    messages: list
    tools: Optional[list]
    thinking: bool
    target: dict
    answer: Any
    prompt: str = ""
    completion: str = ""
    extra: dict = field(default_factory=dict)


def _word(rng) -> str:
    return WORDS[int(rng.integers(len(WORDS)))]


def _qa(kind: str, rng) -> tuple[str, str, str]:
    """(question, reasoning, answer) of a single-turn task."""
    if kind == "copy":
        s = " ".join(_word(rng) for _ in range(int(rng.integers(2, 5))))
        return f"Repeat: {s}", f"copy {s}", s
    if kind == "upper":
        s = " ".join(_word(rng) for _ in range(int(rng.integers(1, 4))))
        return f"Uppercase: {s}", f"{s} -> upper", s.upper()
    if kind == "lookup":
        keys = list(rng.choice(len(WORDS), size=int(rng.integers(2, 5)), replace=False))
        vals = [int(rng.integers(10)) for _ in keys]
        q = int(rng.integers(len(keys)))
        table = ", ".join(f"{WORDS[k]}={v}" for k, v in zip(keys, vals))
        return f"{table}. Value of {WORDS[keys[q]]}?", f"{WORDS[keys[q]]}={vals[q]}", str(vals[q])
    if kind == "add":
        a, b = int(rng.integers(10)), int(rng.integers(10))
        return f"What is {a}+{b}?", f"{a}+{b}={a + b}", str(a + b)
    if kind == "sub":
        a = int(rng.integers(10))
        b = int(rng.integers(a + 1))
        return f"What is {a}-{b}?", f"{a}-{b}={a - b}", str(a - b)
    if kind == "count":
        # Letters spaced apart: one token each with nano's word-level tokenizer (a letter run would
        # be cut into pieces whose letter counts the model would have to learn first).
        c = LETTERS[int(rng.integers(3))]
        s = [LETTERS[int(rng.integers(3))] for _ in range(int(rng.integers(2, 7)))]
        marks = " ".join(ch for ch in s if ch == c)
        return f"How many {c} in {' '.join(s)}?", f"{marks or 'none'}", str(s.count(c))
    if kind == "exact":
        s = " ".join(_word(rng) for _ in range(int(rng.integers(1, 4))))
        return f"Reply with exactly: {s}", f"say {s}", s
    raise ValueError(f"unknown single-turn kind {kind!r}")


SIMPLE = ("copy", "upper", "lookup", "add", "sub", "count", "exact")


def _weather(rng) -> tuple[str, str, int]:
    return CITIES[int(rng.integers(len(CITIES)))], SKIES[int(rng.integers(len(SKIES)))], int(rng.integers(-5, 35))


def make_example(seed: int, index: int, *, kinds=KINDS, weights: Optional[dict] = None,
                 thinking: Optional[bool] = None, attempt: int = 0) -> Example:
    """Example `index` of the corpus with `seed` (pure: the same arguments give the same example).

    kinds / weights: which task kinds to draw from (default all, `DEFAULT_WEIGHTS`); thinking: force
    the thinking switch (None: drawn, half on, half off); attempt > 0: a redraw for the same index
    (`PackedSource` redraws examples too long for the sequence length).
    """
    rng = np.random.default_rng([int(seed), int(index)] + ([int(attempt)] if attempt else []))
    w = np.array([(weights or DEFAULT_WEIGHTS).get(k, 0.0) for k in kinds], np.float64)
    kind = kinds[int(rng.choice(len(kinds), p=w / w.sum()))]
    think = bool(rng.integers(2)) if thinking is None else bool(thinking)
    tools = None
    if kind in SIMPLE:
        q, r, a = _qa(kind, rng)
        messages = [{"role": "user", "content": q}]
        target = {"role": "assistant", "content": a}
        answer = a
    elif kind == "multi":
        k1, k2 = (SIMPLE[int(rng.integers(len(SIMPLE)))] for _ in range(2))
        q1, r1, a1 = _qa(k1, rng)
        q, r, a = _qa(k2, rng)
        first = {"role": "assistant", "content": a1}
        if think:
            first["reasoning_content"] = r1
        messages = [{"role": "user", "content": q1}, first, {"role": "user", "content": q}]
        target = {"role": "assistant", "content": a}
        answer = a
    elif kind == "tool_call":
        city, _, _ = _weather(rng)
        tools = [WEATHER_TOOL]
        messages = [{"role": "user", "content": f"Weather in {city}?"}]
        r = f"need weather for {city}"
        target = {"role": "assistant", "content": "",
                  "tool_calls": [{"id": "call_0", "type": "function",
                                  "function": {"name": "get_weather", "arguments": {"city": city}}}]}
        answer = ("get_weather", {"city": city})
    elif kind == "tool_answer":
        city, sky, temp = _weather(rng)
        tools = [WEATHER_TOOL]
        call = {"role": "assistant", "content": "",
                "tool_calls": [{"id": "call_0", "type": "function",
                                "function": {"name": "get_weather", "arguments": {"city": city}}}]}
        if think:
            call["reasoning_content"] = f"need weather for {city}"
        messages = [{"role": "user", "content": f"Weather in {city}?"}, call,
                    {"role": "tool", "tool_call_id": "call_0", "content": f"{sky}, {temp}C"}]
        r = f"tool says {sky}, {temp}C"
        a = f"It is {sky} in {city}, {temp}C."
        target = {"role": "assistant", "content": a}
        answer = a
    else:
        raise ValueError(f"unknown kind {kind!r}; kinds are {KINDS}")
    if think:
        target["reasoning_content"] = r
    ex = Example(kind, messages, tools, think, target, answer)
    ex.prompt, ex.completion = render(ex)
    return ex


def render(ex: Example) -> tuple[str, str]:
    """(prompt, completion) texts of `ex` through the chat encoder; checks that prompt + completion is
    the encoder's rendering of the whole conversation (so nothing the server sends differs)."""
    prompt = encode_messages(ex.messages, tools=ex.tools, thinking=ex.thinking)
    t = ex.target
    completion = (t.get("reasoning_content", "") + THINK_CLOSE) if ex.thinking else ""
    completion += t.get("content") or ""
    if t.get("tool_calls"):
        completion += "\n\n" + render_calls_block(t["tool_calls"])
    completion += EOS
    whole = encode_messages(ex.messages + [t], tools=ex.tools, thinking=ex.thinking)
    if whole != prompt + completion:
        raise AssertionError(f"chat encoder disagrees for a {ex.kind} example:\n{whole!r}\nvs\n"
                             f"{prompt + completion!r}")
    return prompt, completion


def tokenize(ex: Example, tokenizer) -> tuple[list, list]:
    """(prompt ids, completion ids), each tokenized on its own as the server does (the prompt is
    encoded without added specials; the model then generates the completion ids)."""
    return tokenizer.encode(ex.prompt), tokenizer.encode(ex.completion)


def pack(prompt_ids, completion_ids, seq_len: int, pad_id: int) -> Optional[dict]:
    """One fixed-length training row, or None if the example does not fit in `seq_len` + 1 tokens.

    Returns {"tokens": int32 [seq_len], "targets": int32 [seq_len], "mask": float32 [seq_len]}:
    targets[t] = ids[t + 1]; mask is 1 exactly where targets[t] is a completion token (the loss is
    on what the model must generate, not on the prompt).
    """
    ids = list(prompt_ids) + list(completion_ids)
    if len(ids) > seq_len + 1:
        return None
    n = len(ids)
    full = np.full(seq_len + 1, pad_id, np.int32)
    full[:n] = ids
    mask = np.zeros(seq_len, np.float32)
    mask[len(prompt_ids) - 1:n - 1] = 1.0
    return {"tokens": full[:-1], "targets": full[1:], "mask": mask}


TEXT_KINDS = tuple(k for k in KINDS if not k.startswith("tool"))
TOOL_KINDS = tuple(k for k in KINDS if k.startswith("tool"))
TOOL_STREAM = 1 << 40  # `PackedSource.index_offset` of the tool rows


class PackedSource:
    """Random-access source of packed rows for Grain: row ``i`` is the first of examples
    ``(seed, i)``, ``(seed, i, 1)``, ``(seed, i, 2)``… that fits in `seq_len` (+1) tokens.

    Pure in (seed, i), so a resumed run regenerates exactly the rows it would have seen.
    """

    def __init__(self, tokenizer, seed: int, seq_len: int, *, kinds=TEXT_KINDS, size: int = 1 << 30,
                 max_attempts: int = 64, index_offset: int = 0):
        self.tokenizer, self.seed, self.seq_len, self.kinds = tokenizer, int(seed), int(seq_len), tuple(kinds)
        self.size, self.max_attempts = int(size), int(max_attempts)
        # A second stream of the same seed (e.g. the long tool rows beside the text rows) reads
        # examples from index_offset on, so its draws are not the text stream's.
        self.index_offset = int(index_offset)
        self.pad_id = int(tokenizer.token_to_id("<\uff5c\u2581pad\u2581\uff5c>") or 0)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        for attempt in range(self.max_attempts):
            ex = make_example(self.seed, int(i) + self.index_offset, kinds=self.kinds, attempt=attempt)
            row = pack(*tokenize(ex, self.tokenizer), self.seq_len, self.pad_id)
            if row is not None:
                return row
        raise ValueError(f"no example of kinds {self.kinds} fits in seq_len={self.seq_len} after "
                         f"{self.max_attempts} draws (row {i}); raise --seq-len or drop the long kinds")


def batches(source: PackedSource, batch_size: int, start_step: int = 0, *, prefetch: int = 4):
    """An iterator of stacked batches {tokens, targets int32 [B, T], mask float32 [B, T]} from Grain,
    starting at batch `start_step` (batch s holds rows s·B … s·B+B−1)."""
    import grain

    ds = grain.MapDataset.source(source).batch(batch_size, drop_remainder=True)
    ds = ds[start_step:]
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch))
    return iter(it)


def row_buckets(kinds, seq_len: int, batch_size: int, tool_seq_len: int, tool_batch_size: int) -> list:
    """The training step's row buckets: [(kinds, seq_len, batch_size, index_offset)] — the text kinds in
    short rows, the tool kinds (their system prompt alone is ~170 nano tokens) in long rows of their
    own stream, so neither pays for the other's padding. Buckets with no kind or no rows are left out."""
    out = [(tuple(k for k in kinds if k not in TOOL_KINDS), int(seq_len), int(batch_size), 0),
           (tuple(k for k in kinds if k in TOOL_KINDS), int(tool_seq_len), int(tool_batch_size), TOOL_STREAM)]
    return [b for b in out if b[0] and b[2] > 0]


def bucket_stream(tokenizer, seed: int, buckets, start_step: int = 0):
    """Batches of every bucket, step by step: an iterator of tuples of `batches` dicts (one per bucket,
    in `row_buckets` order) from step `start_step` on (random access: a resumed run gets its rows)."""
    its = [batches(PackedSource(tokenizer, seed, t, kinds=ks, index_offset=off), bs, start_step)
           for ks, t, bs, off in buckets]
    while True:
        yield tuple(next(i) for i in its)
