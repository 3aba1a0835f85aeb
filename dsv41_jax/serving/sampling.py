"""On-device, batched, jittable sampling and DSpark verification (docs/design/spec.md §7).

Host side
---------
`SamplingParams` is the per-request host dataclass, with vLLM / SGLang field names. Construction
validates (``__post_init__`` calls `SamplingParams.validate`); a bad value raises
`SamplingParamsError` (a ``ValueError``) whose ``.field`` names the offending field, so a server can
answer HTTP 400 with ``param`` set.

Device side
-----------
`SamplingTensors` is a pytree of per-slot arrays for a (padded) batch of ``B`` slots over a vocabulary
of ``V``; it holds no static fields, so any two instances of the same ``(B, V)`` trace identically
(values never cause a recompile). Build one with `SamplingTensors.from_params`, replace some slots
with `SamplingTensors.update_slots` (persistent-slot schedulers), and add generated tokens to the
penalty counts with `update_counts` (pure; call it on the tokens the step committed).

One decode step::

    tokens, logprobs, (top_ids, top_vals) = sample_jit(logits, tensors, step_counter)
    tensors = update_counts(tensors, tokens)

``step_counter[b]`` is the number of tokens request ``b`` has generated so far, i.e. the index ``i`` of
the token now being sampled. It drives `min_tokens` and the random key.

Order of operations in `sample` (as vLLM V1):

1. ``raw`` logprobs = log_softmax(logits) (before anything else; see *Logprobs* below);
2. penalties (vLLM's definition): repetition penalty on tokens seen in the prompt **or** the output
   (positive logits divided by it, negative multiplied); then frequency (``-= f * count``) and
   presence (``-= p * [count > 0]``) on output tokens only (OpenAI's definition);
3. min_tokens: while ``step_counter < min_tokens`` the slot's stop tokens (``stop_token_ids`` and, unless
   ``ignore_eos``, the EOS ids) get ``-inf``;
4. temperature: ``temperature < 1e-5`` is greedy, ``argmax`` of the logits after 2-3, ties to the lower
   id; otherwise ``logits / temperature``;
5. top_k (exactly k tokens; ties broken towards the lower id), then top_p on the distribution
   renormalised after top_k (keep the smallest prefix of the sorted tokens whose mass reaches top_p,
   i.e. token i stays iff the mass of the strictly more likely tokens is < top_p; tokens tied at the
   boundary all stay), then min_p (drop tokens whose probability is below ``min_p * max
   probability``). No full-vocabulary sort: the best `CANDIDATES` (256) tokens are found with
   ``lax.top_k`` and a row that needs more (top_k > 256, or a top_p set larger than 256 tokens) is
   done exactly by bisection on the float bit patterns, only when some row needs it;
6. one categorical draw (Gumbel-max) per row with the row's own key. An all-greedy batch skips 5-6.

Every row's result depends on that row's logits, parameters and step only (up to the floating-point
reduction order of the backend), never on the other rows. With ``deterministic=True`` (static; the
engine's --enable-deterministic-inference) the sums over the vocabulary or the candidates (the
log-softmax / softmax normalisers, top-p's masses) accumulate in fp64 and round once, so not even the
last bit depends on how many rows share the step (XLA:CPU orders an fp32 row sum by the row count).

The ``[B, V]`` count arrays make `SamplingTensors` worth keeping on the device across steps: call
`update_counts` after each step and `SamplingTensors.update_slots` when requests join or leave,
rather than rebuilding it on the host.

Randomness
----------
Each request's base key is ``key(seed)`` for the threefry2x32 implementation, built on the host as the
raw key data ``[seed >> 32, seed & 0xffffffff]`` of ``seed mod 2**64`` (identical to
``jax.random.key(seed, impl="threefry2x32")`` for ``0 <= seed < 2**31``, and for any seed with x64).
The key for the request's ``i``-th generated token is ``fold_in(key(seed), i)`` (`step_keys`). Nothing
depends on the slot index or the batch size, so a request samples the same tokens wherever it sits.
A request with ``seed=None`` gets a random seed on the host; call `SamplingParams.with_resolved_seed`
once at admission so a preempted request resumes its stream identically (the offsets stay the
request's own token indices). With ``n > 1``, `SamplingParams.child_params` gives child ``j`` the seed
``seed + j`` (as vLLM does), so the n samples differ but are reproducible.

Logprobs
--------
By default (``logprobs_mode="raw"``, vLLM V1's default ``raw_logprobs``) the returned logprob of the
sampled token and the top-K logprobs are those of the **raw model distribution**
``log_softmax(logits)``: before penalties, min_tokens masking, temperature and filtering. With
``logprobs_mode="processed"`` they are taken from the distribution actually sampled from (after
penalties, masking, temperature, top-k / top-p / min-p; greedy rows: after penalties and masking).
``max_logprobs`` (static, default 20 as vLLM's engine limit) fixes K; the scheduler slices each
request's own ``logprobs`` count on the host.

Speculative decoding (DSpark, docs/design/spec.md §7)
--------------------------------------
`greedy_verify` and `speculative_sample_verify` are the bare rules. `target_verify_logits` applies a
slot's penalties (counting the draft prefix of each verification row) and min_tokens to the target's
``[B, γ+1, V]`` logits; `spec_verify` adds temperature / filters and does a mixed greedy / sampled
batch in one call. `processed_probs` gives the ``[B, V]`` distribution `sample` draws from (usable as
the draft's q when the draft samples with the request's parameters; draw it with
``step_keys(tensors, step, salt=...)`` so its randomness is separate from the verifier's). The sampled path is lossless (tokens are distributed
exactly as plain sampling from the processed target distribution) but draws different random numbers
than plain decoding, so with a fixed seed speculative and plain decoding give different (equally
distributed) samples. Token outputs are padded with -1 after the committed ones.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model.numerics import DETERMINISTIC, exp_f32, sum_f32, x64_scope

__all__ = [
    "SAMPLING_EPS",
    "SamplingParams",
    "SamplingParamsError",
    "SamplingTensors",
    "apply_penalties",
    "greedy_verify",
    "log_softmax",
    "processed_probs",
    "sample",
    "sample_jit",
    "spec_verify",
    "speculative_sample_verify",
    "step_keys",
    "stop_token_hit",
    "target_verify_logits",
    "update_counts",
]

SAMPLING_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)
KEY_IMPL = "threefry2x32"
_NEG_INF = float("-inf")
CANDIDATES = 256  # top_k / top_p work on this many best tokens first (exact fallback beyond)


# ----------------------------------------------------------------------------------------------------
# Host-side parameters
# ----------------------------------------------------------------------------------------------------


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; ``.field`` names it (the server's HTTP 400 ``param``)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_num(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


@dataclass
class SamplingParams:
    """Per-request sampling parameters (vLLM / SGLang field names and defaults).

    ``top_k`` of 0 or -1 disables top-k; ``top_p=1``, ``min_p=0`` and penalties of 0 / 1 are off.
    ``max_tokens=None`` lets the engine stop at the context length. ``logprobs=None`` returns no
    logprobs, ``0`` only the sampled token's, ``k`` also the top-k. ``stop`` is normalised to a list.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    # prompt logprobs (vLLM's field): None: none; k >= 0: each prompt token's logprob (the first is
    # None) and the top-k at that position, from the prefill's own logits. Allows max_tokens=0.
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    # -- validation ------------------------------------------------------------------------------
    def validate(self, *, max_logprobs: Optional[int] = None, vocab_size: Optional[int] = None) -> "SamplingParams":
        """Raise `SamplingParamsError` (a ValueError naming the field) for a bad value; return self.

        ``max_logprobs`` / ``vocab_size`` add the engine's limits when given."""

        def bad(name, msg):
            raise SamplingParamsError(name, f"{msg}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not _is_num(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0")
        if not _is_num(self.top_p) or not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < -1):
            bad("top_k", "must be -1 or 0 (disabled) or an integer >= 1")
        if not _is_num(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "must be an integer or null")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not (-2.0 <= v <= 2.0):
                bad(name, "must be in [-2, 2]")
        if (not _is_num(self.repetition_penalty) or not math.isfinite(self.repetition_penalty)
                or self.repetition_penalty <= 0):
            bad("repetition_penalty", "must be a finite number > 0")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            bad("stop", "must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            bad("stop", "must not contain an empty string")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be < vocab_size={vocab_size}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            bad("prompt_logprobs", "must be an integer >= 0 or null")
        if max_logprobs is not None and self.prompt_logprobs is not None and self.prompt_logprobs > max_logprobs:
            bad("prompt_logprobs", f"must be <= max_logprobs={max_logprobs}")
        lo = 0 if self.prompt_logprobs is not None else 1  # max_tokens=0: score the prompt alone
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < lo):
            bad("max_tokens", f"must be an integer >= {lo} or null" + ("" if lo == 0 else
                                                                        " (0 only with prompt_logprobs)"))
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            bad("logprobs", "must be an integer >= 0 or null")
        if max_logprobs is not None and self.logprobs is not None and self.logprobs > max_logprobs:
            bad("logprobs", f"must be <= max_logprobs={max_logprobs}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                bad(name, "must be a boolean")
        return self

    # -- helpers -----------------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def replace(self, **kw) -> "SamplingParams":
        return dataclasses.replace(self, **kw)

    def with_resolved_seed(self) -> "SamplingParams":
        """A copy whose ``seed`` is fixed (a fresh random 63-bit seed if it was None).

        Call once when a request is admitted, so that resume-by-recompute continues the same stream."""
        if self.seed is not None:
            return self
        return self.replace(seed=random.SystemRandom().getrandbits(63))

    def child_params(self) -> list["SamplingParams"]:
        """The ``n`` single-sample requests of an ``n > 1`` request (vLLM's rule: child j gets
        ``seed + j`` when a seed is given, else its own random seed)."""
        out = []
        for j in range(self.n):
            seed = None if self.seed is None else self.seed + j
            out.append(self.replace(n=1, seed=seed))
        return out

    def all_stop_token_ids(self, eos_token_ids: Sequence[int] = ()) -> list[int]:
        """Token ids that end the request: ``stop_token_ids`` plus the EOS ids unless ``ignore_eos``."""
        ids = list(dict.fromkeys(int(t) for t in self.stop_token_ids))
        if not self.ignore_eos:
            for t in eos_token_ids:
                if int(t) not in ids:
                    ids.append(int(t))
        return ids


# ----------------------------------------------------------------------------------------------------
# Device-side per-slot tensors
# ----------------------------------------------------------------------------------------------------


def seed_to_key_data(seed: int) -> np.ndarray:
    """Raw threefry2x32 key data of ``key(seed)``: ``[hi32, lo32]`` of ``seed mod 2**64``."""
    s = int(seed) % (1 << 64)
    return np.array([s >> 32, s & 0xFFFFFFFF], dtype=np.uint32)


_ARRAY_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "key_data", "valid", "output_counts", "prompt_mask", "stop_mask",
)


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class SamplingTensors:
    """Per-slot device arrays of a padded batch (B slots, vocabulary V). All fields are leaves.

    temperature, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty: f32 [B]
    top_k: i32 [B] (<= 0 means disabled);  min_tokens: i32 [B]
    key_data: u32 [B, 2], raw threefry2x32 data of key(seed)
    valid: bool [B] (False for padding slots; their outputs are meaningless)
    output_counts: i32 [B, V], how often each token was generated (presence / frequency / repetition)
    prompt_mask: bool [B, V], token occurs in the prompt (repetition penalty only)
    stop_mask: bool [B, V], stop_token_ids and (unless ignore_eos) EOS; masked while step < min_tokens
    """

    temperature: Any
    top_p: Any
    top_k: Any
    min_p: Any
    presence_penalty: Any
    frequency_penalty: Any
    repetition_penalty: Any
    min_tokens: Any
    key_data: Any
    valid: Any
    output_counts: Any
    prompt_mask: Any
    stop_mask: Any

    def tree_flatten(self):
        return tuple(getattr(self, f) for f in _ARRAY_FIELDS), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    def replace(self, **kw) -> "SamplingTensors":
        return dataclasses.replace(self, **kw)

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.output_counts.shape[-1]

    # -- construction --------------------------------------------------------------------------------
    @staticmethod
    def _host_rows(params_list, vocab_size, prompt_token_ids, output_token_ids, eos_token_ids):
        """numpy arrays for the given rows (None entries are padding)."""
        n = len(params_list)
        V = int(vocab_size)
        f32, i32 = np.float32, np.int32
        a = {
            "temperature": np.zeros(n, f32), "top_p": np.ones(n, f32), "top_k": np.zeros(n, i32),
            "min_p": np.zeros(n, f32), "presence_penalty": np.zeros(n, f32),
            "frequency_penalty": np.zeros(n, f32), "repetition_penalty": np.ones(n, f32),
            "min_tokens": np.zeros(n, i32), "key_data": np.zeros((n, 2), np.uint32),
            "valid": np.zeros(n, bool), "output_counts": np.zeros((n, V), i32),
            "prompt_mask": np.zeros((n, V), bool), "stop_mask": np.zeros((n, V), bool),
        }
        if prompt_token_ids is not None and len(prompt_token_ids) != n:
            raise ValueError(f"prompt_token_ids: {len(prompt_token_ids)} lists for {n} slots")
        if output_token_ids is not None and len(output_token_ids) != n:
            raise ValueError(f"output_token_ids: {len(output_token_ids)} lists for {n} slots")

        def ids_array(ids, what):
            arr = np.asarray(list(ids) if ids is not None else [], dtype=np.int64).reshape(-1)
            if arr.size and (arr.min() < 0 or arr.max() >= V):
                raise ValueError(f"{what}: token id out of range [0, {V})")
            return arr

        for i, p in enumerate(params_list):
            if p is None:
                continue
            if not isinstance(p, SamplingParams):
                raise TypeError(f"slot {i}: expected SamplingParams or None, got {type(p).__name__}")
            a["valid"][i] = True
            if p.temperature >= SAMPLING_EPS:  # greedy rows keep the no-op filters (as vLLM)
                a["temperature"][i] = p.temperature
                a["top_p"][i] = p.top_p
                a["top_k"][i] = p.top_k if p.top_k > 0 else 0
                a["min_p"][i] = p.min_p
            a["presence_penalty"][i] = p.presence_penalty
            a["frequency_penalty"][i] = p.frequency_penalty
            a["repetition_penalty"][i] = p.repetition_penalty
            a["min_tokens"][i] = p.min_tokens
            seed = p.seed if p.seed is not None else random.SystemRandom().getrandbits(63)
            a["key_data"][i] = seed_to_key_data(seed)
            stops = ids_array(p.all_stop_token_ids(eos_token_ids), "stop_token_ids")
            a["stop_mask"][i, stops] = True
            if prompt_token_ids is not None:
                a["prompt_mask"][i, ids_array(prompt_token_ids[i], "prompt_token_ids")] = True
            if output_token_ids is not None:
                np.add.at(a["output_counts"][i], ids_array(output_token_ids[i], "output_token_ids"), 1)
        return a

    @classmethod
    def from_params(
        cls,
        params_list: Sequence[Optional[SamplingParams]],
        vocab_size: int,
        pad_to: Optional[int] = None,
        *,
        prompt_token_ids: Optional[Sequence[Optional[Sequence[int]]]] = None,
        output_token_ids: Optional[Sequence[Optional[Sequence[int]]]] = None,
        eos_token_ids: Sequence[int] = (),
    ) -> "SamplingTensors":
        """Build the tensors of a batch: slot i gets ``params_list[i]`` (None = padding), slots
        ``len(params_list)..pad_to-1`` are padding (greedy, no penalties, ``valid=False``).

        ``prompt_token_ids[i]`` feeds the repetition penalty; ``output_token_ids[i]`` (tokens already
        generated, e.g. a resumed request) seeds the penalty counts. ``eos_token_ids`` join each
        slot's stop tokens unless it has ``ignore_eos``. A request with ``seed=None`` gets a fresh
        random seed here (see `SamplingParams.with_resolved_seed`)."""
        n = len(params_list)
        B = n if pad_to is None else int(pad_to)
        if n > B:
            raise ValueError(f"pad_to: {n} requests do not fit in pad_to={B}")
        plist = list(params_list) + [None] * (B - n)
        pr = None if prompt_token_ids is None else list(prompt_token_ids) + [None] * (B - n)
        out = None if output_token_ids is None else list(output_token_ids) + [None] * (B - n)
        a = cls._host_rows(plist, vocab_size, pr, out, eos_token_ids)
        return cls(**jax.device_put(dict(a)))  # host rows: no per-shape staging compile

    def update_slots(
        self,
        slots: Sequence[int],
        params_list: Sequence[Optional[SamplingParams]],
        *,
        prompt_token_ids: Optional[Sequence[Optional[Sequence[int]]]] = None,
        output_token_ids: Optional[Sequence[Optional[Sequence[int]]]] = None,
        eos_token_ids: Sequence[int] = (),
    ) -> "SamplingTensors":
        """Functional update: slot ``slots[j]`` gets ``params_list[j]`` (None frees it to padding),
        with fresh counts from ``prompt_token_ids`` / ``output_token_ids``. The scatter is jitted
        with the number of rows padded to a power of two, so few compilations happen."""
        slots = [int(s) for s in slots]
        if len(slots) != len(params_list):
            raise ValueError("update_slots: slots and params_list differ in length")
        if not slots:
            return self
        B = self.batch_size
        if any(not 0 <= s < B for s in slots):
            raise ValueError(f"update_slots: slot out of range [0, {B})")
        rows = self._host_rows(list(params_list), self.vocab_size, prompt_token_ids, output_token_ids,
                               eos_token_ids)
        m = 1 << (len(slots) - 1).bit_length()
        idx = np.full(m, B, np.int32)  # out-of-range rows are dropped by the scatter
        idx[: len(slots)] = slots
        padded = {}
        for k, v in rows.items():
            pad = np.zeros((m - v.shape[0],) + v.shape[1:], v.dtype)
            padded[k] = np.concatenate([v, pad], 0)
        return _scatter_rows(self, jax.device_put(idx), SamplingTensors(**padded))


