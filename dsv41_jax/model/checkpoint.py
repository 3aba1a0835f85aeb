"""Checkpoints: the HF release format (safetensors) and converted Orbax directories (docs/design/spec.md §8).

Two kinds of model directory are accepted everywhere a model path is taken (`checkpoint_kind`):

* **hf** — the release layout: ``config.json`` (HF form), ``model.safetensors.index.json`` and its
  shards (or a single ``model.safetensors``), ``tokenizer.json``. Tensor names are docs/design/spec.md §8's, one
  tensor per routed expert (``layers.L.ffn.experts.E.w1.weight``). Dense fp8 weights are
  ``F8_E4M3`` with ``F8_E8M0`` (or ``U8``, same bits) 32×32 block ``.scale`` tensors; routed experts
  are packed MXFP4 ``U8`` with ``F8_E8M0``/``U8`` per-32 scales; the rest is ``BF16``/``F32``.
* **orbax** — what ``python -m dsv41_jax.convert`` writes: ``dsv41_checkpoint.json`` (our metadata),
  ``config.json``, the tokenizer files, and ``params/``: an Orbax PyTree checkpoint (non-OCDBT, zarr
  v2, zstd) of the parameter pytree itself — one array directory per leaf named by its dotted path
  (routed experts stacked, as in `params.declare_params`). ``orbax.checkpoint.StandardCheckpointer()
  .restore(dir + "/params", abstract_tree)`` restores it too. Storage ``keep`` holds the checkpoint's
  bytes unchanged (fp8 / packed fp4 / e8m0 scales); storage ``bf16`` holds each quantized
  (weight, scale) pair as one dequantized bf16 ``weight`` (experts [E, out, in]), which
  `load_params` re-quantizes with `quant_np` (exact: e4m3·2^k and e2m1·2^k are bf16 values, so the
  dequantized weights, hence the logits, are unchanged).

`load_params` reads either kind one tensor at a time (host memory bounded by the largest tensor,
read in row blocks where it can) and, when a mesh plan is given (`parallel.plan.load_params`), places
each leaf straight onto its sharding (each device receives only its own block). The HF reader parses
safetensors headers itself (the `safetensors` numpy backend cannot return fp8 arrays) and reads each tensor with positioned reads into one preallocated buffer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import struct
from typing import Any, Optional

import ml_dtypes
import numpy as np

from dsv41_jax.model import codec
from dsv41_jax.model.codec import E8M0, FP8
from dsv41_jax.model.config import TINY_DIR, ModelConfig, resolve_model

log = logging.getLogger(__name__)

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
U8 = np.dtype(np.uint8)

# safetensors dtype strings <-> numpy dtypes.
ST_DTYPES = {
    "F8_E4M3": FP8, "F8_E8M0": E8M0, "U8": U8, "BF16": BF16, "F32": F32,
    "F16": np.dtype(np.float16), "F64": np.dtype(np.float64), "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16), "I32": np.dtype(np.int32), "I64": np.dtype(np.int64),
    "U16": np.dtype(np.uint16), "U32": np.dtype(np.uint32), "U64": np.dtype(np.uint64),
    "BOOL": np.dtype(np.bool_), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
ST_NAME = {FP8: "F8_E4M3", E8M0: "F8_E8M0", U8: "U8", BF16: "BF16", F32: "F32"}

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
META_FILE = "dsv41_checkpoint.json"
PARAMS_SUBDIR = "params"
ORBAX_FORMAT = "dsv41_jax.orbax"
ORBAX_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens.json")
# Top-level names of the vision tower (docs/design/spec.md §8): skipped, we serve text only.
VISION_ROOTS = ("vision", "aligner", "image_start", "image_end", "image_newline")
# Alternative file names for the DSpark Markov head (docs/design/spec.md §7, uncertain): file suffix -> ours.
MARKOV_ALIASES = {"markov_head.markov_w1.weight": "markov_head.embed.weight",
                  "markov_head.markov_w2.weight": "markov_head.head.weight"}
QUANT_KINDS = ("fp8", "fp8_rows", "mxfp4")  # P.init of a quantized weight (its pair is "<kind>_scale")
READ_BLOCK_BYTES = 32 << 20  # row-block size of streamed reads


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as this config's parameters. The message names the tensor and
    file, and the expected shape/dtype."""


# ================================================================================== safetensors I/O


@dataclasses.dataclass(frozen=True)
class STEntry:
    """One tensor of a safetensors file: absolute byte range [begin, end) in `file`."""

    name: str
    file: str
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def np_dtype(self) -> Optional[np.dtype]:
        return ST_DTYPES.get(self.dtype)


