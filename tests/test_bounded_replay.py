"""SWA bounded replay (--enable-decoder-swa-bounded-replay; issue 15 part 3): `decode.extend_bounded`
and its engine / server wiring.

`configs.mini` in fp32 (tiny's mechanisms in 6 layers, window W = 8; last store layer S = 3, so layers
4-5 are the late ones). Compile
time dominates, so everything shares three compiled steps: one bounded-replay engine and one plain
engine with the same arguments (chunk = token bucket = W = 8, one batch bucket of 1, radix cache off)
hold the same `CacheConfig`, so the model-level tests below reuse the engines' jitted steps
(`decode.jitted_extend` is cached per (cfg, ccfg, ...)): plain [1, 8], bounded [1, 8], plain [1, 1].
With T = W the late sub-batch has the step's own width, which is what makes (a) bit-exact; the
"fewer tokens" shapes of a wider chunk are checked by tracing only (`jax.eval_shape`).
"""

import argparse
import asyncio
import logging

import jax
import numpy as np
import pytest

import configs
from dsv41_jax.model import cache as kvc
from dsv41_jax.model import decode as dec
from dsv41_jax.llm import LLM
from dsv41_jax.serving.engine import BOUNDED_REPLAY_PLP_REFUSAL, Engine, EngineError
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.sampling import SamplingParams

W = 8
ENGINE_KW = dict(model="tiny", dtype="float32", page_size=16, context_length=128, max_running_requests=1,
                 max_total_tokens=256, chunked_prefill_size=W, batch_buckets=[1], token_buckets=[W],
                 disable_radix_cache=True, skip_server_warmup=True)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def engines():
    """(bounded-replay engine, its start-up log lines, plain engine)."""
    h = _Lines()
    lg = logging.getLogger("dsv41_jax.engine")
    lg.addHandler(h)
    try:
        on = Engine(EngineArgs(**ENGINE_KW, enable_decoder_swa_bounded_replay=True), cfg=configs.mini())
    finally:
        lg.removeHandler(h)
    off = Engine(EngineArgs(**ENGINE_KW), cfg=configs.mini())
    assert on.runner.ccfg == off.runner.ccfg  # the model-level tests share both engines' compiled steps
    yield on, h.lines, off


def _fresh(eng):
    cfg, ccfg = eng.cfg, eng.runner.ccfg
    st = kvc.init_cache(cfg, ccfg)
    pad = int(np.asarray(eng.params["derived"]["engram_token_map"])[cfg.engram_pad_token_id])
    return kvc.reset_slots(st, np.arange(ccfg.max_slots + 1), pad)


def _prefill(eng, prompt, bounded):
    """`prompt` into slot 0 in chunks of W through the plain or the bounded [1, W] step. Returns (last
    chunk's logits fp32 [V], state, late-layer token count of each chunk)."""
    cfg, ccfg = eng.cfg, eng.runner.ccfg
    step = dec.jitted_extend(cfg, ccfg, late_tail=W if bounded else None)
    alloc = kvc.PageAllocator(ccfg.num_pages, ccfg.page_size, ccfg.max_pages_per_seq)
    st, pos, counts = _fresh(eng), 0, []
    lo = np.asarray([max(0, len(prompt) - W)], np.int32)
    while pos < len(prompt):
        chunk = prompt[pos:pos + W]
        alloc.ensure("r", pos + len(chunk))
        b = dec.pack_rows([{"tokens": chunk, "start": pos, "slot": 0, "page_table": alloc.pages("r")}], W, 1, ccfg)
        if bounded:
            b["tail_lo"] = lo
            counts.append(int(dec.tail_columns(b["start"], b["n_new"], lo, W)[1][0]))
        logits, st = step(eng.params, st, b)
        pos += len(chunk)
    return np.asarray(logits)[0], st, counts


def _greedy_decode(eng, st, prompt_len, first, n):
    """n greedy tokens after a prefill (plain [1, 1] steps, as the engine decodes), the first sampled from
    `first` (logits [V])."""
    cfg, ccfg = eng.cfg, eng.runner.ccfg
    alloc = kvc.PageAllocator(ccfg.num_pages, ccfg.page_size, ccfg.max_pages_per_seq)
    toks, pos, lg = [], prompt_len, first
    for _ in range(n):
        toks.append(int(np.argmax(lg)))
        alloc.ensure("r", pos + 1)
        b = dec.pack_rows([{"tokens": [toks[-1]], "start": pos, "slot": 0, "page_table": alloc.pages("r")}], 1, 1,
                          ccfg)
        lg, st = dec.jitted_extend(cfg, ccfg)(eng.params, st, b)
        lg = np.asarray(lg)[0]
        pos += 1
    return toks


