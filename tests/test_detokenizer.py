"""Tokenizer loading, incremental detokenization and stop strings (dsv41_jax/serving/tokenizer.py)."""

import json

import pytest

from dsv41_jax.serving.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer, load_tokenizer

FFFD = "\ufffd"
TEXT = "你好, world 😀 ok ñ 日本語🎉!"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def _stream(tok, ids, chunk=1, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    deltas = [d.add(ids[i:i + chunk] if chunk > 1 else ids[i]) for i in range(0, len(ids), chunk)]
    return d, deltas, d.finish()


def test_load_tiny(tok):
    assert isinstance(tok, Tokenizer) and tok.vocab_size == 320 == len(tok)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.eos_token_ids == (1,)
    assert {0, 1, 2} <= tok.special_token_ids
    ids = tok.encode("hello world")
    assert ids and ids[0] != tok.bos_token_id and tok.decode(ids) == "hello world"
    assert tok.encode_batch(["hello world", "ok"]) == [ids, tok.encode("ok")]


def test_load_from_dir_with_generation_config(tmp_path, tok):
    # a model directory without special_tokens.json: ids from tokenizer_config + generation_config
    src = load_tokenizer("tiny")
    (tmp_path / "tokenizer.json").write_text(src.hf.to_str(), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<｜begin▁of▁sentence｜>"}, "eos_token": "<｜end▁of▁sentence｜>"}), encoding="utf-8")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 314]}), encoding="utf-8")
    t = load_tokenizer(str(tmp_path))
    assert (t.bos_token_id, t.eos_token_id, t.pad_token_id) == (0, 1, None)
    assert t.eos_token_ids == (1, 314)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nope"))


def test_multibyte_split_never_emits_broken_utf8(tok):
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    # the tiny tokenizer really splits these characters over byte tokens
    assert sum(FFFD in tok.decode([i]) for i in ids) >= 10
    for chunk in (1, 2, 3):
        d, deltas, tail = _stream(tok, ids, chunk)
        assert all(FFFD not in x for x in deltas), deltas
        assert "".join(deltas) + tail == TEXT == d.text
        assert tail == ""
        if chunk == 1:
            assert deltas.count("") >= 5  # partial characters were held back
            assert "你" in deltas and "😀" in deltas


def test_prompt_context_and_finish_flushes_invalid_tail(tok):
    prompt = tok.encode("say: ")
    ids = tok.encode("日本")
    d, deltas, tail = _stream(tok, ids, prompt_ids=prompt)
    assert "".join(deltas) + tail == "日本" and d.token_ids == ids
    # a generation cut inside a character: nothing broken mid-stream, the rest comes out at finish
    cut = tok.encode("ok😀")[:-2]
    d, deltas, tail = _stream(tok, cut)
    assert "".join(deltas) == "ok" and tail.startswith(FFFD)


def test_skip_special_tokens_switch(tok):
    ids = tok.encode("hi") + [tok.eos_token_id] + tok.encode("yo")
    assert "".join(_stream(tok, ids)[1]) == "hiyo"
    d, deltas, tail = _stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) + tail == "hi<｜end▁of▁sentence｜>yo"


def test_stop_string_spanning_two_tokens(tok):
    ids = tok.encode("hello world")
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[:4] == ["he", "ll", "o", " w"]  # "o w" spans two tokens
    d = IncrementalDetokenizer(tok, stop=["o w"])
    deltas = [d.add(i) for i in ids]
    assert deltas[:4] == ["he", "ll", "", ""]  # "o" held back as a possible stop prefix
    assert d.stopped and d.stop_str == "o w" and d.text == "hell"
    assert deltas[4:] == ["", "", ""] and d.finish() == ""
    d = IncrementalDetokenizer(tok, stop="o w", include_stop_str_in_output=True)
    assert "".join(d.add(i) for i in ids) == "hello w"


def test_stop_prefix_released_when_not_a_match(tok):
    ids = tok.encode("hello world")
    d = IncrementalDetokenizer(tok, stop=["o x", "zzz"])
    deltas = [d.add(i) for i in ids]
    assert deltas[2] == "" and deltas[3] == "o w"
    assert not d.stopped and "".join(deltas) + d.finish() == "hello world"
    # held back at the end of the stream: released by finish
    d = IncrementalDetokenizer(tok, stop=["ldx"])
    out = "".join(d.add(i) for i in ids)
    assert out == "hello wor" and d.finish() == "ld"


def test_stop_string_in_multibyte_text(tok):
    ids = tok.encode(TEXT)
    d = IncrementalDetokenizer(tok, stop=["好,", "ok"])
    out = "".join(d.add(i) for i in ids)
    assert d.stopped and d.stop_str == "好," and out == "你" and FFFD not in out


def test_stop_strings_ignored_before_min_tokens(tok):
    ids = tok.encode("hello world")
    d = IncrementalDetokenizer(tok, stop=["he"], min_tokens=2)
    out = "".join(d.add(i) for i in ids) + d.finish()
    assert out == "hello world" and not d.stopped


def test_stop_checker_unit():
    sc = StopChecker(["abc", "bcd", "x"])
    assert sc.process("zab") == ("z", False)  # "ab" held
    assert sc.process("cd") == ("", True)  # "abc" (earliest start) matches across the two deltas
    assert sc.stopped and sc.matched == "abc"
    sc = StopChecker(["bcd", "abcx"])
    out = [sc.process(c) for c in "abcd"]
    assert out[-1] == ("a", True) and sc.matched == "bcd"
    assert "".join(o for o, _ in out) == "a"
    sc = StopChecker(None)
    assert sc.process("anything") == ("anything", False) and sc.flush() == ""
    with pytest.raises(ValueError):
        StopChecker([""])
