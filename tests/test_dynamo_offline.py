"""The Dynamo integration's parts that need no Dynamo (the live tests: tests/test_dynamo.py).

* `worker.sampling_from_request`: our frontend's own `SamplingParams` travel whole; a stock Dynamo
  frontend's fields map to ours; bad values are refused.

The prefix cache's blocks as KV events for Dynamo's router (`dsv41_jax.dynamo.kv_events`):

* `KvBlockEvents` alone: shared leading blocks are stored once and removed with their last entry,
  new blocks name their parent, removals go deepest first.
* Against the radix cache on the model-checking mock engine of tests/test_prefix_cache.py: growing
  conversations, aborts, forced evictions, with and without the host tier. After every step the
  blocks the events advertise (replayed as a router would: a stored block's parent must be known, a
  removed block must be there) are exactly the full pages of the prefixes the cache can resume.
"""

import itertools

import numpy as np
import pytest
from test_prefix_cache import _check_refs, _mock_engine, tok  # noqa: F401 (tok: the fixture)

import dataclasses

from dsv41_jax.dynamo.kv_events import KvBlockEvents, block_hashes
from dsv41_jax.dynamo.worker import sampling_from_request
from dsv41_jax.serving.sampling import SamplingParams, SamplingParamsError


def test_transfer_flags_are_refused_outside_their_role(capsys):
    """--transfer-timeout (decode) and --transfer-ttl (prefill) are refused on workers of another role, never
    ignored; values must be positive."""
    from dsv41_jax.dynamo.worker import parse_args

    for argv, msg in ((["--transfer-ttl", "5"], "applies to prefill workers"),
                      (["--disaggregation-mode", "prefill", "--transfer-timeout", "5"], "applies to decode workers"),
                      (["--disaggregation-mode", "decode", "--transfer-timeout", "0"], "must be > 0")):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err, argv


def test_sampling_from_request():
    sp = SamplingParams(temperature=0.5, top_k=7, max_tokens=33, stop=["x"], seed=5, skip_special_tokens=False,
                        min_tokens=2)
    ours = {"token_ids": [1], "sampling_options": {"temperature": 1.0},
            "extra_args": {"dsv41": {"sampling": dataclasses.asdict(sp)}}}
    assert sampling_from_request(ours) == sp  # our frontend: exactly its SamplingParams
    stock = {"token_ids": [1, 2],
             "sampling_options": {"temperature": 0.0, "top_p": 0.9, "top_k": 0, "seed": 3, "n": 1,
                                  "repetition_penalty": 1.1},
             "stop_conditions": {"max_tokens": 20, "stop": ["\n\n"], "stop_token_ids_hidden": [1], "ignore_eos": True,
                                 "min_tokens": 0},
             "output_options": {"logprobs": None, "skip_special_tokens": True}}
    got = sampling_from_request(stock)
    assert (got.temperature, got.top_p, got.top_k, got.seed, got.max_tokens, got.stop, got.stop_token_ids,
            got.ignore_eos, got.repetition_penalty) == (0.0, 0.9, -1, 3, 20, ["\n\n"], [1], True, 1.1)
    assert sampling_from_request({"token_ids": [1]}).max_tokens is None  # no limit: up to the context length
    with pytest.raises(SamplingParamsError):
        sampling_from_request({"token_ids": [1], "sampling_options": {"temperature": -1}})


class Router:
    """Replays events as Dynamo's indexer keeps them: block id -> parent id."""

    def __init__(self):
        self.blocks: dict = {}
        self.events: list = []

    def __call__(self, ev):
        self.events.append(ev)
        if ev[0] == "stored":
            _, toks, nbt, hs, parent = ev
            assert sum(nbt) == len(toks) and len(nbt) == len(hs)
            assert parent is None or parent in self.blocks, "stored under an unknown parent"
            for h in hs:
                assert h not in self.blocks, "block stored twice"
                self.blocks[h] = parent
                parent = h
        else:
            for h in ev[1]:
                assert h in self.blocks, "unknown block removed"
                assert h not in self.blocks.values(), "a block removed before its children"
                del self.blocks[h]


