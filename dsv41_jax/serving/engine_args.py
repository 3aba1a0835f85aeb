"""Engine arguments: one dataclass shared by the offline `LLM`, the scheduler and the server CLI.

Flags use SGLang's spelling where the meaning is the same (docs/design/spec.md §11): ``--max-running-requests``,
``--chunked-prefill-size``, ``--max-prefill-tokens``, ``--mem-fraction-static``, ``--page-size``,
``--context-length``, ``--kv-cache-dtype``, ``--max-total-tokens``, ``--tp-size``/``--tp``,
``--ep-size``/``--ep``, ``--dtype``, ``--random-seed``/``--seed``, ``--decode-log-interval``,
``--max-queued-requests``, ``--enable-mixed-chunk``, ``--disable-overlap-schedule``,
``--skip-server-warmup``, ``--speculative-algorithm`` (DSPARK), ``--enable-deterministic-inference``,
``--enable-dp-attention`` / ``--dp-size`` (vLLM's ``--data-parallel-size`` an alias), ``--load-balance-method``. Ours: ``--batch-buckets``, ``--token-buckets``, ``--shape-buckets``,
``--max-logprobs``, ``--disable-prefix-sharing``, ``--disable-radix-cache``, ``--radix-cache-snapshots``, ``--enable-hierarchical-cache``,
``--hicache-ratio``, ``--cpu-memory-budget``, ``--enable-decoder-swa-bounded-replay`` (SGLang's name), ``--impl`` (which
implementation each op with a fast path runs, `dsv41_jax.model.dispatch`; default "auto"),
``--speculative-dspark-block-size`` (DSpark proposals per step, 1..5, at most the checkpoint's block),
``--speculative-simulate-accept-length`` (performance runs only),
``--warmup-prompt-logprobs`` (the warm-up compiles the prompt-logprobs variant too).
vLLM's spellings are aliases: ``--max-model-len`` (``--context-length``), ``--tensor-parallel-size``
(``--tp-size``), ``--max-num-seqs`` (``--max-running-requests``).

Small models (under ``SMALL_MODEL_BYTES`` of weights, e.g. the embedded tiny model) get smaller
defaults: 4 running requests, 64-token prefill chunks and "compact" shape buckets (one batch size x
tokens 1 and the chunk: 2 compiled shapes instead of 6 to 18). Each shape costs ~17 s of CPU to
compile on this project's 2-core VM, which makes up most of a small model's first start, while
what more buckets save is milliseconds: a lone request padded to batch 4 decodes a few times slower
than at batch 1 (tiny model, measured under heavy load: 16 ms per step at batch 1, 64 ms at batch 8).
The small batch and chunk keep the padded prefill launch small too ([4, 64] = 256 token rows;
[8, 128] took ~4 s per step under the same load).
``--shape-buckets full`` or explicit ``--batch-buckets`` / ``--token-buckets`` restore more shapes.

Use::

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args())

`EngineArgs(**kw)` (the `LLM(...)` keyword arguments) validates on construction and raises
``ValueError`` naming the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["EngineArgs", "DTYPES", "KV_CACHE_DTYPE_CHOICES", "LOAD_BALANCE_METHODS", "SHAPE_BUCKETS", "SMALL_MODEL_BYTES", "model_is_small"]

# --dtype: the activation dtype of the model (weights keep their checkpoint formats).
DTYPES = {"auto": "bfloat16", "bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32",
          "float": "float32", "fp32": "float32", "exact": "exact"}
KV_CACHE_DTYPE_CHOICES = {"auto": "auto", "fp8_e4m3": "fp8_e4m3", "bfloat16": "bfloat16", "bf16": "bfloat16",
                          "float32": "float32"}


SHAPE_BUCKETS = ("auto", "compact", "full")
# --load-balance-method: how the DP controller picks a new request's rank (serving/dp_controller.py)
LOAD_BALANCE_METHODS = ("cache_aware", "round_robin", "shortest_queue")
SPECULATIVE_ALGORITHMS = ("DSPARK", "EAGLE", "NEXTN")  # EAGLE / NEXTN: DeepSeek-V4's MTP layer (SGLang's spelling)
MTP_ALGORITHMS = ("EAGLE", "NEXTN")
MTP_DEFAULT_STEPS = 3  # SGLang's V4 recipe: --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
MTP_MAX_STEPS = 8
DEFAULT_DISTRIBUTION_FILE = "expert_distribution.json"  # --expert-distribution-recorder-file's default
DSPARK_MAX_BLOCK = 5  # docs/design/spec.md §7: the largest DSpark block (V4.1 Flash ships 5)
SMALL_MODEL_BYTES = 1 << 30  # weights below this: "small" (compact buckets, smaller batch / chunk defaults)
# (max_running_requests, chunked_prefill_size) defaults: (small model, other)
_DEFAULT_RUNNING = (4, 32)
_DEFAULT_CHUNK = (64, 512)


def model_is_small(model: str) -> bool:
    """Whether ``model`` ('tiny' or a model directory) has under SMALL_MODEL_BYTES of weights,
    judged from its config alone (nothing is loaded). A directory whose config cannot be read is
    not small: the engine reports that config's error when it loads the model."""
    from dsv41_jax.model.config import ConfigError, ModelConfig
    from dsv41_jax.model.params import param_stats

    try:
        cfg = ModelConfig.from_pretrained(model)
    except (ConfigError, OSError):
        return False
    return param_stats(cfg)["bytes"] < SMALL_MODEL_BYTES


