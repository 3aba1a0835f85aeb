"""The output processor: reads launch results and turns tokens into request outputs.

It consumes what the runner returned for a schedule (`messages.StepResult`, one `LaunchResult` per
launch) with the samples the scheduler planned each launch row for (`scheduler.Planned.seqs`). For
each processed launch it appends the sampled tokens to their samples — a plain row gives one
token, a DSpark row gives n_accept + 1 (accepted drafts then the bonus), appended one at a time so
stop tokens, stop strings, max_tokens, the context length and constraints end the sample at the
right token and the tokens after it are dropped (they were committed to the cache, which is freed
with the sample). It detokenizes incrementally (`tokenizer.IncrementalDetokenizer`, one per
sample: the one detokenizer, whose text and text offsets the server uses), keeps logprobs,
finishes samples (releasing their pages and slot through the scheduler), builds `RequestOutput`s
("final" or "delta"), and keeps the metrics: latencies, throughput, DSpark accept lengths (per
step, per request, histogram), the decode log line and `stats()` for ``/metrics``.
"""

from __future__ import annotations

import collections
import logging
import time
import numpy as np

from dsv41_jax.serving.request import FINISHED, RUNNING, CompletionOutput, Group, RequestOutput, Seq

__all__ = ["OutputProcessor"]

log = logging.getLogger("dsv41_jax.engine")