def _tree_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def _rows(st, layer, slot=0):
    return jax.tree_util.tree_map(lambda a: np.asarray(a[slot, layer]), st["window"])


def test_split_is_after_the_last_store_layer(engines):
    on, _, _ = engines
    early, late = dec.split_runs(on.cfg)
    assert dec.last_store_layer(on.cfg) == 3 and [f for f, _ in late] == [4, 5]
    assert [f for f, _ in early] == list(range(4))


# ---------------------------------------------------------------------------------------------- (a)
def test_prompt_within_window_is_exact(engines):
    """Nothing is skipped when the prompt fits the window: same logits (bit for bit), same cache, same
    greedy tokens as full prefill."""
    on, _, _ = engines
    prompt = [11, 40, 7, 200, 91, 3, 150, 64]  # W tokens: tail_lo = 0
    a, sa, _ = _prefill(on, prompt, bounded=False)
    b, sb, counts = _prefill(on, prompt, bounded=True)
    assert counts == [W]
    assert np.array_equal(a, b)
    assert _tree_equal(sa, sb)
    assert _greedy_decode(on, sa, len(prompt), a, 4) == _greedy_decode(on, sb, len(prompt), b, 4)


def test_engine_greedy_equal_for_short_prompts(engines):
    """Through the engines (runner wiring: tail_lo per row, the bounded step for the prefill launch):
    prompts no longer than the window give the same greedy tokens with the flag on and off; a longer one
    runs to completion with the flag on."""
    on, _, off = engines
    short = [[5, 17, 230, 9], [44, 45, 46, 47, 48, 49, 50, 51]]
    got = [list(o.outputs[0].token_ids) for o in LLM(engine=on).generate(short, GREEDY, use_tqdm=False)]
    want = [list(o.outputs[0].token_ids) for o in LLM(engine=off).generate(short, GREEDY, use_tqdm=False)]
    assert got == want
    long = LLM(engine=on).generate([list(range(20, 50))], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(long) == GREEDY.max_tokens and all(0 <= t < on.vocab_size for t in long)


# ---------------------------------------------------------------------------------------------- (b)
def test_long_prompt_runs_late_layers_on_the_tail_only(engines):
    """A 20-token prompt in chunks of 8 (tail_lo = 12): the late layers run 0, 4 and 4 tokens (8 of 20);
    everything the early layers write equals full prefill's bit for bit; the late layers' rings hold the
    tail's W positions (all written; a chunk wholly before the tail leaves them untouched); logits and
    the next decode step are finite."""
    on, _, _ = engines
    prompt = [int(x) for x in np.random.default_rng(3).integers(3, 300, 20)]
    a, sa, _ = _prefill(on, prompt, bounded=False)
    b, sb, counts = _prefill(on, prompt, bounded=True)
    assert counts == [0, 4, 4] and sum(counts) == W
    for key in ("comp", "ikeys", "partial", "engram_hist"):
        assert _tree_equal(sa[key], sb[key]), key
    for layer in range(4):
        assert _tree_equal(_rows(sa, layer), _rows(sb, layer)), layer
    fresh = _fresh(on)
    for layer in (4, 5):
        ring, empty = _rows(sb, layer), _rows(fresh, layer)
        written = np.stack([np.any(np.asarray(x) != np.asarray(y), axis=tuple(range(1, np.ndim(x))))
                            for x, y in zip(jax.tree_util.tree_leaves(ring), jax.tree_util.tree_leaves(empty))]).any(0)
        assert written.all(), (layer, written)  # ring slot p mod W for p = 12..19: every slot
    assert np.isfinite(b).all() and b.shape == a.shape
    assert len(_greedy_decode(on, sb, len(prompt), b, 2)) == 2

    # a chunk wholly before the tail: late rings untouched, logits of that row 0
    cfg, ccfg = on.cfg, on.runner.ccfg
    alloc = kvc.PageAllocator(ccfg.num_pages, ccfg.page_size, ccfg.max_pages_per_seq)
    alloc.ensure("r", W)
    bt = dec.pack_rows([{"tokens": prompt[:W], "start": 0, "slot": 0, "page_table": alloc.pages("r")}], W, 1, ccfg)
    bt["tail_lo"] = np.asarray([12], np.int32)
    lg, s1 = dec.jitted_extend(cfg, ccfg, late_tail=W)(on.params, _fresh(on), bt)
    assert not np.asarray(lg).any()
    for layer in (4, 5):
        assert _tree_equal(_rows(s1, layer), _rows(fresh, layer))


def test_wide_chunk_traces_late_layers_at_the_tail_width(engines):
    """A [2, 32] chunk: early layers see 32 tokens per row, late layers min(32, W) = 8 (shapes of the
    traced step, nothing compiled); tail_columns picks the last tokens at or after tail_lo."""
    on, _, _ = engines
    cfg, ccfg = on.cfg, on.runner.ccfg
    T = 32
    batch = {"tokens": np.zeros((2, T), np.int32), "start": np.asarray([0, 40], np.int32),
             "n_new": np.asarray([30, 5], np.int32), "slot": np.asarray([0, 1], np.int32),
             "page_table": np.ones((2, ccfg.max_pages_per_seq), np.int32), "tail_lo": np.asarray([26, 0], np.int32)}
    out = jax.eval_shape(lambda p, s, b: dec.extend_bounded(p, s, b, cfg, ccfg, W, return_aux=True),
                         on.params, _fresh(on), batch)
    aux = out[2]
    assert out[0].shape == (2, cfg.vocab_size)
    for layer in range(cfg.num_hidden_layers):
        assert aux["layer_inputs"][layer].shape[1] == (W if layer > dec.last_store_layer(cfg) else T), layer
    cols, count = dec.tail_columns(batch["start"], batch["n_new"], batch["tail_lo"], W)
    assert np.asarray(count).tolist() == [4, 5]
    assert np.asarray(cols)[0, :4].tolist() == [26, 27, 28, 29] and np.asarray(cols)[1, :5].tolist() == list(range(5))
    # more tail tokens than the width: the last W of them
    cols, count = dec.tail_columns(np.asarray([0]), np.asarray([30]), np.asarray([0]), W)
    assert int(count[0]) == W and np.asarray(cols)[0].tolist() == list(range(22, 30))


# ---------------------------------------------------------------------------------------------- (c)
def test_prompt_logprobs_refused_by_engine_and_llm(engines):
    on, lines, off = engines
    assert any("SWA bounded replay ON" in m and "prompt logprobs are refused" in m for m in lines), lines
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    with pytest.raises(EngineError, match="refused with --enable-decoder-swa-bounded-replay"):
        on.add_request("plp", [5, 6, 7], sp)
    with pytest.raises(ValueError, match="prompt_logprobs: refused"):
        LLM(engine=on).generate([[5, 6, 7]], sp, use_tqdm=False)
    assert on.allocator.free_pages == on.allocator.capacity


def test_prompt_logprobs_refused_over_http(engines):
    import httpx

    from dsv41_jax.serving.async_engine import AsyncEngine
    from dsv41_jax.serving.engine import QueueFullError
    from dsv41_jax.serving.server import ServerConfig, build_app

    on, _, _ = engines
    ae = AsyncEngine(on)
    try:
        cfg = ServerConfig(model_name="tiny", context_length=on.context_length, vocab_size=on.vocab_size,
                           reasoning_parser=None, tool_call_parser=None)
        app = build_app(ae, on.tokenizer, cfg, queue_full_errors=(QueueFullError,), bad_request_errors=(EngineError,))

        async def main():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return await c.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1,
                                                             "echo": True, "logprobs": 1})

        r = asyncio.run(main())
    finally:
        ae.shutdown()
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] == BOUNDED_REPLAY_PLP_REFUSAL and err["type"] == "invalid_request_error"