@jax.jit
def _scatter_rows(tensors: SamplingTensors, idx, rows: SamplingTensors) -> SamplingTensors:
    return jax.tree.map(lambda a, r: a.at[idx].set(r.astype(a.dtype), mode="drop"), tensors, rows)


def update_counts(tensors: SamplingTensors, tokens, valid=None) -> SamplingTensors:
    """Add newly generated tokens to ``output_counts`` (pure, jittable).

    ``tokens``: int [B] or [B, T] (T committed tokens per slot, e.g. after speculative verification);
    negative ids (the -1 padding of the verify functions) and padding slots are ignored. ``valid``
    (bool [B] or like ``tokens``) further restricts which entries count."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim == 1:
        tokens = tokens[:, None]
    B, V = tensors.output_counts.shape
    ok = (tokens >= 0) & (tokens < V) & tensors.valid[:, None]
    if valid is not None:
        valid = jnp.asarray(valid, bool)
        ok = ok & (valid[:, None] if valid.ndim == 1 else valid)
    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], tokens.shape)
    cols = jnp.where(ok, tokens, V)  # V is out of bounds → dropped
    counts = tensors.output_counts.at[rows, cols].add(ok.astype(jnp.int32), mode="drop")
    return tensors.replace(output_counts=counts)


def stop_token_hit(tensors: SamplingTensors, tokens) -> jax.Array:
    """bool [B]: the token is one of the slot's stop tokens (stop_token_ids, EOS unless ignore_eos)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    V = tensors.stop_mask.shape[-1]
    ok = (tokens >= 0) & (tokens < V)
    hit = jnp.take_along_axis(tensors.stop_mask, jnp.clip(tokens, 0, V - 1)[:, None], axis=-1)[:, 0]
    return hit & ok


