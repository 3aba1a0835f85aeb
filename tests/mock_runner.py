"""A model-free runner: `Engine(runner=MockRunner(...))` is the real engine (scheduler, output
processor, detokenizer, stops, n > 1, logprobs) without a model or a device, as JetStream's mock engine.

It is driven by the messages alone (`messages.Schedule` in, `messages.StepResult` out; it never sees a
`Seq`). A sampled token is a fixed function of (request id, sample index, position) -- `token_at` by
default, or a script given as ``tokens(row, pos)`` (``row``: the launch's `messages.Row`, whose
``req_id``, ``index`` and ``prompt_len`` it may read) -- so a request's tokens do not depend on
batching, chunking, preemption or speculation. Logprobs are fixed too: the sampled token's is
``-pos / 100`` and the top-k are the token itself and the ids after it, each 1 lower; prompt logprobs
(echo) likewise.
"""

import zlib

import numpy as np

from dsv41_jax.serving.messages import ForkOp, LaunchResult, SpecLaunch, StepResult
from dsv41_jax.serving.runner import SharedPageAllocator

V = 320


def token_at(row, pos: int) -> int:
    """The mock model's token at position pos of a sample (never an EOS / special id: 10..209); ``row``:
    anything with ``req_id`` and ``index`` (a launch row)."""
    return token_for(row.req_id, row.index, pos)


def token_for(req_id: str, index: int, pos: int) -> int:
    """`token_at` for sample ``index`` of request ``req_id`` (what a test expects)."""
    return 10 + (pos * 7 + zlib.crc32(req_id.encode()) % 997 * 13 + index * 5) % 200


def mock_logprob(pos: int) -> float:
    """The logprob the mock gives the token at position ``pos`` (sampled or prompt)."""
    return -pos / 100


def mock_top(tok: int, pos: int, k: int) -> list:
    """The mock's top-k at position ``pos`` whose first entry is ``tok``: [(id, logprob)]."""
    return [((tok + j) % V, mock_logprob(pos) - j) for j in range(k)]


class MockRunner:
    """The runner's interface, no model. Records every schedule and its result (``self.log``: [(Schedule,
    StepResult)]).

    accept(row, start) -> n: how many drafts a DSpark row accepts (its tokens are `token_at`, so the
    outputs equal those without speculation); tokens(row, pos) -> id: the token sampled at ``pos``."""

    def __init__(self, *, num_pages=33, page_size=8, max_pages_per_seq=8, max_slots=4, spec_gamma=0, accept=None,
                 tokens=None):
        self.allocator = SharedPageAllocator(num_pages, page_size, max_pages_per_seq)
        self.prefix_cache = None  # (the prefix cache's paths: tests/test_prefix_cache.py's CheckingRunner)
        self.max_slots, self.scratch = max_slots, max_slots
        self.context_length = page_size * max_pages_per_seq
        self.vocab_size, self.max_logprobs = V, 5
        self.spec_gamma = spec_gamma
        self.accept = accept or (lambda row, start: 0)
        self.tokens = tokens or token_at
        self.launches = 0
        self.log: list = []

    def warmup(self, batch_buckets, token_buckets, prompt_logprobs=False) -> int:
        return 0

    def num_compilations(self) -> int:
        return 0

    def execute(self, schedule) -> StepResult:
        results = []
        for op in schedule.ops:
            if isinstance(op, ForkOp):
                continue
            self.launches += 1
            # every row's pages are its own or shared read-only, and cover what the row writes
            for r in op.rows:
                assert len(r.pages) * self.allocator.page_size >= r.start + r.n
            assert len({r.slot for r in op.rows}) == len(op.rows)  # one row per slot
            results.append(self._spec(op) if isinstance(op, SpecLaunch) else self._plain(op))
        out = StepResult(tuple(results))
        self.log.append((schedule, out))
        return out

    def _spec(self, op) -> LaunchResult:
        g = op.gamma
        toks = np.full((op.B, g + 1), -1, np.int32)
        n_acc = np.zeros((op.B,), np.int32)
        for b, r in enumerate(op.rows):
            n = min(self.accept(r, r.start), g)
            n_acc[b] = n
            toks[b, :n + 1] = [self.tokens(r, r.start + 1 + j) for j in range(n + 1)]
        return LaunchResult(tokens=toks, n_accept=n_acc)

    def _plain(self, op) -> LaunchResult:
        K = self.max_logprobs
        plp = None
        if op.want_plp:  # prompt logprobs: position j of the chunk scores prompt token start + j + 1
            lp = np.zeros((op.B, op.T), np.float32)
            ids = np.zeros((op.B, op.T, K), np.int32)
            vals = np.zeros((op.B, op.T, K), np.float32)
            for b, r in enumerate(op.rows):
                for j, t in enumerate(r.plp_targets or ()):
                    pos = r.start + j + 1
                    if pos < r.prompt_len:
                        top = mock_top(t, pos, K)
                        lp[b, j] = mock_logprob(pos)
                        ids[b, j], vals[b, j] = [t for t, _ in top], [v for _, v in top]
            plp = (lp, ids, vals)
        toks = np.zeros((op.B,), np.int32)
        lp = np.zeros((op.B,), np.float32)
        top_ids = np.zeros((op.B, K), np.int32)
        top_vals = np.zeros((op.B, K), np.float32)
        for b, r in enumerate(op.rows):
            if r.sample:
                pos = r.start + r.n
                toks[b] = self.tokens(r, pos)
                lp[b] = mock_logprob(pos)
                top = mock_top(int(toks[b]), pos, K)
                top_ids[b], top_vals[b] = [t for t, _ in top], [v for _, v in top]
        return LaunchResult(toks, lp, top_ids, top_vals, plp=plp)