def _int_list(text: str) -> list:
    return [int(x) for x in str(text).replace(",", " ").split()]


def help_text(action: argparse.Action) -> str:
    """A flag's ``--help`` text with its default stated once: argparse's "(default: X)" is appended only
    where the text does not already say what the default is, and never for an unset (None) default or
    an on/off switch, whose text says what happens without it."""
    text = action.help or ""
    if (not action.option_strings or action.default is None or action.default is argparse.SUPPRESS
            or isinstance(action.default, bool) or "default" in text.lower()):
        return text
    return text + " (default: %(default)s)"


class HelpFormatter(argparse.HelpFormatter):
    """An argparse formatter that states each flag's default once (`help_text`); for the CLIs' parsers."""

    def _get_help_string(self, action):
        return help_text(action)


@dataclass
class EngineArgs:
    """Every engine knob (see `add_cli_args` for the help texts, which are the documentation)."""

    model: str = "tiny"
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    page_size: int = 256
    context_length: Optional[int] = None
    max_running_requests: Optional[int] = None  # None: 32, or 4 for a small model
    max_total_tokens: Optional[int] = None
    mem_fraction_static: Optional[float] = None
    cpu_memory_budget: Optional[int] = None
    chunked_prefill_size: Optional[int] = None  # None: 512, or 64 for a small model
    max_prefill_tokens: int = 16384
    batch_buckets: Optional[list] = None
    token_buckets: Optional[list] = None
    shape_buckets: str = "auto"
    enable_mixed_chunk: bool = False
    disable_overlap_schedule: bool = False
    disable_prefix_sharing: bool = False
    disable_radix_cache: bool = False
    radix_cache_snapshots: Optional[int] = None  # None: 4 x max_running_requests, at least 64
    enable_hierarchical_cache: bool = False
    hicache_ratio: Optional[float] = None  # None: 2.0 (with enable_hierarchical_cache)
    max_logprobs: int = 20
    max_queued_requests: Optional[int] = None
    decode_log_interval: int = 40
    skip_server_warmup: bool = False
    # compile the all-logits (prompt logprobs: echo + logprobs) extend variant in the warm-up too;
    # without it the first such request compiles it (one program per shape bucket it uses)
    warmup_prompt_logprobs: bool = False
    tp_size: int = 1
    ep_size: int = 1
    engram_host_table: Optional[bool] = None  # None: env DSV41_ENGRAM_HOST_TABLE (default off)
    random_seed: int = 0
    impl: str = "auto"
    speculative_algorithm: Optional[str] = None  # "DSPARK" (DSpark speculative decoding) or None
    speculative_dspark_block_size: Optional[int] = None  # γ, 1..5; None: the checkpoint's dspark_block_size
    speculative_simulate_accept_length: Optional[float] = None  # performance runs only (see runner.py)
    # MTP (EAGLE / NEXTN, DeepSeek-V4): chained drafts per step; top-1 chains only; draft tokens = steps + 1
    speculative_num_steps: Optional[int] = None
    speculative_eagle_topk: Optional[int] = None
    speculative_num_draft_tokens: Optional[int] = None
    # SWA bounded replay (SGLang's flag): prefill runs the layers after the last store layer only on each
    # request's last sliding_window prompt tokens (decode.extend_bounded). Approximate: no prompt logprobs.
    enable_decoder_swa_bounded_replay: bool = False
    # SGLang's flag: the deterministic numerics mode (`ModelConfig.deterministic`, model/numerics.py) and a
    # batch-invariant sampler: results independent of batch, chunking, mesh, kernels and speculation.
    enable_deterministic_inference: bool = False
    # data-parallel attention (issue 46): dp_size ranks, each with its own slots, pages, prefix cache and
    # scheduler; a DP controller assigns each request to a rank (load_balance_method; None: cache_aware)
    enable_dp_attention: bool = False
    dp_size: int = 1
    load_balance_method: Optional[str] = None
    # redundant experts (EPLB, issue 46 item 7; SGLang's flags): R extra expert copies placed from a routing
    # distribution file (the runner builds `MeshPlan.expert_location`, serving/experts.py); the recorder
    # counts the routed experts of every launch and writes that file (at shutdown, and on the server's
    # /dump_expert_distribution_record) to expert_distribution_recorder_file (None: DEFAULT_DISTRIBUTION_FILE)
    ep_num_redundant_experts: int = 0
    init_expert_location: Optional[str] = None
    expert_distribution_recorder: bool = False
    expert_distribution_recorder_file: Optional[str] = None

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------------------------------
    def _small(self) -> bool:
        """model_is_small(self.model), computed once per model."""
        cached = self.__dict__.get("_small_cache")
        if cached is None or cached[0] != self.model:
            cached = self.__dict__["_small_cache"] = (self.model, model_is_small(self.model))
        return cached[1]

    def _validate_mtp(self, bad, mtp: bool) -> None:
        """--speculative-num-steps / -eagle-topk / -num-draft-tokens: MTP's (EAGLE / NEXTN) top-1 chains only."""
        for f in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"):
            v = getattr(self, f)
            if v is None:
                continue
            if not mtp:
                bad(f, "needs --speculative-algorithm EAGLE or NEXTN (DeepSeek-V4's MTP layer)")
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(f, "must be an integer >= 1")
        if not mtp:
            return
        if self.speculative_eagle_topk not in (None, 1):
            bad("speculative_eagle_topk", "must be 1: only top-1 draft chains are implemented (no draft trees)")
        if self.speculative_num_steps is not None and self.speculative_num_steps > MTP_MAX_STEPS:
            bad("speculative_num_steps", f"must be <= {MTP_MAX_STEPS}")
        steps, n = self.speculative_num_steps, self.speculative_num_draft_tokens
        if steps is not None and n is not None and n != steps + 1:
            bad("speculative_num_draft_tokens", f"must be --speculative-num-steps + 1 = {steps + 1} (top-1 chains)")

    def resolved_mtp_steps(self) -> int:
        """MTP draft tokens per step (γ): --speculative-num-steps, else --speculative-num-draft-tokens − 1, else
        SGLang's V4 recipe's 3."""
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        if self.speculative_num_draft_tokens is not None:
            if self.speculative_num_draft_tokens < 2:
                raise ValueError("speculative_num_draft_tokens: must be >= 2 (the anchor + at least one draft)")
            return self.speculative_num_draft_tokens - 1
        return MTP_DEFAULT_STEPS

    def resolved_hicache_ratio(self) -> float:
        return 2.0 if self.hicache_ratio is None else float(self.hicache_ratio)

    def validate(self) -> "EngineArgs":
        def bad(name, msg):
            raise ValueError(f"{name}: {msg}, got {getattr(self, name)!r}")

        from dsv41_jax.model.config import resolve_model

        self.model = resolve_model(self.model)  # "nano" -> the bundled checkpoint's directory

        if self.shape_buckets not in SHAPE_BUCKETS:
            bad("shape_buckets", f"must be one of {list(SHAPE_BUCKETS)}")
        if self.max_running_requests is None:
            self.max_running_requests = _DEFAULT_RUNNING[0 if self._small() else 1]
        if self.chunked_prefill_size is None:
            self.chunked_prefill_size = _DEFAULT_CHUNK[0 if self._small() else 1]

        if self.radix_cache_snapshots is not None:
            if self.radix_cache_snapshots < 1:
                bad("radix_cache_snapshots", "must be >= 1")
            if self.disable_radix_cache:
                bad("radix_cache_snapshots", "has no effect with --disable-radix-cache (drop one of them)")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            bad("enable_hierarchical_cache", "needs the radix cache (drop --disable-radix-cache)")
        if self.hicache_ratio is not None:
            if not self.enable_hierarchical_cache:
                bad("hicache_ratio", "has no effect without --enable-hierarchical-cache")
            if not self.hicache_ratio > 0:
                bad("hicache_ratio", "must be > 0")
        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {sorted(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            bad("kv_cache_dtype", f"must be one of {sorted(KV_CACHE_DTYPE_CHOICES)}")
        for name in ("page_size", "max_running_requests", "chunked_prefill_size", "max_prefill_tokens",
                     "max_logprobs", "decode_log_interval", "tp_size", "ep_size", "dp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "max_logprobs" else 1):
                bad(name, "must be a positive integer")
        for name in ("context_length", "max_total_tokens", "max_queued_requests", "cpu_memory_budget"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                bad(name, "must be a positive integer or None")
        if self.mem_fraction_static is not None and not (0.0 < float(self.mem_fraction_static) <= 1.0):
            bad("mem_fraction_static", "must be in (0, 1]")
        for name in ("batch_buckets", "token_buckets"):
            v = getattr(self, name)
            if v is not None:
                if isinstance(v, str):
                    v = _int_list(v)
                v = sorted(set(int(x) for x in v))
                if not v or v[0] < 1:
                    bad(name, "must be a non-empty list of positive integers")
                setattr(self, name, v)
        if self.shape_buckets != "auto" and self.batch_buckets is not None and self.token_buckets is not None:
            bad("shape_buckets", "chooses default buckets and has no effect when batch_buckets and token_buckets "
                                 "are both given (leave it 'auto')")
        if self.batch_buckets is not None and self.batch_buckets[-1] < self.max_running_requests:
            bad("batch_buckets", f"the largest must be >= max_running_requests={self.max_running_requests}")
        if self.speculative_algorithm is not None:
            if str(self.speculative_algorithm).upper() not in SPECULATIVE_ALGORITHMS:
                bad("speculative_algorithm", f"must be one of {list(SPECULATIVE_ALGORITHMS)} or None")
            self.speculative_algorithm = str(self.speculative_algorithm).upper()
        mtp = self.speculative_algorithm in MTP_ALGORITHMS
        v = self.speculative_dspark_block_size
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= DSPARK_MAX_BLOCK:
                bad("speculative_dspark_block_size", f"must be an integer in 1..{DSPARK_MAX_BLOCK}")
            if self.speculative_algorithm is None or mtp:
                bad("speculative_dspark_block_size", "needs --speculative-algorithm DSPARK")
        v = self.speculative_simulate_accept_length
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 1.0 <= float(v) <= DSPARK_MAX_BLOCK + 1:
                bad("speculative_simulate_accept_length", f"must be a number in 1..{DSPARK_MAX_BLOCK + 1}")
            if self.speculative_algorithm is None or mtp:
                bad("speculative_simulate_accept_length", "needs --speculative-algorithm DSPARK")
        self._validate_mtp(bad, mtp)
        self._validate_dp()
        self._validate_eplb()
        if self.warmup_prompt_logprobs and self.skip_server_warmup:
            bad("warmup_prompt_logprobs", "has nothing to add to with --skip-server-warmup (no warm-up runs)")
        if self.warmup_prompt_logprobs and self.enable_decoder_swa_bounded_replay:
            bad("warmup_prompt_logprobs", "cannot be combined with --enable-decoder-swa-bounded-replay, which "
                                          "serves no prompt logprobs")
        if self.enable_decoder_swa_bounded_replay:
            # combinations it does not implement are refused here, before anything is loaded
            flag = "enable_decoder_swa_bounded_replay"
            if not self.disable_radix_cache:
                bad(flag, "cannot share the radix prefix cache (a cached state's late-layer window rings would "
                          "hold only the rows its own prompt's tail computed): add --disable-radix-cache")
            if self.speculative_algorithm is not None:
                bad(flag, "is not implemented with --speculative-algorithm DSPARK (the draft reads the late "
                          "layers' hidden states of every prompt token)")
            if self.tp_size != 1 or self.ep_size != 1:
                bad(flag, "is not implemented with --tp-size / --ep-size > 1 (its step is not sharded)")
        from dsv41_jax.model.dispatch import ImplError, is_kernel, parse_impl

        try:
            chosen = parse_impl(self.impl)
        except ImplError as e:
            raise ValueError(str(e)) from None
        if self.enable_deterministic_inference:
            flag = "enable_deterministic_inference"
            kernels = sorted(op for op, name in chosen.items() if is_kernel(name))
            if kernels:
                raise ValueError(f"{flag}: --impl {self.impl!r} asks for Pallas kernels for {', '.join(kernels)}, "
                                 "which accumulate in fp32 in their own tile order and cannot give batch-invariant "
                                 "results; use 'xla' or 'auto' for those ops ('auto' runs 'xla' in this mode)")
            if self.enable_decoder_swa_bounded_replay:
                bad(flag, "cannot be combined with --enable-decoder-swa-bounded-replay (its late layers see only "
                          "each prompt's tail, so a request's result depends on how its prompt was scheduled)")
        return self

    def _validate_eplb(self) -> None:
        """Redundant experts and the recorder: the combinations that cannot work (one line each; what needs the
        model's config and the mesh — E + R dividing the expert devices, the file's layers and experts — the
        runner refuses before any weight is read, `experts.plan_location`)."""
        R = self.ep_num_redundant_experts
        if not isinstance(R, int) or R < 0:
            raise ValueError(f"ep_num_redundant_experts: must be an integer >= 0, got {R!r}")
        if R and self.ep_size == 1 and self.dp_size == 1:
            raise ValueError(f"ep_num_redundant_experts: {R} copies need expert parallelism (--ep-size > 1 or "
                             "--dp-size > 1 with --enable-dp-attention): on one expert device there is nothing to balance")
        if R and self.init_expert_location is None:
            raise ValueError(f"ep_num_redundant_experts: {R} copies need --init-expert-location FILE (a routing "
                             "distribution, e.g. from --expert-distribution-recorder or scripts/eplb_report.py --out); "
                             "no uniform placement is guessed")
        if self.init_expert_location is not None and not R:
            raise ValueError("init_expert_location: has no effect without --ep-num-redundant-experts R > 0")
        if self.init_expert_location is not None and not os.path.isfile(self.init_expert_location):
            raise ValueError(f"init_expert_location: {self.init_expert_location!r} is not a file")
        if self.expert_distribution_recorder_file is not None and not self.expert_distribution_recorder:
            raise ValueError("expert_distribution_recorder_file: has no effect without --expert-distribution-recorder")
        if self.expert_distribution_recorder:
            # the recording step is the plain one plus its routing; these run other steps, which hand out none yet
            for on, flag in ((self.speculative_algorithm is not None, "--speculative-algorithm DSPARK"),
                             (self.enable_decoder_swa_bounded_replay, "--enable-decoder-swa-bounded-replay")):
                if on:
                    raise ValueError(f"expert_distribution_recorder: not implemented with {flag} (its steps do not "
                                     "hand out their routing)")
            d = os.path.dirname(os.path.abspath(self.resolved_distribution_file))
            if not os.path.isdir(d):
                raise ValueError(f"expert_distribution_recorder_file: the directory {d!r} does not exist")

    @property
    def resolved_distribution_file(self) -> str:
        """Where the expert distribution recorder writes (--expert-distribution-recorder-file, default
        DEFAULT_DISTRIBUTION_FILE in the working directory)."""
        return self.expert_distribution_recorder_file or DEFAULT_DISTRIBUTION_FILE

    def _validate_dp(self) -> None:
        """Data-parallel attention: the combinations it cannot serve, refused before anything loads."""
        D = self.dp_size
        if D > 1 and not self.enable_dp_attention:
            raise ValueError(f"dp_size: {D} ranks need --enable-dp-attention (data-parallel engine replicas "
                             "without DP attention are not implemented)")
        if self.load_balance_method is not None:
            if self.load_balance_method not in LOAD_BALANCE_METHODS:
                raise ValueError(f"load_balance_method: must be one of {list(LOAD_BALANCE_METHODS)}, "
                                 f"got {self.load_balance_method!r}")
            if D == 1:
                raise ValueError(f"load_balance_method: {self.load_balance_method!r} has no effect without "
                                 "--dp-size > 1 (one rank takes every request)")
        if D == 1:
            return
        if self.max_running_requests % D:
            raise ValueError(f"dp_size: max_running_requests={self.max_running_requests} is not divisible by "
                             f"dp_size={D} (each rank owns an equal share of the request slots)")
        if self.enable_decoder_swa_bounded_replay:
            raise ValueError("enable_decoder_swa_bounded_replay: not implemented with --dp-size > 1 (refused, as "
                             "SGLang does: its prefill is approximate and per-rank exactness is not shown)")
        if self.max_total_tokens is not None and self.max_total_tokens < D * self.page_size:
            raise ValueError(f"max_total_tokens: {self.max_total_tokens} tokens leave less than one page per dp rank "
                             f"(dp_size={D}, page_size={self.page_size})")

    def check_devices(self, n_devices: int, platform: str = "") -> None:
        """The server's start-up check that the devices asked for exist: dp_size x tp_size (attention TP-split
        inside each data-parallel rank) must not exceed ``n_devices`` (ValueError naming both). The engine
        itself runs any number of ranks on whatever mesh it is given (one device included: tests)."""
        need = self.dp_size * self.tp_size
        if self.dp_size > 1 and need > n_devices:
            hint = (f"; on a CPU, fake {need} host devices with XLA_FLAGS=--xla_force_host_platform_device_count={need}"
                    if platform == "cpu" else "")
            raise ValueError(f"dp_size: --dp-size {self.dp_size} x --tp-size {self.tp_size} needs {need} devices, "
                             f"only {n_devices} are available{f' ({platform})' if platform else ''}{hint}")

    @property
    def resolved_load_balance_method(self) -> str:
        return self.load_balance_method or "cache_aware"

    def rank_batch_buckets(self) -> list:
        """Batch sizes of one dp rank's share of a launch (a launch has dp_size x as many rows, rank-major):
        each compiled batch size split over the ranks, rounded up. dp = 1: `resolved_batch_buckets`."""
        D = self.dp_size
        return sorted(set(-(-b // D) for b in self.resolved_batch_buckets()))

    @property
    def fp64_accumulation(self) -> bool:
        """Whether the numerics accumulate in fp64 (--enable-deterministic-inference or --dtype exact):
        "auto" then resolves to the jnp paths (`dispatch.resolve`)."""
        return bool(self.enable_deterministic_inference) or self.act_dtype == "exact"

    def resolved_impl(self) -> dict:
        """{op: implementation} that ``impl`` selects on the current backend (`dispatch.resolve`, which
        logs each choice once). Raises ValueError for a choice this backend cannot honour (e.g.
        "pallas" for an op without a kernel) — at start-up, before any model is loaded."""
        from dsv41_jax.model.dispatch import OPS, ImplError, resolve

        try:
            return {op: resolve(self.impl, op, f64=self.fp64_accumulation) for op in OPS}
        except ImplError as e:
            raise ValueError(str(e)) from None

    @property
    def act_dtype(self) -> str:
        """The model's activation dtype / numerics mode (`model.numerics`): "bfloat16" (the reference
        flow), "float32" or "exact" (fp32 activations, fp64-accumulated matmuls: results independent of
        summation order, so a sharded server's greedy outputs equal the unsharded one's)."""
        return DTYPES[self.dtype]

    @property
    def cache_dtype(self) -> str:
        return KV_CACHE_DTYPE_CHOICES[self.kv_cache_dtype]

    def replace(self, **kw) -> "EngineArgs":
        return dataclasses.replace(self, **kw)

    @property
    def compact_buckets(self) -> bool:
        """Whether the default buckets are compact (``shape_buckets``; "auto": for a small model)."""
        if self.shape_buckets == "auto":
            return self._small()
        return self.shape_buckets == "compact"

    def resolved_batch_buckets(self) -> list:
        """Batch sizes compiled: the given list; else max_running_requests alone (compact buckets);
        else powers of two up to max_running_requests (plus max_running_requests itself when it is
        not a power of two)."""
        if self.batch_buckets:  # those up to max_running_requests, plus the first above it if needed
            below = [b for b in self.batch_buckets if b <= self.max_running_requests]
            if below and below[-1] == self.max_running_requests:
                return below
            return below + [b for b in self.batch_buckets if b > self.max_running_requests][:1]
        if self.compact_buckets:
            return [self.max_running_requests]
        out, b = [], 1
        while b < self.max_running_requests:
            out.append(b)
            b *= 2
        out.append(self.max_running_requests)
        return sorted(set(out))

    def resolved_token_buckets(self) -> list:
        """Tokens per row compiled: 1 (decode) and the prefill chunk buckets (the given list, else
        chunked_prefill_size, and with full buckets also chunked_prefill_size / 8 when that is at
        least 16)."""
        if self.token_buckets:
            tb = [t for t in self.token_buckets if t <= self.chunked_prefill_size]
            return sorted(set([1, self.chunked_prefill_size] + tb))
        tb = [1, self.chunked_prefill_size]
        if not self.compact_buckets and self.chunked_prefill_size // 8 >= 16:
            tb.append(self.chunked_prefill_size // 8)
        return sorted(set(tb))

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, model_default: str = "tiny") -> argparse.ArgumentParser:
        """Register every engine flag on `parser` (the server CLI and the scripts share these)."""
        d = EngineArgs.__dataclass_fields__
        g = parser.add_argument_group("engine")
        g.add_argument("--model", "--model-path", dest="model", default=model_default,
                       help="'nano' (the small trained model bundled in the package), 'tiny' (random tiny "
                            "model with its bundled tokenizer, for tests) or a model directory (HF release "
                            "layout or converted Orbax; loaded with checkpoint.load_params)")
        g.add_argument("--tokenizer", "--tokenizer-path", dest="tokenizer", default=None,
                       help="tokenizer directory or tokenizer.json (default: the model directory / tiny's)")
        g.add_argument("--dtype", default=d["dtype"].default, choices=sorted(DTYPES),
                       help="activation dtype: auto/bfloat16 = the reference bf16 flow; float32 = the full-fp32 "
                            "equivalence mode, in which greedy outputs do not depend on batch composition; "
                            "exact = fp32 with fp64-accumulated matmuls and sampler sums (slower): tokens and "
                            "logprobs independent of summation order, e.g. of the batch, --tp / --ep")
        g.add_argument("--kv-cache-dtype", default=d["kv_cache_dtype"].default, choices=sorted(KV_CACHE_DTYPE_CHOICES),
                       help="KV storage: auto (fp8 window, fp4 compressed latents / index keys: lossless), "
                            "fp8_e4m3 (all fp8, lossy), bfloat16 / float32 (debugging)")
        g.add_argument("--page-size", type=int, default=d["page_size"].default,
                       help="tokens per KV page (a multiple of every compress ratio); default %(default)s")
        g.add_argument("--context-length", "--max-model-len", dest="context_length", type=int, default=None,
                       help="maximum tokens per request (prompt + output); default: the model's "
                            "max_position_embeddings, capped by the pool size. The indexer's cost per step "
                            "grows with it")
        g.add_argument("--max-running-requests", "--max-num-seqs", dest="max_running_requests", type=int, default=None,
                       help="requests decoding at once (slots for per-request state); the largest batch "
                            f"bucket; default {_DEFAULT_RUNNING[1]}, {_DEFAULT_RUNNING[0]} for a small model "
                            f"(weights under {SMALL_MODEL_BYTES >> 30} GiB, e.g. tiny)")
        g.add_argument("--max-total-tokens", type=int, default=None,
                       help="KV pool size in tokens; overrides the --mem-fraction-static sizing")
        g.add_argument("--mem-fraction-static", type=float, default=None,
                       help="fraction of device memory for weights + KV pools (default 0.85 on accelerators; "
                            "on CPU 0.5 of physical RAM); pools are capped at max_running_requests x "
                            "context_length tokens")
        g.add_argument("--cpu-memory-budget", type=int, default=None,
                       help="bytes treated as the device memory on CPU (default: physical RAM)")
        g.add_argument("--chunked-prefill-size", type=int, default=None,
                       help="largest prefill chunk of one request per step (the largest token bucket); "
                            f"default {_DEFAULT_CHUNK[1]}, {_DEFAULT_CHUNK[0]} for a small model")
        g.add_argument("--max-prefill-tokens", type=int, default=d["max_prefill_tokens"].default,
                       help="prefill tokens per scheduler step over all requests; default %(default)s")
        g.add_argument("--batch-buckets", type=_int_list, default=None,
                       help="batch sizes to compile, e.g. '1,2,4,8' (default: see --shape-buckets)")
        g.add_argument("--token-buckets", type=_int_list, default=None,
                       help="prefill chunk lengths to compile besides 1 (default: see --shape-buckets)")
        g.add_argument("--shape-buckets", default=d["shape_buckets"].default, choices=SHAPE_BUCKETS,
                       help="the (batch, tokens) shapes compiled at start when --batch-buckets / "
                            "--token-buckets are not given: 'full' = batch sizes in powers of two up to "
                            "--max-running-requests x tokens 1, --chunked-prefill-size and a chunk 8x smaller; "
                            "'compact' = batch --max-running-requests x tokens 1 and --chunked-prefill-size "
                            "(2 compilations: the fastest start; smaller batches are padded); 'auto' = compact "
                            "for a small model, else full")
        g.add_argument("--enable-mixed-chunk", action="store_true",
                       help="run decode rows inside the prefill step (one [B, T] launch) instead of a separate "
                            "[B, 1] launch in the same scheduler iteration")
        g.add_argument("--disable-overlap-schedule", action="store_true",
                       help="read each step's tokens before preparing the next step (no host/device overlap)")
        g.add_argument("--disable-prefix-sharing", action="store_true",
                       help="n > 1: prefill the prompt once per sample instead of forking the prompt's pages")
        g.add_argument("--disable-radix-cache", action="store_true",
                       help="turn off the radix prefix cache (on by default): a request whose tokens extend "
                            "an earlier request's prompt or whole sequence resumes from its cached state (pages "
                            "shared, window / compressor / Engram rows restored) instead of prefilling from token 0")
        g.add_argument("--radix-cache-snapshots", type=int, default=None,
                       help="cached states the radix prefix cache keeps at most (each holds one copy of a "
                            "request's window rows; its pages are counted in the KV pool); default 4 x "
                            "--max-running-requests and at least 64, at most a quarter of the KV memory budget")
        g.add_argument("--enable-hierarchical-cache", action="store_true",
                       help="HiCache L2: prefix-cache entries the device pool evicts are copied to a host pool "
                            "(--hicache-ratio x the device pool's pages, its own LRU) and loaded back on a hit "
                            "instead of being recomputed")
        g.add_argument("--hicache-ratio", type=float, default=None,
                       help="host pool size as a multiple of the device KV pool (with "
                            "--enable-hierarchical-cache); default 2")
        g.add_argument("--max-logprobs", type=int, default=d["max_logprobs"].default,
                       help="largest top_logprobs a request may ask for (fixed size of the on-device top-k); "
                            "default %(default)s")
        g.add_argument("--max-queued-requests", type=int, default=None,
                       help="waiting-queue limit of the async engine; beyond it new requests are refused "
                            "(the server answers 503); default unlimited")
        g.add_argument("--decode-log-interval", type=int, default=d["decode_log_interval"].default,
                       help="log a decode line every this many decode steps; default %(default)s")
        g.add_argument("--skip-server-warmup", action="store_true",
                       help="do not compile every (batch, tokens) bucket at start (they compile on first use)")
        g.add_argument("--warmup-prompt-logprobs", action="store_true",
                       help="also compile the prompt-logprobs variant of every bucket at start (a longer "
                            "warm-up); without it the first /v1/completions request with echo + logprobs "
                            "(e.g. lm-eval's loglikelihood) compiles it and waits for that")
        g.add_argument("--tp-size", "--tp", "--tensor-parallel-size", dest="tp_size", type=int, default=1,
                       help="tensor parallel size: attention heads, the shared expert, embedding/head and the "
                            "Engram tables are split over tp devices (mesh of tp x ep devices; an impossible "
                            "combination is refused at start-up)")
        g.add_argument("--ep-size", "--ep", dest="ep_size", type=int, default=1,
                       help="expert parallel size: the routed experts are split over ep devices (see --tp-size)")
        g.add_argument("--engram-host-table", dest="engram_host_table", action="store_const", const=True,
                       default=None, help="keep the Engram tables in host memory (one copy; rows gathered on the "
                                          "host each step) instead of split over the tp devices; default: env "
                                          "DSV41_ENGRAM_HOST_TABLE=1, else off")
        g.add_argument("--random-seed", "--seed", dest="random_seed", type=int, default=0,
                       help="seed of the tiny model's random weights and of requests sent without a seed")
        g.add_argument("--impl", default=d["impl"].default,
                       help="implementation of the ops with a fast path (attention, indexer, engram, mhc, moe, "
                            "linear): 'auto' (default: the fastest available on this backend), 'reference' (the "
                            "faithful oracle), 'xla', 'pallas', 'pallas_interpret', or per-op items such as "
                            "'xla,moe=reference'; the choice per op is logged at start-up, and a choice this "
                            "backend cannot honour is refused there")
        g.add_argument("--speculative-algorithm", dest="speculative_algorithm", default=None,
                       type=lambda x: str(x).upper(), choices=SPECULATIVE_ALGORITHMS,
                       help="speculative decoding: DSPARK = the checkpoint's DSpark draft (mtp.* stages) proposes "
                            "a block of tokens that the model verifies in one step (on one device or a --tp-size / "
                            "--ep-size mesh, also with --engram-host-table); refused at start-up when the "
                            "checkpoint has no DSpark stages and with --enable-mixed-chunk or "
                            "--enable-decoder-swa-bounded-replay. EAGLE / NEXTN = a DeepSeek-V4 checkpoint's MTP "
                            "layer drafts a top-1 chain of --speculative-num-steps tokens (SGLang's spelling; one "
                            "device). Off by default")
        g.add_argument("--speculative-num-steps", dest="speculative_num_steps", type=int, default=None,
                       help=f"EAGLE / NEXTN (MTP): draft tokens chained per step (default {MTP_DEFAULT_STEPS}, "
                            "or --speculative-num-draft-tokens - 1)")
        g.add_argument("--speculative-eagle-topk", dest="speculative_eagle_topk", type=int, default=None,
                       help="EAGLE / NEXTN (MTP): draft branching; only 1 (a chain) is implemented")
        g.add_argument("--speculative-num-draft-tokens", dest="speculative_num_draft_tokens", type=int, default=None,
                       help="EAGLE / NEXTN (MTP): tokens verified per step, --speculative-num-steps + 1 for a chain")
        g.add_argument("--speculative-dspark-block-size", dest="speculative_dspark_block_size", type=int,
                       default=None, help=f"DSpark proposals per step (1..{DSPARK_MAX_BLOCK}, at most the checkpoint's "
                                          "dspark_block_size, which is the default)")
        g.add_argument("--speculative-simulate-accept-length", dest="speculative_simulate_accept_length", type=float,
                       default=None, help="PERFORMANCE RUNS ONLY: every DSpark row commits this many tokens per "
                                          "step (drafts unverified; the text is meaningless), like SGLang's "
                                          "SGLANG_SIMULATE_ACC_LEN; default off")
        g.add_argument("--enable-decoder-swa-bounded-replay", dest="enable_decoder_swa_bounded_replay",
                       action="store_true",
                       help="SWA bounded replay (as SGLang's; off by default): in prefill, the layers after the last "
                            "layer that writes compressed KV / index keys run only each request's last "
                            "sliding_window prompt tokens (the ones decode's window reads), the earlier layers run "
                            "every token. Faster prefill, NOT numerically equal to full prefill (those tokens' "
                            "window attention in the late layers sees only the replayed tokens; README gives the "
                            "measured cost): requests asking for prompt logprobs are refused (HTTP 400). Needs "
                            "--disable-radix-cache; refused with DSPARK, --tp-size / --ep-size > 1 and a Pallas "
                            "attention kernel")
        g.add_argument("--enable-deterministic-inference", dest="enable_deterministic_inference", action="store_true",
                       help="deterministic inference (SGLang's flag): the reference bf16 dtype flow with every "
                            "order-sensitive sum accumulated in fp64 and a batch-invariant sampler, so a request's "
                            "tokens and logprobs do not depend on what else is batched, prefill chunking, the radix "
                            "cache, preemption, DSpark or --tp/--ep (model/numerics.py); Pallas kernels off ('auto' "
                            "runs 'xla'; an explicit Pallas --impl is refused). Cost: docs/benchmarks.md")
        g.add_argument("--enable-dp-attention", dest="enable_dp_attention", action="store_true",
                       help="data-parallel attention (SGLang's flag): the request state (KV pages, window rings, "
                            "compressor and Engram history, snapshot rows, DSpark rings, radix cache and host tier) "
                            "is split into --dp-size ranks, each serving its own requests; one step runs every "
                            "rank's rows together (rank-major). Needs --dp-size")
        g.add_argument("--dp-size", "--dp", "--data-parallel-size", dest="dp_size", type=int, default=1,
                       help="data-parallel attention ranks (with --enable-dp-attention): must divide "
                            "--max-running-requests; the KV pool and the prefix cache's snapshot rows are split "
                            "equally; dp x tp devices are needed (refused at start-up otherwise)")
        g.add_argument("--load-balance-method", dest="load_balance_method", default=None, choices=LOAD_BALANCE_METHODS,
                       help="how a new request's dp rank is chosen (with --dp-size > 1): cache_aware (default: the "
                            "rank whose radix cache holds the longest prefix of the prompt, else the least loaded), "
                            "round_robin (ranks in turn), shortest_queue (the rank with the fewest running and "
                            "waiting requests, lowest rank on a tie)")
        g.add_argument("--ep-num-redundant-experts", dest="ep_num_redundant_experts", type=int, default=0,
                       help="redundant experts (EPLB, SGLang's flag): R extra copies of the hottest routed experts "
                            "of each MoE layer, placed from --init-expert-location's distribution (E + R must divide "
                            "the expert devices; at most one copy of an expert per device); a replicated expert's "
                            "tokens are spread over its copies. Outputs stay bitwise equal (--dtype exact, "
                            "--enable-deterministic-inference). Needs --ep-size > 1 or DP attention; the start-up "
                            "log gives each layer's expected max/mean tokens per device before and after")
        g.add_argument("--init-expert-location", dest="init_expert_location", default=None, metavar="FILE",
                       help="the routing distribution (JSON, parallel/eplb.py's format: tokens per expert per "
                            "layer) the redundant experts are placed from: what --expert-distribution-recorder "
                            "writes, or scripts/eplb_report.py --out; required with --ep-num-redundant-experts "
                            "(no uniform placement is guessed)")
        g.add_argument("--expert-distribution-recorder", dest="expert_distribution_recorder", action="store_true",
                       help="count the (token, expert) assignments each routed expert receives per MoE layer in "
                            "every step the engine runs, from start-up, and write them as the distribution file "
                            "--init-expert-location reads: to --expert-distribution-recorder-file when the server "
                            "shuts down and on POST /dump_expert_distribution_record (POST "
                            "/start_expert_distribution_record clears the counts, /stop_expert_distribution_record "
                            "pauses them). Not with DSPARK or --enable-decoder-swa-bounded-replay")
        g.add_argument("--expert-distribution-recorder-file", dest="expert_distribution_recorder_file", default=None,
                       metavar="FILE", help="where --expert-distribution-recorder writes the distribution "
                                            f"(default: {DEFAULT_DISTRIBUTION_FILE} in the working directory)")
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
        return cls(**kw)

    @classmethod
    def from_kwargs(cls, **kw) -> "EngineArgs":
        """`EngineArgs` from `LLM(...)`-style keywords; unknown names raise TypeError listing the known."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(names)}")
        return cls(**kw)

    def cli_flags(self) -> Sequence[str]:
        """The non-default values as CLI flags (for logging / subprocesses)."""
        out = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            default = f.default if f.default is not dataclasses.MISSING else None
            if v == default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(v, bool):
                out.append(flag)
            elif isinstance(v, list):
                out += [flag, ",".join(map(str, v))]
            else:
                out += [flag, str(v)]
        return out