# ----------------------------------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------------------------------


def _as_keys(keys):
    """Typed key array [B] from typed keys or raw threefry data uint32 [B, 2]."""
    if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        return keys
    return jax.random.wrap_key_data(jnp.asarray(keys, jnp.uint32), impl=KEY_IMPL)


def step_keys(tensors: SamplingTensors, step_counter, salt: Optional[int] = None) -> jax.Array:
    """Typed keys [B]: ``fold_in(key(seed_b), step_counter[b])`` — the key of request b's
    ``step_counter[b]``-th generated token. ``salt`` (static) folds in once more, for other random
    streams of the same step (e.g. the DSpark draft's own sampling)."""
    base = _as_keys(tensors.key_data)
    step = jnp.asarray(step_counter, jnp.int32)
    keys = jax.vmap(jax.random.fold_in)(base, step)
    if salt is not None:
        keys = jax.vmap(lambda k: jax.random.fold_in(k, salt))(keys)
    return keys


# ----------------------------------------------------------------------------------------------------
# Logit processing
# ----------------------------------------------------------------------------------------------------


def _penalize(logits, counts, prompt_mask, presence, frequency, repetition):
    """vLLM's apply_penalties, elementwise (all arguments broadcast)."""
    seen = prompt_mask | (counts > 0)
    rep = jnp.where(seen, repetition, 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency * counts.astype(logits.dtype)
    logits = logits - presence * (counts > 0).astype(logits.dtype)
    return logits


def apply_penalties(logits, tensors: SamplingTensors):
    """Presence / frequency (output tokens) and repetition (prompt and output tokens) penalties, as
    vLLM defines them, on fp32 logits [B, V]."""
    col = lambda x: x[:, None]  # noqa: E731
    return _penalize(logits, tensors.output_counts, tensors.prompt_mask, col(tensors.presence_penalty),
                     col(tensors.frequency_penalty), col(tensors.repetition_penalty))


def _mask_min_tokens(logits, stop_mask, step_counter, min_tokens):
    block = (step_counter < min_tokens)[:, None] & stop_mask
    return jnp.where(block, _NEG_INF, logits)


def _ordered_bits(x):
    """uint32 keys with the order of the float32 values (the radix-sort transform)."""
    b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    neg = (b >> 31) == 1
    return jnp.where(neg, ~b, b | jnp.uint32(0x80000000))


def _bisect(pred, lo, hi, largest: bool):
    """Per-row binary search over uint32 keys in [lo, hi] (inclusive, [N]) for the largest key with
    ``pred`` true (pred monotone decreasing) or the smallest with it true (monotone increasing).
    32 halvings cover the whole uint32 range."""

    def body(_, c):
        lo, hi = c
        span = hi - lo
        if largest:  # invariant: pred(lo) true
            mid = lo + (span >> 1) + (span & 1)
            ok = pred(mid)
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - (span > 0).astype(jnp.uint32))
        mid = lo + (span >> 1)  # invariant: pred(hi) true
        ok = pred(mid)
        return jnp.where(ok, lo, mid + (span > 0).astype(jnp.uint32)), jnp.where(ok, mid, hi)

    lo, hi = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return lo if largest else hi