class OutputProcessor:
    """Launch results -> samples' tokens / text / finish, and `RequestOutput`s (see the module docstring).

    scheduler: releases a finished sample's pages and slot (`Scheduler.release`) and takes DSpark
    results (`Scheduler.spec_done`); allocator: for the usage figures; metrics: the engine's counters
    (`EngineMetrics`, counted into); spec_gamma: DSpark proposals per step (0: off)."""

    def __init__(self, scheduler, allocator, *, page_size: int, context_length: int, eos_token_ids: tuple,
                 metrics, decode_log_interval: int, spec_gamma: int = 0):
        self.scheduler, self.allocator = scheduler, allocator
        self.page_size, self.context_length = page_size, context_length
        self.eos_token_ids = eos_token_ids
        self.metrics = metrics
        self.decode_log_interval = decode_log_interval
        self.spec_gamma = spec_gamma
        self.groups: dict = {}
        self.touched: dict = {}
        self.n_processed = 0  # launches whose tokens were read (progress detection)
        self.decode_iters = 0
        self._last_log = (time.perf_counter(), 0, 0, 0)  # time, generation tokens, spec row-steps, accepted
        self.ttft = collections.deque(maxlen=10000)
        self.itl = collections.deque(maxlen=100000)
        self.e2e = collections.deque(maxlen=10000)
        self._gen_times = collections.deque(maxlen=4096)  # (time, tokens) per processed launch
        # DSpark: per accept count n (0..γ), how many row-steps accepted n drafts (committing n + 1)
        self.spec_hist = [0] * (spec_gamma + 1)

    # ------------------------------------------------------------------------------------ results
    def process(self, steps: list) -> None:
        """Read the results of executed schedules: ``steps`` is [(`scheduler.Planned`, `messages.StepResult`)],
        oldest first; each launch's result goes to the samples of its rows (`Planned.seqs`)."""
        launches = [(L, seqs, res) for planned, result in steps
                    for L, seqs, res in zip(planned.schedule.launches, planned.seqs, result.launches)]
        now = None
        n_tok = 0
        decode = any(L.spec or L.T == 1 for L, _, _ in launches)
        for L, seqs, res in launches:
            self.n_processed += 1
            if res.plp is not None:
                self._process_prompt_logprobs(L, seqs, res.plp)
            if res.tokens is None:
                continue
            if L.spec:
                now = time.perf_counter()
                n_tok += self._process_spec(L, seqs, res, now)
                continue
            toks = np.asarray(res.tokens)
            lps = np.asarray(res.lp)
            top_ids = np.asarray(res.top_ids) if L.want_top else None
            top_vals = np.asarray(res.top_vals) if L.want_top else None
            now = time.perf_counter()
            for b, (r, s) in enumerate(zip(L.rows, seqs)):
                if not r.sample:
                    continue
                s.n_inflight -= 1
                if s.status != RUNNING:
                    continue
                top = None
                k = s.params.logprobs
                if k and top_ids is not None:
                    top = [(int(top_ids[b, j]), float(top_vals[b, j])) for j in range(k)]
                self.append_token(s, int(toks[b]), float(lps[b]), top, now)
                n_tok += 1
        if n_tok:
            self._gen_times.append((now, n_tok))
            self.metrics.add("generation_tokens", n_tok)
        if decode:
            self.decode_iters += 1
            self.scheduler.decode_iteration_done()
            if self.decode_log_interval and self.decode_iters % self.decode_log_interval == 0:
                self.log_decode()

    def _process_spec(self, L, seqs, res, now: float) -> int:
        """A DSpark launch: row b committed n_accept[b] + 1 tokens; append them one by one (a stop ends
        the sample there) and count the accept length. Returns the tokens appended."""
        toks = np.asarray(res.tokens)
        n_acc = np.asarray(res.n_accept)
        n_tok = 0
        for b, (r, s) in enumerate(zip(L.rows, seqs)):
            if s is None:
                continue  # a dp rank's padding row
            n = int(n_acc[b])
            self.scheduler.spec_done(s, r.start, n + 1)
            self.spec_hist[n] += 1
            self.metrics.add("spec_verify_steps", 1)
            self.metrics.add("spec_accepted_tokens", n)
            self.metrics.add("spec_draft_tokens", L.gamma)
            s.spec_steps += 1
            s.spec_accepted += n
            for t in toks[b, : n + 1]:
                if s.status != RUNNING or (s.params.max_tokens is not None and len(s.output_ids) >= s.params.max_tokens):
                    break
                self.append_token(s, int(t), 0.0, None, now)
                n_tok += 1
        return n_tok

    def _process_prompt_logprobs(self, L, seqs, plp) -> None:
        """Store a launch's prompt logprobs in its samples (position j of a chunk starting at `start`
        scores prompt token start + j + 1); a max_tokens=0 sample ends once it has them all."""
        lp, ids, vals = (np.asarray(a) for a in plp)
        for b, (r, s) in enumerate(zip(L.rows, seqs)):
            if s is None or not s.want_plp or r.sample or r.replay or s.status != RUNNING:
                continue
            k = s.params.prompt_logprobs
            for j in range(r.n):
                pos = r.start + j + 1
                if s.plp[pos] is None:
                    s.plp_missing -= 1
                s.plp[pos] = (float(lp[b, j]), [(int(ids[b, j, q]), float(vals[b, j, q])) for q in range(k)])
            self.touched[s.group.rid] = s.group
            if s.plp_missing == 0 and s.params.max_tokens == 0:
                self.finish(s, "length")

    def append_token(self, s: Seq, tok: int, lp: float, top, now: float) -> None:
        p = s.params
        s.output_ids.append(tok)
        if p.logprobs is not None:
            s.lps.append(lp)
            s.tops.append(top or [])
            s.cum_lp += lp
        if s.first_token_time is None:
            s.first_token_time = now
            self.ttft.append(now - s.group.arrival_perf)
        else:
            self.itl.append(now - s.last_token_time)
        s.last_token_time = now
        self.touched[s.group.rid] = s.group
        if s.constraint is not None:
            s.constraint.accept(tok)
        idx = len(s.output_ids) - 1
        if tok in s.params.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            if idx >= p.min_tokens:
                s.stop_reason = tok
                self.finish(s, "stop")
                return
        s.delta_text += s.detok.add(tok)
        if s.detok.stopped:
            s.stop_reason = s.detok.stop_str
            self.finish(s, "stop")
        elif p.max_tokens is not None and len(s.output_ids) >= p.max_tokens:
            self.finish(s, "length")
        elif len(s.prompt_ids) + len(s.output_ids) >= self.context_length:  # (not counting in-flight tokens)
            self.finish(s, "length")
        elif s.constraint is not None and s.constraint.is_done():
            self.finish(s, "stop")

    def finish(self, s: Seq, reason: str) -> None:
        if s.status == FINISHED:
            return
        if reason != "stop" or s.detok.stop_str is None:
            s.delta_text += s.detok.finish()
        s.finish_reason = reason
        self.scheduler.release(s)
        s.status = FINISHED
        self.scheduler.orphan_children(s)  # fork children of an aborted source prefill themselves
        g = s.group
        self.touched[g.rid] = g
        if g.finished:
            g.finished_time = time.perf_counter()
            self.e2e.append(g.finished_time - g.arrival_perf)
            if reason not in ("abort", "error"):
                self.metrics.add("requests_finished", 1)

    # ------------------------------------------------------------------------------------ outputs
    def _completion(self, s: Seq, delta: bool) -> CompletionOutput:
        want_lp = s.params.logprobs is not None
        if delta:
            a = s.sent_tokens
            text, s.delta_text = s.delta_text, ""
        else:
            a = 0
            text = s.detok.text
            s.delta_text = ""
        ids = s.output_ids[a:]
        s.sent_tokens = len(s.output_ids)
        # the stop token that ended the sample was never detokenized: it starts where the text ends
        offs = s.detok.offsets[a:len(s.output_ids)]
        offs += [len(s.detok.text)] * (len(ids) - len(offs))
        return CompletionOutput(
            index=s.index, text=text, token_ids=list(ids), finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            logprobs=list(s.lps[a:]) if want_lp else None, top_logprobs=list(s.tops[a:]) if want_lp else None,
            cumulative_logprob=s.cum_lp if want_lp else None, text_offsets=offs)

    def emit(self) -> list:
        out = []
        for rid, g in self.touched.items():
            fin = g.finished
            if g.output_kind == "final":
                if not fin or g.emitted_final:
                    continue
                comps = [self._completion(s, False) for s in g.seqs]
            else:
                comps = [self._completion(s, True) for s in g.seqs
                         if s.sent_tokens < len(s.output_ids) or s.delta_text or
                         (s.status == FINISHED and not s.sent_final)]
                for s in g.seqs:
                    if s.status == FINISHED:
                        s.sent_final = True
                if not comps and not fin:
                    continue
            if fin:
                g.emitted_final = True
                self.groups.pop(rid, None)
            error = next((s.error for s in g.seqs if s.error), None)
            plp = None
            s0 = g.seqs[0]
            if s0.want_plp and s0.plp_missing == 0 and not g.sent_plp:
                plp, g.sent_plp = list(s0.plp), True
            out.append(RequestOutput(rid, g.prompt, g.prompt_ids, comps, fin, self.group_metrics(g), error, plp,
                                     num_cached_tokens=max(s.cached_tokens for s in g.seqs),
                                     prefilled_state=g.handover_state if fin else None))
        self.touched = {}
        return out

    def group_metrics(self, g: Group) -> dict:
        firsts = [s.first_token_time for s in g.seqs if s.first_token_time is not None]
        m = {"arrival_time": g.arrival, "ttft_s": (min(firsts) - g.arrival_perf) if firsts else None,
             "e2e_s": (g.finished_time - g.arrival_perf) if g.finished_time is not None else None,
             "prompt_tokens": len(g.prompt_ids),
             "completion_tokens": sum(len(s.output_ids) for s in g.seqs),
             "num_preemptions": sum(s.num_preemptions for s in g.seqs)}
        if self.spec_gamma:
            steps = sum(s.spec_steps for s in g.seqs)
            acc = sum(s.spec_accepted for s in g.seqs)
            m.update(spec_verify_steps=steps, spec_accepted_tokens=acc,
                     spec_accept_length=(1.0 + acc / steps) if steps else None)
        return m

    # ------------------------------------------------------------------------------------ metrics
    def throughput(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last `window` seconds."""
        if not self._gen_times:
            return 0.0
        now = time.perf_counter()
        pts = [(t, n) for t, n in self._gen_times if now - t <= window]
        if len(pts) < 2:
            return 0.0
        span = pts[-1][0] - pts[0][0]
        return sum(n for _, n in pts[1:]) / span if span > 0 else 0.0

    def spec_summary(self) -> dict:
        """DSpark figures since start: accept length (committed tokens per row-step = 1 + accepted
        drafts, SGLang's "accept len"), accept rate (accepted / proposed drafts), the histogram."""
        m = self.metrics
        steps = m["spec_verify_steps"]
        return {"spec_accept_length": (1.0 + m["spec_accepted_tokens"] / steps) if steps else 0.0,
                "spec_accept_rate": (m["spec_accepted_tokens"] / m["spec_draft_tokens"]) if m["spec_draft_tokens"]
                else 0.0, "spec_accept_hist": list(self.spec_hist)}

    def log_decode(self, num_running: int = 0, num_waiting: int = 0) -> None:
        t, n0, s0, a0 = self._last_log
        now = time.perf_counter()
        m = self.metrics
        gen = m["generation_tokens"]
        tput = (gen - n0) / (now - t) if now > t else 0.0
        self._last_log = (now, gen, m["spec_verify_steps"], m["spec_accepted_tokens"])
        a = self.allocator
        sched = self.scheduler
        spec = ""
        if self.spec_gamma:  # over this log interval
            ds, da = m["spec_verify_steps"] - s0, m["spec_accepted_tokens"] - a0
            spec = (f", accept len: {(1.0 + da / ds) if ds else 0.0:.2f}, accept rate: "
                    f"{(da / (ds * self.spec_gamma)) if ds else 0.0:.2f}")
        log.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
                 "#queue-req: %d, #preempted: %d (%s)%s", len(sched.running), a.used_pages * self.page_size,
                 a.used_pages / a.capacity, tput, sched.num_waiting, m["num_preemptions"],
                 ", ".join(f"{r} {n}" for r, n in self.metrics.preemptions.items()), spec)
