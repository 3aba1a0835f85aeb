"""The engine's data model: requests, their samples, the outputs handed back, and the errors.

A user request is a `Group` (prompt, n samples, output kind); each sample is a `Seq`, the unit the
scheduler runs. `Seq` holds the host view the three engine parts share: the scheduler's (status, slot,
``num_cached``: tokens written to the cache counting dispatched launches, ``n_inflight``: tokens
sampled on the device and not read yet, ``spec_inflight``: a DSpark row on the device) and the output
processor's (generated ids, logprobs, detokenizer, constraint, finish reason, what was already emitted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Union

from dsv41_jax.serving.sampling import SamplingParams

__all__ = ["CompletionOutput", "EngineError", "EngineInternalError", "FINISHED", "Group", "PREEMPTION_REASONS",
           "QueueFullError", "RUNNING", "RequestOutput", "Seq", "WAITING"]


class EngineError(ValueError):
    """A request the engine cannot take (prompt too long or empty, bad token id...); HTTP 400."""


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_queued_requests`` (the server answers 503). The one definition:
    the server imports it from here."""


class EngineInternalError(RuntimeError):
    """The engine had to end an accepted request early (a scheduler fault, not the request's): the
    server answers 500 (non-streaming) or sends an error event (streaming), never a truncated 200."""


# Why a running sample was preempted (the ``reason`` label of the preemption counter):
# "decode_pages": the decode rows (new tokens, or the replay of a resumed sample) need pages the pool
#   does not have; "prefill_pages": no row could run because the admitted prefills are blocked on pages.
PREEMPTION_REASONS = ("decode_pages", "prefill_pages")



# ----------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------


@dataclass
class CompletionOutput:
    """One sample of a request. In "delta" outputs (streaming) ``text`` / ``token_ids`` /
    ``logprobs`` / ``top_logprobs`` hold only what is new since the previous output.

    logprobs: the sampled tokens' logprobs (None unless the request asked for logprobs).
    top_logprobs: per token, ``[(token_id, logprob), ...]`` of the ``logprobs`` most likely tokens.
    finish_reason: None (running), "stop" (stop token / string / constraint done), "length"
    (max_tokens or context length), "abort" (the client's abort) or "error" (the engine had to end
    the request: `RequestOutput.error` says why). stop_reason: the stop string or token id matched.
    """

    index: int
    text: str
    token_ids: list
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    logprobs: Optional[list] = None
    top_logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None
    # per token of token_ids: where its text starts in the sample's text (0 = the start of the
    # generated text; a token that adds no text, e.g. a dropped special, starts where the next one does)
    text_offsets: Optional[list] = None
    # filled by LLM.chat
    reasoning_content: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    outputs: list
    finished: bool
    metrics: dict = field(default_factory=dict)
    error: Optional[str] = None  # set when the engine ended a sample with finish_reason "error"
    # with SamplingParams.prompt_logprobs: per prompt token (len(prompt_token_ids)), None for the first,
    # else (logprob, [(token_id, logprob), ...] top-k). Set in the first output after all are computed
    # (the final one for output_kind "final").
    prompt_logprobs: Optional[list] = None
    # prompt tokens whose cache came from the prefix cache (the usage's prompt_tokens_details.cached_tokens)
    num_cached_tokens: Optional[int] = None
    # a handover request's final output: its state after the prefill (`handover.PrefilledState`)
    prefilled_state: Optional[object] = None


# ----------------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------------

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class Group:
    """A user request: the prompt and its n samples."""

    def __init__(self, rid, prompt, prompt_ids, params, n, output_kind, arrival, order):
        self.rid, self.prompt, self.prompt_ids, self.params = rid, prompt, prompt_ids, params
        self.order = order  # arrival order: the scheduling priority (older first)
        self.n, self.output_kind, self.arrival = n, output_kind, arrival
        self.arrival_perf = time.perf_counter() - max(0.0, time.time() - arrival)
        self.seqs: list = []
        self.finished_time: Optional[float] = None
        self.emitted_final = False
        self.sent_plp = False
        self.handover = False  # a prefill engine's request: export its state when it finishes (`handover`)
        self.handover_state = None  # ... the exported `handover.PrefilledState`
        self.dp_rank = 0  # data-parallel attention: the rank serving every sample of it (`dp_controller`)

    @property
    def finished(self) -> bool:
        return all(s.status == FINISHED for s in self.seqs)


class Seq:
    """One sample (the unit the scheduler runs)."""

    def __init__(self, group: Group, index: int, params: SamplingParams, detok, constraint):
        self.group, self.index, self.params, self.detok, self.constraint = group, index, params, detok, constraint
        self.key = (group.rid, index)
        self.prompt_ids = group.prompt_ids
        self.output_ids: list = []
        self.lps: list = []
        self.tops: list = []
        self.cum_lp = 0.0
        n_p = len(self.prompt_ids)
        self.want_plp = params.prompt_logprobs is not None
        self.plp: list = [None] * n_p if self.want_plp else []  # per prompt position: (lp, top)
        self.plp_missing = max(0, n_p - 1) if self.want_plp else 0
        self.status = WAITING
        self.slot: Optional[int] = None
        self.num_cached = 0  # tokens written to the cache (host view, counting dispatched launches)
        self.n_inflight = 0  # sampled on the device, not read yet
        self.cached_tokens = 0  # prompt tokens restored from the prefix cache at the last admission
        self.branch_at = 0  # prompt position of a branch point to save while prefilling (0: none; prefix_cache.py)
        self.lpm_skips = 0  # times a sample with a longer cached prefix was admitted before this one
        self.fork_src: Optional["Seq"] = None  # fork child: waiting for the source's prefix
        self.priority = (group.order, index)  # smaller runs first and is preempted last
        self.error: Optional[str] = None  # why the engine ended it (finish_reason "error")
        self.ever_admitted = False
        self.finish_reason: Optional[str] = None
        self.stop_reason: Union[int, str, None] = None
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.num_preemptions = 0
        self.prefilled = None  # a decode engine's request: the `handover.PrefilledState` it starts from
        self.spec_inflight = False  # a DSpark row of this sample is on the device (its accept length unknown)
        self.spec_steps = 0  # DSpark verify steps of this sample, and the drafts they accepted
        self.spec_accepted = 0
        # streaming: what was already emitted
        self.sent_tokens = 0
        self.delta_text = ""
        self.sent_final = False

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.n_inflight

    @property
    def n_out(self) -> int:
        return len(self.output_ids) + self.n_inflight

    def tokens(self, a: int, b: int) -> list:
        p = self.prompt_ids
        if b <= len(p):
            return list(p[a:b])
        return (list(p[a:]) if a < len(p) else []) + self.output_ids[max(0, a - len(p)): b - len(p)]