def read_safetensors_header(path: str) -> tuple[dict, dict]:
    """Parse and check one safetensors file's header: ({name: STEntry}, __metadata__).

    Raises CheckpointError for a header that is not valid, or whose tensors lie (partly) beyond the end
    of the file (a truncated shard) or disagree with their dtype × shape.
    """
    fname = os.path.basename(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 1 << 30):
                raise CheckpointError(f"{path}: header length {n} exceeds the file size {size} "
                                      "(truncated or not a safetensors file)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    out = {}
    for name, h in header.items():
        try:
            dt, shape, (b, e) = h["dtype"], tuple(int(s) for s in h["shape"]), h["data_offsets"]
        except (KeyError, TypeError, ValueError) as ex:
            raise CheckpointError(f"{name} in {fname}: malformed header entry {h!r}") from ex
        npdt = ST_DTYPES.get(dt)
        if npdt is not None and (e - b) != math.prod(shape) * npdt.itemsize:
            raise CheckpointError(f"{name} in {fname}: data_offsets [{b}, {e}) hold {e - b} bytes but "
                                  f"{dt} {list(shape)} needs {math.prod(shape) * npdt.itemsize}")
        if base + e > size:
            raise CheckpointError(f"{name} in {fname}: data ends at byte {base + e} but the file has only "
                                  f"{size} bytes (truncated shard {path})")
        out[name] = STEntry(name, path, dt, shape, base + b, base + e)
    return out, meta


def _readinto(fd: int, buf: np.ndarray, offset: int, entry: STEntry) -> None:
    mv = memoryview(buf.reshape(-1).view(np.uint8))
    done = 0
    while done < len(mv):
        k = os.preadv(fd, [mv[done:]], offset + done)
        if k <= 0:
            raise CheckpointError(f"{entry.name} in {os.path.basename(entry.file)}: unexpected end of file at "
                                  f"byte {offset + done} (truncated shard {entry.file})")
        done += k


def read_rows(entry: STEntry, dtype, r0: int = 0, r1: Optional[int] = None, out: Optional[np.ndarray] = None,
              fd: Optional[int] = None) -> np.ndarray:
    """Rows [r0, r1) (leading dim) of a safetensors tensor as `dtype` (same itemsize as stored)."""
    dtype = np.dtype(dtype)
    shape = entry.shape
    rows = shape[0] if shape else 1
    r1 = rows if r1 is None else r1
    row_elems = math.prod(shape[1:]) if shape else 1
    sub = ((r1 - r0),) + tuple(shape[1:]) if shape else ()
    if out is None:
        out = np.empty(sub, dtype)
    own = fd is None
    if own:
        fd = os.open(entry.file, os.O_RDONLY)
    try:
        _readinto(fd, out, entry.begin + r0 * row_elems * dtype.itemsize, entry)
    finally:
        if own:
            os.close(fd)
    return out


def read_tensor(entry: STEntry, dtype=None) -> np.ndarray:
    """The whole tensor (one allocation, positioned reads)."""
    return read_rows(entry, dtype if dtype is not None else entry.np_dtype)


def row_blocks(shape: tuple, itemsize: int, block_bytes: int = READ_BLOCK_BYTES, align: int = 1):
    """[(r0, r1)] covering the leading dim in blocks of about `block_bytes` (multiples of `align` rows)."""
    rows = shape[0] if shape else 1
    row_bytes = max(1, math.prod(shape[1:]) * itemsize) if shape else itemsize
    step = max(align, (block_bytes // row_bytes) // align * align)
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


# ================================================================================== tensor layout


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of the HF checkpoint, derived from the parameter declarations.

    name: the file's name; param: the dotted parameter name (experts stacked); expert: index into the
    stacked leading axis or None; aliases: other names the release may use for it; optional: a
    vision-only tensor (``P.vision_only``), loaded when present and zeros when absent.
    """

    name: str
    shape: tuple
    dtype: np.dtype
    param: str
    expert: Optional[int] = None
    aliases: tuple = ()
    optional: bool = False

    def accepts_dtype(self, st_dtype: str) -> bool:
        if ST_DTYPES.get(st_dtype) == self.dtype:
            return True
        return self.dtype == E8M0 and st_dtype == "U8"  # e8m0 scales stored as raw bytes

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ParamLeaf:
    """One leaf of the parameter pytree: path (str/int keys), dotted name, declaration `P`."""

    path: tuple
    name: str
    decl: Any

    @property
    def shape(self) -> tuple:
        return tuple(self.decl.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.decl.dtype)

    @property
    def stacked(self) -> bool:
        return self.decl.init in ("mxfp4", "mxfp4_scale")


def param_leaves(cfg: ModelConfig, *, include_derived: bool = False) -> list:
    """Every declared parameter leaf in declaration order (checkpoint leaves unless include_derived)."""
    from dsv41_jax.model.params import P, children, declare_params

    out = []

    def walk(node, path):
        if isinstance(node, P):
            if node.in_checkpoint or include_derived:
                out.append(ParamLeaf(path, ".".join(str(k) for k in path), node))
        for k, v in children(node):
            walk(v, path + (k,))

    walk(declare_params(cfg), ())
    return out


def _expert_name(leaf: ParamLeaf, e: int) -> str:
    p = [str(k) for k in leaf.path]
    i = p.index("experts")
    return ".".join(p[: i + 1] + [str(e)] + p[i + 1:])


def _aliases(name: str) -> tuple:
    for alt, ours in MARKOV_ALIASES.items():
        if name.endswith("." + ours):
            return (name[: -len(ours)] + alt,)
    return ()


def expected_tensors(cfg: ModelConfig) -> dict:
    """{file tensor name: TensorSpec} of the HF checkpoint for `cfg`, in declaration order."""
    out = {}
    for leaf in param_leaves(cfg):
        if leaf.stacked:
            for e in range(leaf.shape[0]):
                n = _expert_name(leaf, e)
                out[n] = TensorSpec(n, leaf.shape[1:], leaf.dtype, leaf.name, e)
        else:
            out[leaf.name] = TensorSpec(leaf.name, leaf.shape, leaf.dtype, leaf.name, None, _aliases(leaf.name),
                                        optional=bool(leaf.decl.vision_only))
    return out


def is_vision(name: str) -> bool:
    return name.split(".", 1)[0] in VISION_ROOTS


def quant_pairs(cfg: ModelConfig) -> dict:
    """{weight param name: (kind, scale param name, logical (dequantized) shape)} of quantized pairs."""
    leaves = {lf.name: lf for lf in param_leaves(cfg)}
    out = {}
    for name, lf in leaves.items():
        if lf.decl.init in QUANT_KINDS and name.endswith(".weight"):
            sname = name[: -len("weight")] + "scale"
            shape = lf.shape
            if lf.decl.init == "mxfp4":
                shape = shape[:-1] + (2 * shape[-1],)
            out[name] = (lf.decl.init, sname, shape)
    return out


# ================================================================================== HF directories


@dataclasses.dataclass
class HFPlan:
    """A validated HF directory: where each expected tensor is, and what else is there."""

    path: str
    cfg: ModelConfig
    files: list  # shard paths
    found: dict  # expected name -> STEntry
    unknown: list  # STEntry not in the layout (not vision)
    vision: list  # STEntry skipped as vision
    total_bytes: int  # bytes of the expected tensors
    absent: list = dataclasses.field(default_factory=list)  # optional (vision-only) tensors not in the files

    def entry_for_param(self, spec: TensorSpec) -> STEntry:
        return self.found[spec.name]


def _hf_files(path: str) -> tuple[list, dict]:
    """(shard paths, weight_map or {}) of an HF directory."""
    idx = os.path.join(path, INDEX_FILE)
    if os.path.isfile(idx):
        try:
            with open(idx, encoding="utf-8") as f:
                wm = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{idx}: not a valid safetensors index ({e})") from e
        files = []
        for fn in wm.values():
            if fn not in files:
                files.append(fn)
        missing = [fn for fn in files if not os.path.isfile(os.path.join(path, fn))]
        if missing:
            names = [n for n, fn in wm.items() if fn == missing[0]][:3]
            raise CheckpointError(f"{idx}: shard file(s) {missing} are missing from {path} (they hold e.g. "
                                  f"{names})")
        return [os.path.join(path, fn) for fn in files], wm
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single], {}
    files = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no {INDEX_FILE}, {SINGLE_FILE} or *.safetensors files")
    return [os.path.join(path, fn) for fn in files], {}


def _fmt_problems(problems: list, path: str, hint: str = "") -> str:
    head = f"{path}: {len(problems)} problem(s) with the checkpoint's tensors"
    shown = problems[:25]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    return head + (f" ({hint})" if hint else "") + ":\n  " + "\n  ".join(shown) + more


def scan_hf(path: str, cfg: ModelConfig) -> HFPlan:
    """Read every shard header of an HF directory and check every tensor against `cfg` (nothing is
    read but headers). Raises CheckpointError listing every missing / mis-shaped / wrong-dtype tensor
    (each with its file and the expected shape and dtype) and every truncated shard."""
    files, wm = _hf_files(path)
    entries: dict = {}
    problems: list = []
    dup: list = []
    for fp in files:
        try:
            hdr, _ = read_safetensors_header(fp)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        for n, ent in hdr.items():
            if n in entries:
                dup.append(f"{n}: present in both {os.path.basename(entries[n].file)} and {os.path.basename(fp)}")
            entries[n] = ent
    if problems:  # unreadable / truncated shards: nothing else can be trusted
        raise CheckpointError(_fmt_problems(problems, path))
    problems = dup
    for n, fn in wm.items():
        ent = entries.get(n)
        if ent is None:
            problems.append(f"{n}: listed in {INDEX_FILE} under {fn} but {fn} does not contain it")
        elif os.path.basename(ent.file) != fn:
            problems.append(f"{n}: {INDEX_FILE} says {fn} but it is in {os.path.basename(ent.file)}")
    expected = expected_tensors(cfg)
    found = {}
    absent = []
    claimed = set()
    n_shape = 0
    for name, spec in expected.items():
        ent = entries.get(name)
        if ent is None:
            for a in spec.aliases:
                if a in entries:
                    ent = entries[a]
                    break
        want = f"expected shape {list(spec.shape)} dtype {ST_NAME.get(spec.dtype, spec.dtype.name)}" + (
            " (or U8)" if spec.dtype == E8M0 else "")
        if ent is None and spec.optional:
            absent.append(name)  # vision-only: the text model runs without it
            continue
        if ent is None:
            alias = f" (or {', '.join(spec.aliases)})" if spec.aliases else ""
            if name in wm:
                where = f"missing from {wm[name]} (where {INDEX_FILE} puts it)"
            else:
                names = [os.path.basename(f) for f in files]
                where = (f"missing from {names[0]}" if len(names) == 1 else
                         f"missing from all {len(names)} shards ({names[0]} .. {names[-1]})") + (
                    f" and from {INDEX_FILE}" if wm else "")
            problems.append(f"{name}{alias}: {where}; {want}")
            continue
        claimed.add(ent.name)
        fn = os.path.basename(ent.file)
        bad = []
        if tuple(ent.shape) != tuple(spec.shape):
            bad.append(f"shape {list(ent.shape)}")
            n_shape += 1
        if not spec.accepts_dtype(ent.dtype):
            bad.append(f"dtype {ent.dtype}")
        if bad:
            problems.append(f"{ent.name} in {fn}: found {' '.join(bad)}; {want}")
            continue
        found[name] = ent
    vision, unknown = [], []
    for n, ent in entries.items():
        if n in claimed:
            continue
        (vision if is_vision(n) else unknown).append(ent)
    if problems:
        hint = ""
        if n_shape >= 3:
            hint = f"{n_shape} tensors have other shapes than config.json implies: is config.json this model's?"
        raise CheckpointError(_fmt_problems(problems, path, hint))
    total = sum(e.nbytes for e in found.values())
    return HFPlan(path, cfg, files, found, unknown, vision, total, absent)


def report_extras(plan: HFPlan) -> None:
    """One log line for skipped vision tensors, a warning listing unknown tensors."""
    if plan.vision:
        log.info("%s: skipping %d vision tensors (%s...): text-only model", plan.path, len(plan.vision),
                 ", ".join(e.name for e in plan.vision[:3]))
    if plan.absent:
        log.info("%s: %d vision-only tensors absent (%s...), zeros in their place: the text model does not "
                 "read them", plan.path, len(plan.absent), ", ".join(plan.absent[:2]))
    if plan.unknown:
        names = [f"{e.name} ({os.path.basename(e.file)})" for e in plan.unknown]
        log.warning("%s: %d tensors this config does not use were ignored: %s%s", plan.path, len(names),
                    ", ".join(names[:20]), " ..." if len(names) > 20 else "")


# ================================================================================== writer


def save_hf_checkpoint(params: dict, cfg: ModelConfig, out_dir: str, *, shards: int = 1,
                       tokenizer_dir: Optional[str] = None, scale_format: str = "e8m0",
                       markov_names: str = "embed_head", vision_tensors: bool = True) -> dict:
    """Write `params` in the release layout (docs/design/spec.md §8): config.json, index, shards, tokenizer files.

    shards: number of `model-0000i-of-0000K.safetensors` files (tensors split contiguously by bytes).
    scale_format: "e8m0" (F8_E8M0, as the release) or "u8" (same bits as U8).
    markov_names: "embed_head" (markov_head.embed/head) or "w1_w2" (markov_head.markov_w1/w2).
    vision_tensors: False writes a text-only checkpoint, without the vision-only tensors
    (``ffn.gate.bias_vl``), as a release without the vision tower may be shipped.
    Returns the index dict.
    """
    from safetensors.numpy import save_file

    from dsv41_jax.model.params import child

    if scale_format not in ("e8m0", "u8"):
        raise ValueError(f"scale_format must be 'e8m0' or 'u8', got {scale_format!r}")
    if markov_names not in ("embed_head", "w1_w2"):
        raise ValueError(f"markov_names must be 'embed_head' or 'w1_w2', got {markov_names!r}")
    specs = [s for s in expected_tensors(cfg).values() if vision_tensors or not s.optional]
    shards = max(1, min(int(shards), len(specs)))
    flat = {lf.name: lf for lf in param_leaves(cfg)}

    def get(spec: TensorSpec) -> np.ndarray:
        node = params
        for k in flat[spec.param].path:
            node = child(node, k)
        a = np.asarray(node if spec.expert is None else node[spec.expert])
        if a.shape != spec.shape or a.dtype != spec.dtype:
            raise ValueError(f"params[{spec.param}]{'' if spec.expert is None else f'[{spec.expert}]'} has "
                             f"{a.dtype} {a.shape}; expected {spec.dtype} {spec.shape}")
        if spec.dtype == E8M0 and scale_format == "u8":
            a = a.view(U8)
        return a

    def fname(spec: TensorSpec) -> str:
        if markov_names == "w1_w2" and spec.aliases:
            return spec.aliases[0]
        return spec.name

    os.makedirs(out_dir, exist_ok=True)
    total = sum(s.nbytes for s in specs)
    target = total / shards
    groups: list = [[] for _ in range(shards)]
    acc = 0
    g = 0
    for i, s in enumerate(specs):
        remaining = len(specs) - i
        if groups[g] and (acc >= target * (g + 1) or remaining <= shards - 1 - g) and g < shards - 1:
            g += 1
        groups[g].append(s)
        acc += s.nbytes
    weight_map = {}
    for k, grp in enumerate(groups):
        fn = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {fname(s): np.ascontiguousarray(get(s)) for s in grp}
        save_file(tensors, os.path.join(out_dir, fn), metadata={"format": "pt"})
        for n in tensors:
            weight_map[n] = fn
        del tensors
    return write_index_and_config(out_dir, weight_map, total, cfg, tokenizer_dir)


def write_index_and_config(out_dir: str, weight_map: dict, total_size: int, cfg, tokenizer_dir=None) -> dict:
    """The rest of a release-layout directory once its shards are written: the safetensors index
    ({tensor name: shard file}, total bytes), config.json (`cfg.to_hf_dict()`) and the tokenizer files
    (from `tokenizer_dir`, default tiny's). Returns the index."""
    index = {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    tdir = tokenizer_dir or TINY_DIR
    for fn in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tdir, fn)):
            shutil.copyfile(os.path.join(tdir, fn), os.path.join(out_dir, fn))
    return index


# ================================================================================== numpy dequant

def dequant_fp8_block_np(q: np.ndarray, s: np.ndarray, r0: int = 0, block: int = 32) -> np.ndarray:
    """e4m3 rows [r0, r0+len(q)) of a [out, in] weight × its e8m0 [ceil(out/32), ceil(in/32)] scale -> fp32."""
    rows = np.arange(r0, r0 + q.shape[0]) // block
    cols = np.arange(q.shape[1]) // block
    return codec.e4m3_to_f32_np(q) * codec.e8m0_to_f32_np(s)[rows][:, cols]


def dequant_fp8_rows_np(q: np.ndarray, s: np.ndarray, block: int = 32) -> np.ndarray:
    """e4m3 [r, d] rows × e8m0 [r, d/32] per-32 scales -> fp32."""
    v = codec.e4m3_to_f32_np(q).reshape(q.shape[0], -1, block)
    return (v * codec.e8m0_to_f32_np(s)[..., None]).reshape(q.shape)


def dequant_mxfp4_np(packed: np.ndarray, s: np.ndarray, block: int = 32) -> np.ndarray:
    """Packed MXFP4 [..., out, in/2] (low nibble = even element) × e8m0 [..., out, in/32] -> fp32 [..., out, in]."""
    v = codec.unpack_fp4_np(np.asarray(packed, np.uint8))
    sh = v.shape
    return (v.reshape(sh[:-1] + (sh[-1] // block, block)) * codec.e8m0_to_f32_np(s)[..., None]).reshape(sh)


def requantize_np(kind: str, w: np.ndarray, block: int = 32):
    """bf16/fp32 logical weight -> (packed, scale) in the checkpoint format of `kind` (fp8: `block`-square
    blocks; 32 is V4.1's, DeepSeek-V4's ``weight_block_size`` is 128)."""
    from dsv41_jax.model import quant_np

    w = np.asarray(w).astype(np.float32)
    if kind == "fp8":
        return quant_np.quantize_fp8_block_np(w, block)
    if kind == "fp8_rows":
        return quant_np.quantize_fp8_rows_np(w)
    if kind == "mxfp4":
        return quant_np.quantize_mxfp4_np(w)
    raise ValueError(f"unknown quantized kind {kind!r}")


# ================================================================================== Orbax directories


def checkpoint_kind(path: str) -> str:
    """"hf" (safetensors release layout) or "orbax" (converted by dsv41_jax.convert); CheckpointError else."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory (expected an HF model directory or a converted Orbax "
                              "checkpoint)")
    if os.path.isfile(os.path.join(path, META_FILE)) and os.path.isdir(os.path.join(path, PARAMS_SUBDIR)):
        return "orbax"
    if os.path.isfile(os.path.join(path, INDEX_FILE)) or os.path.isfile(os.path.join(path, SINGLE_FILE)) or any(
            fn.endswith(".safetensors") for fn in os.listdir(path)):
        return "hf"
    raise CheckpointError(f"{path}: neither an HF checkpoint ({INDEX_FILE} / *.safetensors) nor a converted "
                          f"Orbax checkpoint ({META_FILE} + {PARAMS_SUBDIR}/)")


def zarr_spec(array_dir: str) -> dict:
    return {"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.abspath(array_dir)}}


def read_orbax_meta(path: str) -> dict:
    p = os.path.join(path, META_FILE)
    try:
        with open(p, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p}: cannot read ({e})") from e
    if meta.get("format") != ORBAX_FORMAT or int(meta.get("version", 0)) > ORBAX_VERSION:
        raise CheckpointError(f"{p}: format {meta.get('format')!r} v{meta.get('version')} is not "
                              f"{ORBAX_FORMAT!r} v<={ORBAX_VERSION}")
    if meta.get("storage") not in ("keep", "bf16"):
        raise CheckpointError(f"{p}: unknown storage {meta.get('storage')!r}")
    return meta


def orbax_arrays(cfg: ModelConfig, storage: str) -> dict:
    """{array name: (shape, np dtype, ParamLeaf of the weight)} stored in an Orbax dir of `storage`."""
    pairs = quant_pairs(cfg) if storage == "bf16" else {}
    scales = {v[1] for v in pairs.values()}
    out = {}
    for lf in param_leaves(cfg):
        if lf.name in scales:
            continue
        if lf.name in pairs:
            out[lf.name] = (pairs[lf.name][2], BF16, lf)
        else:
            out[lf.name] = (lf.shape, lf.dtype, lf)
    return out


def _ts_open(array_dir: str):
    import tensorstore as ts

    return ts.open(zarr_spec(array_dir), open=True, read=True).result()


# ================================================================================== loader


def _tokenizer_for(path: str, tokenizer):
    if tokenizer is not None:
        return tokenizer
    p = os.path.join(path, "tokenizer.json")
    if os.path.isfile(p):
        return p
    raise CheckpointError(f"{path}: no tokenizer.json (needed for the Engram token map); pass tokenizer=...")


def _placer(cfg: ModelConfig, par, host_names=frozenset()):
    """name -> function(np array) -> the leaf as loaded.

    With a mesh plan `par`: each leaf goes straight onto its sharding, `par.param_placement` (padded
    Engram rows included), by `par.place_host`: every device receives only its own block, cut from the
    host array — no whole-tensor device copy first. Otherwise the default device. Names in
    `host_names` stay numpy (the host Engram table)."""
    import jax

    flat = {} if par is None else par.param_placement(cfg)

    def place(name: str, a: np.ndarray):
        if name in host_names:
            return np.asarray(a)
        if name not in flat:
            return jax.device_put(a)
        shape, sh = flat[name]
        return par.place_host(a, shape, sh)

    return place


def _engram_table_names(cfg: ModelConfig) -> frozenset:
    return frozenset(f"layers.{i}.engram.embed.{k}" for i in cfg.engram_layer_ids for k in ("weight", "scale"))


def _set(loaded: dict, path: tuple, value) -> None:
    """Record a loaded leaf by its declaration path (`_assemble` builds the tree once all are in)."""
    loaded[path] = value


def _assemble(cfg: ModelConfig, loaded: dict):
    """The parameter tree of `params.declare_params(cfg)` — its dicts, lists and typed nodes, in declaration
    order (as `init_params`) — with each leaf the one `_set` recorded at its path."""
    from dsv41_jax.model.params import P, children, declare_params

    def build(node, path):
        if isinstance(node, P):
            if path not in loaded:
                raise CheckpointError(f"{'.'.join(map(str, path))}: declared but not loaded")
            return loaded[path]
        got = [(k, build(v, path + (k,))) for k, v in children(node)]
        if isinstance(node, dict):
            return dict(got)
        if isinstance(node, (list, tuple)):
            return [v for _, v in got]
        return type(node)(**dict(got))  # a typed node (`weights.Fp8` / `weights.Mxfp4`)

    return build(declare_params(cfg), ())


def _read_hf_leaf(plan: HFPlan, leaf: ParamLeaf, specs_by_param: dict) -> np.ndarray:
    """One param leaf from an HF dir (stacked experts read expert by expert into one buffer)."""
    specs = specs_by_param[leaf.name]
    if all(spec.name in plan.absent for spec in specs):  # an absent vision-only tensor
        return np.zeros(leaf.shape, leaf.dtype)
    out = np.empty(leaf.shape, leaf.dtype)
    for spec in specs:
        ent = plan.found[spec.name]
        dst = out if spec.expert is None else out[spec.expert]
        read_rows(ent, leaf.dtype, out=dst)  # U8 scales: same bits read as e8m0
    return out


def load_params(path: str, cfg: Optional[ModelConfig] = None, par=None, *, tokenizer=None,
                engram_token_map=None, host_engram: bool = False) -> dict:
    """Load parameters from an HF directory or a converted Orbax directory (`checkpoint_kind`).

    Args:
      path: the model directory, or "tiny" for the tiny preset's random parameters (seed 0).
      cfg: the model config; default: the directory's config.json (`ModelConfig.from_pretrained`).
      par: a mesh plan (`parallel.plan.MeshPlan`; callers with a mesh use `parallel.plan.load_params`):
        each leaf is read on the host and placed straight onto its sharding (`par.param_placement`:
        Engram rows padded to the device count), each device receiving only its block, without a
        whole-tensor copy on one device first (default device without one).
      host_engram: leave the Engram tables on the host as numpy arrays (never copied to a device;
        `parallel.plan.load_params` wraps them as host tables).
      tokenizer: tokenizer.json path or `tokenizers.Tokenizer` for the Engram token map (default: the
        directory's tokenizer.json). engram_token_map: the map itself, if already built.
    Returns the parameter pytree of `params.declare_params(cfg)` (``derived`` included).
    Raises CheckpointError (a ValueError) naming the tensor, file and expected shape/dtype for missing,
    mis-shaped or wrong-dtype tensors; tensors the config does not use are listed in a warning, vision
    tensors skipped with one log line.
    """
    if path == "tiny" and not os.path.isdir(path):  # the preset's random model (= make_checkpoint --seed 0)
        import jax

        from dsv41_jax.model.params import init_params, key_name

        cfg = cfg or ModelConfig.preset("tiny")
        place = _placer(cfg, par, _engram_table_names(cfg) if host_engram else frozenset())
        p = init_params(cfg, jax.random.key(0), tokenizer=tokenizer, engram_token_map=engram_token_map)
        p = jax.tree_util.tree_map_with_path(lambda kp, x: place(".".join(key_name(k) for k in kp), np.asarray(x)), p)
        return p
    path = resolve_model(path)  # "nano": the bundled checkpoint
    kind = checkpoint_kind(path)
    if cfg is None:
        cfg = ModelConfig.from_pretrained(path)
    if cfg.model_family == "deepseek_v4":
        from dsv41_jax.model.v4 import checkpoint as v4  # lazy: it reads with this module's safetensors I/O

        return v4.load_params(path, cfg, par) if kind == "hf" else v4.load_orbax(path, cfg, par)
    place, host = _keeping_host(_placer(cfg, par, _engram_table_names(cfg) if host_engram
                                        else frozenset()), _dequant_sources(cfg))
    params: dict = {}  # {declaration path: leaf}, assembled into the tree at the end
    if kind == "hf":
        plan = scan_hf(path, cfg)
        report_extras(plan)
        by_param: dict = {}
        for spec in expected_tensors(cfg).values():
            by_param.setdefault(spec.param, []).append(spec)
        for leaf in param_leaves(cfg):
            _set(params, leaf.path, place(leaf.name, _read_hf_leaf(plan, leaf, by_param)))
    else:
        _load_orbax(path, cfg, params, place)
    _derive_dequantized(cfg, params, place, host)
    if cfg.engram_layer_ids:
        from dsv41_jax.model.params import engram_token_map_for

        tm = engram_token_map if engram_token_map is not None else engram_token_map_for(
            cfg, _tokenizer_for(path, tokenizer))
        tm = np.asarray(tm, np.int32)
        if tm.shape != (cfg.vocab_size,):
            raise CheckpointError(f"engram token map has shape {tm.shape}, expected ({cfg.vocab_size},)")
        _set(params, ("derived", "engram_token_map"), place("derived.engram_token_map", tm))
    return _assemble(cfg, params)


def _dequant_sources(cfg: ModelConfig) -> frozenset:
    """Names of the fp8 (weight, scale) pairs the load-time dequantized copies are made from."""
    return frozenset(leaf.name.rsplit(".", 1)[0] + "." + k for leaf in param_leaves(cfg, include_derived=True)
                     if leaf.decl.init == "dequant_fp8" for k in ("weight", "scale"))


def _keeping_host(place, names):
    """`place` that also keeps the host arrays of `names` (returned dict, filled as leaves load), so the
    derived copies are computed from host data — never read back from (possibly sharded) devices."""
    kept: dict = {}

    def wrapped(name, a):
        if name in names:
            kept[name] = a
        return place(name, a)

    return wrapped, kept


def _derive_dequantized(cfg: ModelConfig, params: dict, place, host: dict) -> None:
    """Fill the load-time dequantized copies (``init == "dequant_fp8"``, e.g. ``wo_a.bf16``, docs/design/spec.md §3)
    from their loaded fp8 pair (host copies in `host`, by name): exact (e4m3 x 2^k has 4 significant
    bits), on the host, in row blocks."""
    for leaf in param_leaves(cfg, include_derived=True):
        if leaf.decl.init != "dequant_fp8":
            continue
        base = leaf.name.rsplit(".", 1)[0]
        q, s = np.asarray(host.pop(base + ".weight")), np.asarray(host.pop(base + ".scale"))
        out = np.empty(leaf.shape, leaf.dtype)
        for r0, r1 in row_blocks(leaf.shape, 4, READ_BLOCK_BYTES, align=32):  # fp32 working copy per block
            out[r0:r1] = dequant_fp8_block_np(q[r0:r1], s, r0).astype(leaf.dtype)
        _set(params, leaf.path, place(leaf.name, out))


def check_family(meta: dict, cfg: ModelConfig, path: str) -> None:
    """A converted directory's recorded model family (``model_family``; absent: written before V4 conversion,
    i.e. V4.1) must be `cfg`'s."""
    fam = meta.get("model_family", "deepseek_v41")
    if fam != cfg.model_family:
        raise CheckpointError(f"{path}: converted from a {fam} checkpoint, but the config is {cfg.model_family} "
                              f"({cfg.name!r})")


def _load_orbax(path: str, cfg: ModelConfig, params: dict, place) -> None:
    meta = read_orbax_meta(path)
    check_family(meta, cfg, path)
    storage = meta["storage"]
    pdir = os.path.join(path, PARAMS_SUBDIR)
    arrays = orbax_arrays(cfg, storage)
    pairs = quant_pairs(cfg) if storage == "bf16" else {}
    recorded = meta.get("arrays", {})
    leaves = {lf.name: lf for lf in param_leaves(cfg)}
    problems = []
    absent = set()
    for name, (shape, dt, lf) in arrays.items():
        want = f"expected shape {list(shape)} dtype {dt.name}"
        rec = recorded.get(name)
        if rec is None and not os.path.isdir(os.path.join(pdir, name)) and lf.decl.vision_only:
            absent.add(name)  # converted from a text-only release: zeros, as from an HF directory
        elif not os.path.isdir(os.path.join(pdir, name)) or rec is None:
            problems.append(f"{name}: missing from {pdir}; {want}")
        elif tuple(rec["shape"]) != tuple(shape) or rec["dtype"] != dt.name:
            problems.append(f"{name} in {pdir}: found shape {rec['shape']} dtype {rec['dtype']}; {want}")
    extra = sorted(set(recorded) - set(arrays))
    if problems:
        raise CheckpointError(_fmt_problems(problems, path, "converted with another config?" if len(problems) > 2
                                            else ""))
    if extra:
        log.warning("%s: %d arrays this config does not use were ignored: %s", path, len(extra), ", ".join(extra[:20]))
    if absent:
        log.info("%s: %d vision-only arrays absent (%s...), zeros in their place: the text model does not read "
                 "them", path, len(absent), ", ".join(sorted(absent)[:2]))
    for lf in leaves.values():
        if lf.name in absent:
            _set(params, lf.path, place(lf.name, np.zeros(lf.shape, lf.dtype)))
        elif lf.name in arrays:
            shape, dt, _ = arrays[lf.name]
            arr = _ts_open(os.path.join(pdir, lf.name))
            if tuple(arr.shape) != tuple(shape) or np.dtype(arr.dtype.numpy_dtype) != dt:
                raise CheckpointError(f"{lf.name} in {pdir}: the stored array is {arr.dtype.name} "
                                      f"{list(arr.shape)}; expected shape {list(shape)} dtype {dt.name}")
            if lf.name in pairs:
                kind, sname, _ = pairs[lf.name]
                q, s = _requantize_stored(arr, kind, lf)
                _set(params, lf.path, place(lf.name, q))
                _set(params, leaves[sname].path, place(sname, s))
                del q, s
            else:
                _set(params, lf.path, place(lf.name, np.asarray(arr.read().result())))


def _requantize_stored(arr, kind: str, lf: Optional[ParamLeaf], block: int = 32):
    """Re-quantize a stored bf16 weight into (packed, scale) of `kind` (fp8: `block`-square blocks), in row
    blocks."""
    shape = tuple(arr.shape)
    if kind == "mxfp4":  # [E, out, in]: expert by expert
        E, o, i = shape
        q = np.empty((E, o, i // 2), U8)
        s = np.empty((E, o, i // 32), E8M0)
        for e in range(E):
            q[e], s[e] = requantize_np(kind, np.asarray(arr[e].read().result()))
        return q, s
    o, i = shape
    q = np.empty((o, i), FP8)
    s = np.empty(((-(-o // block)), -(-i // block)) if kind == "fp8" else (o, i // 32), E8M0)
    for r0, r1 in row_blocks(shape, 4, READ_BLOCK_BYTES, align=block):  # fp32 working copy per block
        qb, sb = requantize_np(kind, np.asarray(arr[r0:r1].read().result()), block)
        q[r0:r1] = qb
        if kind == "fp8":
            s[r0 // block: r0 // block + sb.shape[0]] = sb
        else:
            s[r0:r1] = sb
    return q, s


def load_model(path: str, **kw) -> tuple:
    """(cfg, params) of a model directory of either kind (see `load_params`)."""
    cfg = ModelConfig.from_pretrained(path)
    return cfg, load_params(path, cfg, **kw)