def test_block_events_refcount_shared_prefixes():
    r = Router()
    ev = KvBlockEvents(4, r)
    a = tuple(range(10, 21))  # 11 tokens: 2 full blocks
    b = a[:8] + (99, 98, 97, 96, 95)  # shares 2 blocks, adds a third
    ev.on_tree_event("stored", a)
    ha = block_hashes(a, 4)
    assert r.events == [("stored", list(a[:8]), [4, 4], ha, None)]
    ev.on_tree_event("stored", b)
    hb = block_hashes(b, 4)
    assert hb[:2] == ha and r.events[-1] == ("stored", list(b[8:12]), [4], hb[2:], ha[1])
    ev.on_tree_event("stored", (1, 2, 3))  # no full block: nothing
    assert len(r.events) == 2
    ev.on_tree_event("removed", a)  # the shared blocks stay (b covers them)
    assert len(r.events) == 2 and ev.num_blocks == 3
    ev.on_tree_event("removed", b)
    assert r.events[-1] == ("removed", hb[::-1]) and ev.num_blocks == 0 and not r.blocks
    assert all(-(1 << 63) <= h < (1 << 63) for h in hb)  # signed 64-bit ids (the publisher's type)
    with pytest.raises(AssertionError):
        ev.on_tree_event("removed", b)


@pytest.mark.parametrize("seed,host", [(0, 0), (1, 30)])
def test_events_track_the_radix_cache(tok, seed, host):  # noqa: F811 (tok: the fixture)
    rng = np.random.default_rng(seed)
    eng = _mock_engine(tok, num_pages=16, host_pages=host)
    a, c = eng.allocator, eng.prefix_cache
    ps = a.page_size
    router = Router()
    ev = KvBlockEvents(ps, router)
    c.on_tree_event = ev.on_tree_event
    history = [rng.integers(20, 300, size=6).tolist()]
    rid_n = itertools.count()
    live: dict = {}

    def cached_blocks():
        out = set()
        for e in c.tree.entries():
            out.update(block_hashes(e.tokens, ps))
        return out

    for step in range(160):
        if rng.random() < 0.35 and len(live) < 6:
            base = history[int(rng.integers(len(history)))][:26]
            prompt = (base + rng.integers(20, 300, size=int(rng.integers(1, 5))).tolist())[:30]
            rid = f"r{next(rid_n)}"
            eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 10)),
                                                        ignore_eos=True))
            live[rid] = prompt
        if live and rng.random() < 0.05:
            eng.abort_request(sorted(live)[int(rng.integers(len(live)))])
        if rng.random() < 0.03:
            c.evict(a.capacity)
        for o in eng.step():
            if o.finished:
                history.append(live.pop(o.request_id) + list(o.outputs[0].token_ids))
        _check_refs(eng)
        assert set(router.blocks) == cached_blocks() == set(ev.refs)
    while eng.has_unfinished():
        eng.step()
    assert ev.stored_events > 5 and ev.removed_events > 0
    if host:
        assert c.spills > 0  # entries moved to the host tier stay advertised (a hit loads them back)
    c.clear_cache()
    assert not router.blocks and not ev.refs


@pytest.mark.parametrize("name,roles", [("agg.yaml", ["aggregated"]), ("disagg.yaml", ["prefill", "decode"])])
def test_deploy_manifests_run_our_worker_with_flags_it_takes(name, roles):
    """deploy/*.yaml cannot be applied here (no cluster): their worker commands are checked instead — each
    worker runs `python -m dsv41_jax.dynamo` with arguments its own parser takes, in the roles the topology
    names (the disaggregated one: a prefill and a decode worker with the same DSpark setting)."""
    import os

    import yaml

    from dsv41_jax.dynamo.worker import build_parser

    path = os.path.join(os.path.dirname(__file__), "..", "deploy", name)
    with open(path) as f:
        services = yaml.safe_load(f)["spec"]["services"]
    workers = [s for s in services.values() if s["componentType"] == "worker"]
    got = []
    for w in workers:
        c = w["extraPodSpec"]["mainContainer"]
        assert c["command"] == ["python3", "-m", "dsv41_jax.dynamo"]
        a = build_parser().parse_args([str(x) for x in c["args"]])
        got.append((a.disaggregation_mode, a.speculative_algorithm, a.tp_size, a.ep_size))
        assert w.get("subComponentType", "aggregated") == a.disaggregation_mode
    assert [g[0] for g in got] == roles
    assert len({g[1:] for g in got}) == 1  # one DSpark setting and mesh for every role