def _top_k_mask(x, k):
    """Exactly the k best tokens per row (ties broken towards the lower id); k [N] in 1..V."""
    key = _ordered_bits(x)
    lo, hi = jnp.min(key, axis=-1), jnp.max(key, axis=-1)
    # the k-th largest key: the largest t with #(key >= t) >= k
    kth = _bisect(lambda t: jnp.sum(key >= t[:, None], axis=-1) >= k, lo, hi, largest=True)[:, None]
    above = key > kth
    n_above = jnp.sum(above, axis=-1, keepdims=True)
    tie = key == kth
    tie_rank = jnp.cumsum(tie.astype(jnp.int32), axis=-1) - 1  # by increasing id
    return above | (tie & (tie_rank < k[:, None] - n_above))


def _logsumexp(x, det: bool):
    """logsumexp over the last axis, keepdims; with `det` its sum accumulates in fp64 (module doc)."""
    if not det:
        return jax.nn.logsumexp(x, axis=-1, keepdims=True)
    m = jnp.max(x, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    return m + jnp.log(sum_f32(exp_f32(x - m, DETERMINISTIC), -1, True, keepdims=True))


def log_softmax(x, det: bool = False):
    """``jax.nn.log_softmax`` over the last axis; with `det` (the deterministic mode) the normaliser's
    sum accumulates in fp64, so a row's logprobs do not depend on the other rows of the batch."""
    if not det:
        return jax.nn.log_softmax(x, axis=-1)
    m = jnp.max(x, axis=-1, keepdims=True)
    shifted = x - jnp.where(jnp.isfinite(m), m, 0.0)
    return shifted - jnp.log(sum_f32(exp_f32(shifted, DETERMINISTIC), -1, True, keepdims=True))


def _softmax(x, det: bool):
    """``jax.nn.softmax`` over the last axis; with `det` the denominator's sum is fp64."""
    if not det:
        return jax.nn.softmax(x, axis=-1)
    e = exp_f32(x - jnp.max(x, axis=-1, keepdims=True), DETERMINISTIC)
    return e / sum_f32(e, -1, True, keepdims=True)


def _cumsum(x, det: bool):
    """Inclusive cumsum over the last axis; with `det` in fp64, rounded once per entry."""
    if not det:
        return jnp.cumsum(x, axis=-1)
    with x64_scope():
        return jnp.cumsum(x.astype(jnp.float64), axis=-1).astype(jnp.float32)


def _top_p_mask(x, top_p, det: bool = False):
    """Keep token i iff the probability mass of the tokens strictly more likely than i is < top_p
    (the sorted-cumsum rule; tokens tied at the boundary are all kept). The best token always stays."""
    probs = _softmax(x, det)
    key = _ordered_bits(x)
    lo, hi = jnp.min(key, axis=-1), jnp.max(key, axis=-1)
    mass_above = lambda t: sum_f32(jnp.where(key > t[:, None], probs, 0.0), -1, det)  # noqa: E731
    # smallest t with mass_above(t) < top_p; keep key >= t
    t = _bisect(lambda t: mass_above(t) < top_p, lo, hi, largest=False)[:, None]
    return key >= t


def _filter(x, top_k, top_p, min_p, det: bool = False):
    """top_k → top_p (on the renormalised top-k distribution) → min_p; removed tokens get -inf.
    `det`: the masses' sums in fp64 (module doc).

    x: temperature-scaled logits [N, V]; top_k i32 [N] (<= 0 off); top_p f32 [N]; min_p f32 [N].

    top_k keeps exactly k tokens (ties towards the lower id). top_p keeps token i iff the mass of the
    tokens strictly more likely than i is < top_p (the sorted-cumsum rule, with tokens tied at the
    boundary all kept); the best token always stays. No full-vocabulary sort: the work is done on the
    best `CANDIDATES` tokens (``lax.top_k``), and a row whose top_k exceeds that, or whose top_p
    set is not contained in it, is done exactly by bisection over the float bit patterns (run only
    when some row needs it; every row's result depends on that row alone)."""
    N, V = x.shape
    C = min(CANDIDATES, V)
    k = jnp.where((top_k <= 0) | (top_k > V), V, top_k)
    use_k = k < V
    use_p = top_p < 1.0

    def k_and_p(x):
        rows = jnp.arange(N, dtype=jnp.int32)[:, None]
        rank = jnp.arange(C, dtype=jnp.int32)[None, :]
        cv, ci = jax.lax.top_k(x, C)  # descending; ties: lower id first
        # top-k
        small = use_k & (k <= C)
        keep_c = (rank < k[:, None]) | ~small[:, None]
        keep = jnp.zeros(x.shape, bool).at[rows, jnp.broadcast_to(ci, (N, C))].set(keep_c)
        xk = jnp.where(keep | ~small[:, None], x, _NEG_INF)
        big = use_k & ~small
        xk = jax.lax.cond(jnp.any(big),
                          lambda: jnp.where(_top_k_mask(x, k) | ~big[:, None], xk, _NEG_INF), lambda: xk)
        cv = jnp.where(keep_c, cv, _NEG_INF)  # candidates after top-k (big-k rows keep all C)
        # top-p on the renormalised top-k distribution
        pc = exp_f32(cv - _logsumexp(xk, det), DETERMINISTIC if det else 0)
        excl = _cumsum(pc, det) - pc
        first = jnp.concatenate([jnp.ones((N, 1), bool), cv[:, 1:] != cv[:, :-1]], axis=-1)
        first_idx = jax.lax.cummax(jnp.where(first, rank, 0), axis=1)
        mass_above = jnp.take_along_axis(excl, first_idx, axis=-1)
        kept = (mass_above < top_p[:, None]) | (rank == 0)
        thr = jnp.min(jnp.where(kept, cv, jnp.inf), axis=-1, keepdims=True)
        fits = (~kept[:, -1]) | (cv[:, -1] == _NEG_INF) | (C == V)
        xp = jnp.where((xk >= thr) | ~use_p[:, None], xk, _NEG_INF)
        slow = use_p & ~fits
        return jax.lax.cond(jnp.any(slow),
                            lambda: jnp.where(slow[:, None], jnp.where(_top_p_mask(xk, top_p, det), xk, _NEG_INF), xp),
                            lambda: xp)

    x = jax.lax.cond(jnp.any(use_k | use_p), k_and_p, lambda x: x, x)
    # min_p relative to the max probability: p_i >= min_p * p_max  <=>  x_i - x_max >= log(min_p)
    xmax = jnp.max(x, axis=-1, keepdims=True)
    log_min_p = jnp.log(jnp.maximum(min_p, 0.0))[:, None]  # log(0) = -inf keeps everything
    keep = (x - xmax >= log_min_p) | (min_p[:, None] <= 0.0)
    return jnp.where(keep, x, _NEG_INF)


def _scale_and_filter(x, temperature, top_k, top_p, min_p, det: bool = False):
    """For non-greedy rows: x / T then filters. Greedy rows are left as x (only their argmax is used)."""
    greedy = temperature < SAMPLING_EPS
    t = jnp.where(greedy, 1.0, temperature)[:, None]
    return _filter(x / t, top_k, top_p, min_p, det), greedy


def processed_probs(logits, tensors: SamplingTensors, step_counter, *, deterministic: bool = False) -> jax.Array:
    """The distribution `sample` draws from, fp32 [B, V] (greedy rows: one-hot at the argmax).

    Use it for the DSpark draft's q (when the draft samples with the request's parameters) or to
    inspect the filtered distribution. Penalties and min_tokens are applied."""
    x = apply_penalties(logits.astype(jnp.float32), tensors)
    x = _mask_min_tokens(x, tensors.stop_mask, jnp.asarray(step_counter, jnp.int32), tensors.min_tokens)
    filt, greedy = _scale_and_filter(x, tensors.temperature, tensors.top_k, tensors.top_p, tensors.min_p, deterministic)
    onehot = jax.nn.one_hot(jnp.argmax(x, axis=-1), x.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy[:, None], onehot, _softmax(filt, deterministic))


# ----------------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------------


def sample(logits, tensors: SamplingTensors, step_counter, *, max_logprobs: int = 20,
           logprobs_mode: str = "raw", deterministic: bool = False):
    """Sample one token per slot.

    logits: fp32 [B, V]; step_counter: int32 [B] (index of the token being generated per request).
    Returns ``(tokens int32 [B], logprobs fp32 [B], (top_ids int32 [B, K], top_vals fp32 [B, K]))``
    with ``K = min(max_logprobs, V)``, top entries sorted by decreasing logprob (ties: lower id first).
    ``max_logprobs``, ``logprobs_mode`` ("raw" | "processed") and ``deterministic`` (fp64 sums over the
    vocabulary, see the module doc) are static."""
    if logprobs_mode not in ("raw", "processed"):
        raise ValueError(f"logprobs_mode: must be 'raw' or 'processed', got {logprobs_mode!r}")
    logits = logits.astype(jnp.float32)
    B, V = logits.shape
    step_counter = jnp.asarray(step_counter, jnp.int32)

    x = apply_penalties(logits, tensors)
    x = _mask_min_tokens(x, tensors.stop_mask, step_counter, tensors.min_tokens)
    greedy_tok = jnp.argmax(x, axis=-1).astype(jnp.int32)  # first max: ties → lower id
    greedy = tensors.temperature < SAMPLING_EPS

    def draw(x):
        filt, _ = _scale_and_filter(x, tensors.temperature, tensors.top_k, tensors.top_p, tensors.min_p, deterministic)
        keys = step_keys(tensors, step_counter)
        return jax.vmap(jax.random.categorical)(keys, filt).astype(jnp.int32), filt

    # an all-greedy batch skips filtering and the random draw (per row the result is the same)
    drawn, filt = jax.lax.cond(jnp.all(greedy), lambda x: (greedy_tok, x), draw, x)
    tokens = jnp.where(greedy, greedy_tok, drawn)

    if logprobs_mode == "raw":
        lp = log_softmax(logits, deterministic)
    else:
        lp = log_softmax(jnp.where(greedy[:, None], x, filt), deterministic)
    tok_lp = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    K = min(int(max_logprobs), V)
    if K > 0:
        top_vals, top_ids = jax.lax.top_k(lp, K)
    else:
        top_vals, top_ids = jnp.zeros((B, 0), jnp.float32), jnp.zeros((B, 0), jnp.int32)
    return tokens, tok_lp, (top_ids.astype(jnp.int32), top_vals)


sample_jit = jax.jit(sample, static_argnames=("max_logprobs", "logprobs_mode", "deterministic"))


# ----------------------------------------------------------------------------------------------------
# Speculative verification (docs/design/spec.md §7)
# ----------------------------------------------------------------------------------------------------


def greedy_verify(draft, target_logits):
    """Greedy verification.

    draft int [B, γ]; target_logits [B, γ+1, V] (row j is the target's prediction after the anchor
    and d_0..d_{j-1}; pass processed logits, e.g. from `target_verify_logits`, to honour penalties).
    Accepts the longest prefix with ``d_j == argmax(target_logits[:, j])``; the bonus is the target's
    argmax at the first mismatch (or at row γ if all match).
    Returns ``n_accepted int32 [B]`` and ``next_tokens int32 [B, γ+1]``: the ``n_accepted + 1``
    committed tokens (accepted drafts then the bonus), padded with -1."""
    draft = jnp.asarray(draft, jnp.int32)
    G = draft.shape[1]
    t = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, G+1]
    match = draft == t[:, :G]
    n_acc = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    j = jnp.arange(G + 1, dtype=jnp.int32)[None, :]
    return n_acc, jnp.where(j <= n_acc[:, None], t, -1)