# ---------------------------------------------------------------------------------------------- (d)
def test_flag_parses_and_is_documented():
    from dsv41_jax.serve import build_parser

    p = build_parser()
    assert "--enable-decoder-swa-bounded-replay" in p.format_help()
    args = EngineArgs.from_cli_args(p.parse_args(["--enable-decoder-swa-bounded-replay", "--disable-radix-cache"]))
    assert args.enable_decoder_swa_bounded_replay is True
    assert EngineArgs.from_cli_args(p.parse_args([])).enable_decoder_swa_bounded_replay is False
    assert "--enable-decoder-swa-bounded-replay" in EngineArgs(**ENGINE_KW, enable_decoder_swa_bounded_replay=True).cli_flags()
    ap = argparse.ArgumentParser()
    EngineArgs.add_cli_args(ap)
    assert "prompt logprobs" in ap.format_help().replace("\n", " ").replace("  ", " ")


@pytest.mark.parametrize("extra, why", [
    (dict(disable_radix_cache=False), "--disable-radix-cache"),
    (dict(speculative_algorithm="DSPARK"), "DSPARK"),
    (dict(tp_size=2), "--tp-size"),
])
def test_unsupported_combinations_refused_at_startup(extra, why):
    kw = dict(ENGINE_KW, enable_decoder_swa_bounded_replay=True, **extra)
    with pytest.raises(ValueError, match=f"enable_decoder_swa_bounded_replay: .*{why}"):
        EngineArgs(**kw)