def speculative_sample_verify(draft, draft_probs, target_probs, keys):
    """Chain speculative sampling (lossless).

    draft int [B, γ] (d_j drawn from q_j); draft_probs q [B, γ, V]; target_probs p [B, γ+1, V];
    keys: typed keys [B] or raw threefry data uint32 [B, 2] (e.g. `step_keys(tensors, step)`).
    For j = 0..γ-1: accept d_j if ``u_j * q_j(d_j) < p_j(d_j)`` (u_j ~ U[0,1)), else draw the token
    from ``normalize(max(p_j - q_j, 0))`` and stop; if all γ are accepted draw a bonus from p_γ.
    Returns ``n_accepted int32 [B]`` and ``tokens int32 [B, γ+1]`` (committed tokens, -1 padded)."""
    draft = jnp.asarray(draft, jnp.int32)
    q = jnp.asarray(draft_probs, jnp.float32)
    p = jnp.asarray(target_probs, jnp.float32)
    B, G = draft.shape
    keys = _as_keys(keys)
    split = jax.vmap(lambda k: jax.random.split(k, 2))(keys)  # [B, 2]
    u = jax.vmap(lambda k: jax.random.uniform(k, (G,), jnp.float32))(split[:, 0])
    p_d = jnp.take_along_axis(p[:, :G], draft[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    accept = u * q_d < p_d
    n_acc = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)

    p_sel = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]  # [B, V]
    q_sel = jnp.take_along_axis(q, jnp.minimum(n_acc, G - 1)[:, None, None], axis=1)[:, 0] if G > 0 else 0.0
    bonus = (n_acc == G)[:, None]
    resid = jnp.where(bonus, p_sel, jnp.maximum(p_sel - q_sel, 0.0))
    total = jnp.sum(resid, axis=-1, keepdims=True)
    resid = jnp.where(total > 0, resid, p_sel)  # p == q numerically: fall back to p
    extra = jax.vmap(jax.random.categorical)(split[:, 1], jnp.log(resid)).astype(jnp.int32)

    j = jnp.arange(G + 1, dtype=jnp.int32)[None, :]
    draft_ext = jnp.concatenate([draft, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(j < n_acc[:, None], draft_ext, jnp.where(j == n_acc[:, None], extra[:, None], -1))
    return n_acc, tokens


def target_verify_logits(target_logits, draft, tensors: SamplingTensors, step_counter):
    """Penalties and min_tokens applied to each verification row, fp32 [B, γ+1, V].

    Row j is the distribution of the request's token ``step_counter + j``; its penalty counts include
    the draft prefix d_0..d_{j-1} (as if those tokens had been committed), and min_tokens is checked
    against ``step_counter + j``. Feed the result to `greedy_verify`, or to `processed_probs`-style
    scaling via `spec_verify`."""
    x = jnp.asarray(target_logits, jnp.float32)
    draft = jnp.asarray(draft, jnp.int32)
    B, G1, V = x.shape
    G = draft.shape[1]
    col = lambda a: a[:, None, None]  # noqa: E731
    pen = _penalize(x, tensors.output_counts[:, None, :], tensors.prompt_mask[:, None, :],
                    col(tensors.presence_penalty), col(tensors.frequency_penalty),
                    col(tensors.repetition_penalty))
    if G > 0:
        # fix up row j at the draft tokens: count' = count + #{i < j : d_i == t}
        raw_at = jnp.take_along_axis(x, jnp.broadcast_to(draft[:, None, :], (B, G1, G)), axis=-1)  # [B,G1,G]
        eq = (draft[:, :, None] == draft[:, None, :]).astype(jnp.int32)  # [B, i, i']
        before = (jnp.arange(G)[None, :] < jnp.arange(G1)[:, None]).astype(jnp.int32)  # [j, i']
        extra = jnp.einsum("bik,jk->bji", eq, before)  # [B, j, i]
        c0 = jnp.take_along_axis(tensors.output_counts, draft, axis=-1)[:, None, :]
        pm = jnp.take_along_axis(tensors.prompt_mask, draft, axis=-1)[:, None, :]
        c2 = lambda a: a[:, None, None]  # noqa: E731
        new = _penalize(raw_at, c0 + extra, pm, c2(tensors.presence_penalty),
                        c2(tensors.frequency_penalty), c2(tensors.repetition_penalty))
        bi = jnp.broadcast_to(jnp.arange(B)[:, None, None], (B, G1, G))
        ji = jnp.broadcast_to(jnp.arange(G1)[None, :, None], (B, G1, G))
        ti = jnp.broadcast_to(draft[:, None, :], (B, G1, G))
        pen = pen.at[bi, ji, ti].set(new)  # duplicates write identical values
    steps = jnp.asarray(step_counter, jnp.int32)[:, None] + jnp.arange(G1, dtype=jnp.int32)[None, :]
    block = (steps < tensors.min_tokens[:, None])[:, :, None] & tensors.stop_mask[:, None, :]
    return jnp.where(block, _NEG_INF, pen)


def spec_verify(draft, draft_probs, target_logits, tensors: SamplingTensors, step_counter, *,
                deterministic: bool = False):
    """Verify a DSpark block for a mixed batch: greedy rows (temperature 0) by `greedy_verify`, the
    others by `speculative_sample_verify` against the processed target distribution (penalties with
    the draft prefix, min_tokens, temperature, top-k / top-p / min-p) with keys
    ``step_keys(tensors, step_counter)``. ``draft_probs`` q [B, γ, V] must be the distribution the
    draft actually sampled from (ignored for greedy rows). ``deterministic``: fp64 sums (module doc).
    Returns ``(n_accepted, tokens)``."""
    x = target_verify_logits(target_logits, draft, tensors, step_counter)
    B, G1, V = x.shape
    n_g, tok_g = greedy_verify(draft, x)
    rep = lambda a: jnp.repeat(a, G1, axis=0)  # noqa: E731
    filt, _ = _scale_and_filter(x.reshape(B * G1, V), rep(tensors.temperature), rep(tensors.top_k),
                                rep(tensors.top_p), rep(tensors.min_p), deterministic)
    p = _softmax(filt, deterministic).reshape(B, G1, V)
    n_s, tok_s = speculative_sample_verify(draft, draft_probs, p, step_keys(tensors, step_counter))
    greedy = tensors.temperature < SAMPLING_EPS
    return jnp.where(greedy, n_g, n_s), jnp.where(greedy[:, None], tok_g, tok_s)
