"""Convert an HF DeepSeek-V4.1 Flash checkpoint (safetensors) into an Orbax checkpoint.

    python -m dsv41_jax.convert --hf-dir DIR --out DIR [--tp N --ep N] [--dtype keep|bf16] [--resume]

A DeepSeek-V4 release directory (config.json ``model_type`` ``deepseek_v4``: fp8 128x128 blocks, MXFP4 experts,
``tid2eid``) is planned by `convert_v4` into the same output layout and written by the same steps below (its
``--tp``/``--ep`` chunks laid out by V4's mesh rules, `model.v4.params.partition_specs`).

What it does, in order:

1. Validates everything before writing anything: reads config.json and every shard header, checks
   every tensor's name, shape and dtype against the config (docs/design/spec.md §8), checks that no shard is
   truncated, and that the tokenizer agrees with the config (Engram compressed vocabulary). Any
   problem: a message naming each tensor / file and its expected shape and dtype, exit status 2, and
   nothing written.
2. Streams tensor by tensor (in row blocks of ~32 MiB, so peak host memory is a few blocks, far below
   one large tensor) into ``.<out-name>.convert-tmp`` beside --out, with a progress bar (bytes done /
   total, rate, ETA) on stderr. Each finished source tensor is appended, with its CRC-32, to a
   manifest in that temporary directory; ``--resume`` skips the tensors the manifest lists.
3. Writes the Orbax metadata, config.json and the tokenizer files, then publishes the temporary
   directory as --out with one atomic rename, and prints a summary (tensors, bytes per dtype, time).

The output layout (read by `dsv41_jax.model.load_params`; see `dsv41_jax.model.checkpoint`):
``OUT/params/`` is an Orbax PyTree checkpoint (non-OCDBT, zarr v2 + zstd, one array directory per
parameter leaf, routed experts stacked [E, ...]) whose zarr chunks are the per-device shards of the
``--tp``/``--ep`` mesh layout (split further to <= 16 MiB along the leading axis, one chunk per expert),
``OUT/dsv41_checkpoint.json`` records the storage, mesh layout, partition specs and source,
``OUT/conversion_manifest.jsonl`` the CRC-32 of every source tensor.

Exit status: 0 done; 1 failed while writing (the partial result is kept for --resume); 2 invalid
input or arguments (nothing written); 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
import zlib
from typing import Optional

import numpy as np

from dsv41_jax.model import checkpoint as ck
from dsv41_jax.model.config import ConfigError, ModelConfig

CHUNK_BYTES = 8 << 20
BLOCK_BYTES = 16 << 20
STATE_FILE = ".convert_state.json"
MANIFEST_TMP = ".manifest.jsonl"
MANIFEST = "conversion_manifest.jsonl"
ORBAX_HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
COPY_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".md")


class ConvertError(Exception):
    """Invalid input or arguments: reported before anything is written (exit status 2)."""


@dataclasses.dataclass
class ArrayPlan:
    name: str
    path: tuple  # param tree path (str / int keys)
    shape: tuple
    dtype: np.dtype
    chunks: tuple
    spec: list  # partition spec (JSON form)
    stacked: bool


@dataclasses.dataclass
class Item:
    """One unit of work (one manifest line): a source tensor (or a weight + scale pair for --dtype bf16)
    written to `dest` (at expert index `expert` of a stacked array)."""

    key: str
    dest: str
    expert: Optional[int]
    op: str  # "copy" | "cast" (to the array's dtype) | "fp8" | "fp8_rows" | "mxfp4" (dequantize to bf16)
    src: list  # [STEntry] or [weight STEntry, scale STEntry]
    block: int = 32  # fp8 scale block side (DeepSeek-V4: its weight_block_size, 128)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.src)


@dataclasses.dataclass
class Plan:
    hf_dir: str
    cfg: ModelConfig
    hf: ck.HFPlan
    storage: str
    tp: int
    ep: int
    arrays: dict  # name -> ArrayPlan
    items: list
    total_bytes: int


# ================================================================================== planning


def _json_spec(spec) -> list:
    out = []
    for ax in spec:
        out.append(list(ax) if isinstance(ax, tuple) else ax)
    return out


def _shard_shape(shape: tuple, spec: list, mesh_sizes: dict) -> tuple:
    out = []
    for i, dim in enumerate(shape):
        ax = spec[i] if i < len(spec) else None
        axes = [] if ax is None else (ax if isinstance(ax, list) else [ax])
        n = math.prod(mesh_sizes.get(a, 1) for a in axes)
        out.append(dim // n if n and dim % n == 0 else dim)
    return tuple(out)


def _chunks(shape: tuple, shard: tuple, itemsize: int, stacked: bool) -> tuple:
    if not shape:
        return ()
    if stacked:
        return (1,) + tuple(max(1, s) for s in shard[1:])
    row_bytes = max(1, math.prod(shard[1:]) * itemsize)
    rows = max(1, min(shard[0], CHUNK_BYTES // row_bytes))
    if 32 <= rows < shard[0]:
        rows = rows // 32 * 32  # whole 32-row scale blocks per chunk (bf16 storage streams by them)
    return (rows,) + tuple(max(1, s) for s in shard[1:])


def make_plan(hf_dir: str, storage: str = "keep", tp: int = 1, ep: int = 1) -> Plan:
    """Validate an HF directory against its config and plan the conversion (reads headers only)."""
    if storage not in ("keep", "bf16"):
        raise ConvertError(f"--dtype must be keep or bf16, got {storage!r}")
    if tp < 1 or ep < 1:
        raise ConvertError(f"--tp and --ep must be >= 1 (got tp={tp}, ep={ep})")
    if not os.path.isdir(hf_dir):
        raise ConvertError(f"--hf-dir {hf_dir}: no such directory")
    try:
        kind = ck.checkpoint_kind(hf_dir)
    except ck.CheckpointError as e:
        raise ConvertError(str(e)) from e
    if kind != "hf":
        raise ConvertError(f"--hf-dir {hf_dir} is already a converted Orbax checkpoint")
    try:
        cfg = ModelConfig.from_pretrained(hf_dir)
    except ConfigError as e:
        raise ConvertError(f"{hf_dir}: config: {e}") from e
    specs = partition_specs(cfg, tp, ep)
    if cfg.model_family == "deepseek_v4":  # the V4 release layout (`convert_v4`): same output layout
        from dsv41_jax import convert_v4

        return convert_v4.make_plan(hf_dir, cfg, storage, tp, ep, specs)
    hf = ck.scan_hf(hf_dir, cfg)  # CheckpointError lists every bad tensor
    tok = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(tok):
        raise ConvertError(f"{hf_dir}: no tokenizer.json (the converted checkpoint needs it for the Engram "
                           "token map and the chat template)")
    if cfg.engram_layer_ids:
        from dsv41_jax.model.params import engram_token_map_for

        try:
            engram_token_map_for(cfg, tok)
        except (ConfigError, ValueError) as e:
            raise ConvertError(f"{tok} disagrees with config.json: {e}") from e

    arrays = {}
    for name, (shape, dt, leaf) in ck.orbax_arrays(cfg, storage).items():
        if name in hf.absent:
            continue  # a vision-only tensor the release does not have: the loader puts zeros there
        arrays[name] = array_plan(name, leaf.path, shape, dt, leaf.stacked, specs, tp, ep)
    pairs = ck.quant_pairs(cfg) if storage == "bf16" else {}
    scale_of = {v[1]: w for w, v in pairs.items()}
    items = []
    for spec in ck.expected_tensors(cfg).values():
        if spec.name in hf.absent:
            continue
        ent = hf.found[spec.name]
        if spec.param in scale_of:
            continue  # written with its weight
        if spec.param in pairs:
            sname = spec.name[: -len("weight")] + "scale"
            items.append(Item(spec.name, spec.param, spec.expert, pairs[spec.param][0], [ent, hf.found[sname]]))
        else:
            items.append(Item(spec.name, spec.param, spec.expert, "copy", [ent]))
    return Plan(hf_dir, cfg, hf, storage, tp, ep, arrays, items, sum(i.nbytes for i in items))


def partition_specs(cfg: ModelConfig, tp: int, ep: int) -> dict:
    """{array name: partition spec (JSON form)} of the intended ``tp`` x ``ep`` mesh: the zarr chunks are its
    per-device shards and it is recorded in the metadata (DeepSeek-V4: `model.v4.params.partition_specs`, the same
    logical-axis table)."""
    if cfg.model_family == "deepseek_v4":
        from dsv41_jax.model.v4.params import partition_specs as v4_specs

        return {n: _json_spec(s) for n, s in v4_specs(cfg, tp, ep).items()}
    from jax.sharding import AbstractMesh

    from dsv41_jax.model.params import flatten_names, mesh_shardings

    return {n: _json_spec(s.spec) for n, s in
            flatten_names(mesh_shardings(cfg, AbstractMesh((tp, ep), ("tp", "ep")))).items()}


def array_plan(name: str, path: tuple, shape: tuple, dt, stacked: bool, specs: dict, tp: int, ep: int) -> ArrayPlan:
    """The stored array `name` (param tree `path`, `shape`, np dtype `dt`, experts `stacked` on axis 0) chunked
    as its per-device shard of spec ``specs[name]`` (replicated when absent)."""
    dt = np.dtype(dt)
    spec = specs.get(name, [None] * len(shape))
    shard = _shard_shape(tuple(shape), spec, {"tp": tp, "ep": ep})
    return ArrayPlan(name, tuple(path), tuple(shape), dt, _chunks(tuple(shape), shard, dt.itemsize, stacked), spec,
                     stacked)


def _fingerprint(plan: Plan) -> dict:
    """What a resumed run must share with the interrupted one."""
    import hashlib

    h = hashlib.sha256()
    for it in plan.items:
        for e in it.src:
            h.update(f"{it.key}|{e.name}|{os.path.basename(e.file)}|{e.dtype}|{e.shape}|{e.begin}|{e.end}\n".encode())
    with open(os.path.join(plan.hf_dir, "config.json") if os.path.isfile(os.path.join(plan.hf_dir, "config.json"))
              else os.path.join(plan.hf_dir, "inference", "config.json"), "rb") as f:
        cfg_sha = hashlib.sha256(f.read()).hexdigest()
    return {"version": 1, "hf_dir": os.path.abspath(plan.hf_dir), "storage": plan.storage, "tp": plan.tp,
            "ep": plan.ep, "chunk_bytes": CHUNK_BYTES, "config_sha256": cfg_sha, "tensors_sha256": h.hexdigest()}


# ================================================================================== writing


class Progress:
    """Bytes done / total with rate and ETA on stderr (tqdm when installed, else a plain line)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self.total, self.n, self.start_n = total, initial, initial
        self.t0 = self.last = time.time()
        self.enabled = enabled
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024,
                                desc="convert", file=sys.stderr, mininterval=0.5, dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def update(self, k: int) -> None:
        self.n += k
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(k)
            return
        now = time.time()
        if now - self.last >= 0.5 or self.n >= self.total:
            self.last = now
            rate = (self.n - self.start_n) / max(now - self.t0, 1e-9)
            eta = (self.total - self.n) / rate if rate > 0 else float("inf")
            eta_s = time.strftime("%H:%M:%S", time.gmtime(eta)) if math.isfinite(eta) else "?"
            sys.stderr.write(f"\rconvert: {_human(self.n)} / {_human(self.total)} "
                             f"({100.0 * self.n / max(self.total, 1):5.1f}%) {_human(rate)}/s ETA {eta_s}   ")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            sys.stderr.write("\n")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024.0
    return f"{n:.1f} TiB"


def _ts_context():
    import tensorstore as ts

    # No fsync per chunk: `_Durability` fsyncs the touched array directories before each manifest fsync.
    return ts.Context({"cache_pool": {"total_bytes_limit": 0}, "file_io_concurrency": {"limit": 32},
                       "file_io_sync": False,
                       "data_copy_concurrency": {"limit": max(1, min(16, os.cpu_count() or 1))}})


def _open_dest(params_dir: str, ap: ArrayPlan, ctx):
    import tensorstore as ts

    spec = {
        "driver": "zarr",
        "kvstore": {"driver": "file", "path": os.path.join(os.path.abspath(params_dir), ap.name)},
        "dtype": ap.dtype.name,
        "metadata": {"shape": list(ap.shape), "chunks": list(ap.chunks), "compressor": {"id": "zstd", "level": 1},
                     "dimension_separator": ".", "order": "C", "filters": None},
        "store_data_equal_to_fill_value": True,
    }
    return ts.open(spec, create=True, open=True, context=ctx).result()


def _read_block(ent: ck.STEntry, dtype, r0, r1, fd) -> np.ndarray:
    return ck.read_rows(ent, dtype, r0, r1, fd=fd)


def _write_item(item: Item, ap: ArrayPlan, arr, fds: dict) -> tuple:
    """Stream one item into `arr`; returns ([source crc32], dest crc32)."""

    def fd_of(ent):
        if ent.file not in fds:
            fds[ent.file] = os.open(ent.file, os.O_RDONLY)
        return fds[ent.file]

    dst = arr if item.expert is None else arr[item.expert]
    src_crcs = []
    dcrc = 0
    pending = None
    if item.op in ("copy", "cast"):
        ent = item.src[0]
        dt = ap.dtype if item.op == "copy" else ent.np_dtype  # copy: U8 scales read as e8m0 (same bits)
        align = ap.chunks[0] if (ap.chunks and item.expert is None) else 1
        crc = 0
        for r0, r1 in ck.row_blocks(ent.shape, dt.itemsize, BLOCK_BYTES, align=align):
            buf = _read_block(ent, dt, r0, r1, fd_of(ent))
            crc = zlib.crc32(buf.reshape(-1).view(np.uint8), crc)
            if item.op == "cast":  # e.g. a V4 f16 float kept as fp32, an int64 table as int32
                buf = buf.astype(ap.dtype)
                dcrc = zlib.crc32(buf.reshape(-1).view(np.uint8), dcrc)
            fut = (dst[r0:r1] if ent.shape else dst).write(buf if ent.shape else buf.reshape(()))
            if pending is not None:
                pending.result()
            pending = fut
        src_crcs, dcrc = [crc], (crc if item.op == "copy" else dcrc)
    else:
        w_ent, s_ent = item.src
        s = ck.read_tensor(s_ent, ck.E8M0)
        scrc = zlib.crc32(s.reshape(-1).view(np.uint8))
        wdt = ck.U8 if item.op == "mxfp4" else ck.FP8
        if item.op == "mxfp4":
            blocks = [(0, w_ent.shape[0])]
        else:
            align = math.lcm(item.block, ap.chunks[0] if item.expert is None else 1)
            blocks = ck.row_blocks(w_ent.shape, 8, BLOCK_BYTES, align=align)  # ~fp32 + bf16 per element
        wcrc = 0
        for r0, r1 in blocks:
            q = _read_block(w_ent, wdt, r0, r1, fd_of(w_ent))
            wcrc = zlib.crc32(q.reshape(-1).view(np.uint8), wcrc)
            if item.op == "fp8":
                f = ck.dequant_fp8_block_np(q, s, r0, item.block)
            elif item.op == "fp8_rows":
                f = ck.dequant_fp8_rows_np(q, s[r0:r1])
            else:
                f = ck.dequant_mxfp4_np(q, s)
            del q
            b = f.astype(ck.BF16)
            del f
            dcrc = zlib.crc32(b.reshape(-1).view(np.uint8), dcrc)
            fut = dst[r0:r1].write(b)
            if pending is not None:
                pending.result()
            pending = fut
        src_crcs = [wcrc, scrc]
    if pending is not None:
        pending.result()
    return src_crcs, dcrc


class _Durability:
    """Makes written data durable before the manifest lines that vouch for it: at most once a second
    (and at the end) fsync every file of the array directories written since the last sync, then the
    manifest. A crash can only lose manifest lines, whose tensors `--resume` then writes again."""

    def __init__(self, manifest_file, interval: float = 1.0):
        self.mf, self.interval, self.last, self.dirs = manifest_file, interval, time.time(), set()

    def touched(self, d: str) -> None:
        self.dirs.add(d)

    def maybe_sync(self, force: bool = False) -> None:
        if not force and time.time() - self.last < self.interval:
            return
        for d in sorted(self.dirs):
            for fn in os.listdir(d):
                if os.path.isfile(os.path.join(d, fn)):
                    _fsync_file(os.path.join(d, fn))
            _fsync_file(d)
        self.dirs.clear()
        self.mf.flush()
        os.fsync(self.mf.fileno())
        self.last = time.time()


def _fsync_file(p: str) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(p: str, obj) -> None:
    with open(p, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _load_manifest(path: str) -> dict:
    done = {}
    if not os.path.isfile(path):
        return done
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
                done[rec["key"]] = rec
            except (json.JSONDecodeError, KeyError, TypeError):
                break  # a torn last line: everything after it is redone
    return done


def _item_ok(item: Item, rec: dict, params_dir: str) -> bool:
    srcs = rec.get("sources", [])
    if len(srcs) != len(item.src):
        return False
    for e, r in zip(item.src, srcs):
        if r.get("name") != e.name or r.get("file") != os.path.basename(e.file) or r.get("nbytes") != e.nbytes:
            return False
    return os.path.isfile(os.path.join(params_dir, item.dest, ".zarray"))


def _orbax_metadata(plan: Plan) -> dict:
    tree = {}
    for ap in plan.arrays.values():
        keys = [str(k) for k in ap.path]
        tree[str(tuple(keys))] = {
            "key_metadata": [{"key": str(k), "key_type": 1 if isinstance(k, int) else 2} for k in ap.path],
            "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": list(ap.chunks)},
        }
    return {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}


def _our_metadata(plan: Plan) -> dict:
    from dsv41_jax.model.params import DEFAULT_LOGICAL_RULES

    by_dtype: dict = {}
    arrays = {}
    for ap in plan.arrays.values():
        nb = math.prod(ap.shape) * ap.dtype.itemsize
        by_dtype[ap.dtype.name] = by_dtype.get(ap.dtype.name, 0) + nb
        arrays[ap.name] = {"shape": list(ap.shape), "dtype": ap.dtype.name, "chunks": list(ap.chunks),
                           "partition_spec": ap.spec, "bytes": nb}
    src_by_dtype: dict = {}
    for it in plan.items:
        for e in it.src:
            src_by_dtype[e.dtype] = src_by_dtype.get(e.dtype, 0) + e.nbytes
    return {
        "format": ck.ORBAX_FORMAT, "version": ck.ORBAX_VERSION, "storage": plan.storage,
        "model_family": plan.cfg.model_family, "params_dir": ck.PARAMS_SUBDIR,
        "mesh": {"tp": plan.tp, "ep": plan.ep, "axis_names": ["tp", "ep"],
                 "logical_rules": [list(r) for r in DEFAULT_LOGICAL_RULES]},
        "source": {"tensors": sum(len(it.src) for it in plan.items), "bytes": plan.total_bytes,
                   "bytes_by_dtype": src_by_dtype,
                   "shards": [os.path.basename(f) for f in plan.hf.files],
                   "skipped_vision": len(plan.hf.vision),
                   "skipped_unknown": [e.name for e in plan.hf.unknown]},
        "bytes_by_dtype": by_dtype,
        "arrays": arrays,
    }


def _copy_side_files(plan: Plan, tmp: str) -> list:
    copied = []
    for fn in sorted(os.listdir(plan.hf_dir)):
        p = os.path.join(plan.hf_dir, fn)
        if (os.path.isfile(p) and fn.endswith(COPY_SUFFIXES) and fn != ck.INDEX_FILE
                and os.path.getsize(p) <= 256 << 20):
            shutil.copyfile(p, os.path.join(tmp, fn))
            copied.append(fn)
    if "config.json" not in copied:  # flat inference/config.json only: write the HF form
        _write_json(os.path.join(tmp, "config.json"), plan.cfg.to_hf_dict())
        copied.append("config.json")
    return copied


def temp_dir_for(out: str) -> str:
    out = os.path.abspath(out)
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.convert-tmp")


def convert(plan: Plan, out: str, *, resume: bool = False, overwrite: bool = False, progress: bool = True,
            verify: bool = False, log=print) -> dict:
    """Run a planned conversion into `out` (see the module docstring). Returns the summary dict."""
    t0 = time.time()
    out = os.path.abspath(out)
    tmp = temp_dir_for(out)
    params_dir = os.path.join(tmp, ck.PARAMS_SUBDIR)
    state = _fingerprint(plan)
    state_path = os.path.join(tmp, STATE_FILE)
    if os.path.isdir(tmp):
        if not resume:
            raise ConvertError(f"found an interrupted conversion in {tmp}: rerun with --resume to continue it, "
                               "or delete that directory to start over")
        try:
            with open(state_path, encoding="utf-8") as f:
                old = json.load(f)
        except (OSError, json.JSONDecodeError):
            old = None
        if old != state:
            diff = sorted(k for k in set(state) | set(old or {}) if (old or {}).get(k) != state.get(k))
            raise ConvertError(f"{tmp} holds an interrupted conversion with other settings or sources "
                               f"(differs in: {', '.join(diff) or 'unreadable state'}); rerun with the same "
                               "--hf-dir/--dtype/--tp/--ep, or delete it to start over")
    else:
        os.makedirs(params_dir)
        _write_json(state_path, state)
    manifest_path = os.path.join(tmp, MANIFEST_TMP)
    done = _load_manifest(manifest_path) if resume else {}
    # Rewrite the manifest without a torn tail, keeping only entries that still hold.
    keep = [it for it in plan.items if it.key in done and _item_ok(it, done[it.key], params_dir)]
    with open(manifest_path + ".new", "w", encoding="utf-8") as f:
        for it in keep:
            f.write(json.dumps(done[it.key]) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(manifest_path + ".new", manifest_path)
    skip = {it.key for it in keep}
    skipped_bytes = sum(it.nbytes for it in keep)
    if skip:
        log(f"resuming: {len(skip)} of {len(plan.items)} tensors ({_human(skipped_bytes)}) already converted")
    ctx = _ts_context()
    bar = Progress(plan.total_bytes, skipped_bytes, progress)
    fds: dict = {}
    written = 0
    try:
        with open(manifest_path, "a", encoding="utf-8") as mf:
            cur_name, cur = None, None
            dur = _Durability(mf)
            for it in plan.items:
                if it.key in skip:
                    continue
                ap = plan.arrays[it.dest]
                if cur_name != it.dest:
                    cur_name, cur = it.dest, _open_dest(params_dir, ap, ctx)
                    dur.touched(params_dir)
                crcs, dcrc = _write_item(it, ap, cur, fds)
                rec = {"key": it.key, "dest": it.dest, "expert": it.expert, "op": it.op, "dest_crc32": dcrc,
                       "sources": [{"name": e.name, "file": os.path.basename(e.file), "dtype": e.dtype,
                                    "nbytes": e.nbytes, "crc32": c} for e, c in zip(it.src, crcs)]}
                mf.write(json.dumps(rec) + "\n")
                mf.flush()  # a killed process loses nothing; an OS crash at most the lines since the last sync
                dur.touched(os.path.join(params_dir, it.dest))
                dur.maybe_sync()
                done[it.key] = rec
                written += 1
                bar.update(it.nbytes)
            dur.maybe_sync(force=True)
    finally:
        bar.close()
        for fd in fds.values():
            os.close(fd)
    verified = _verify(plan, params_dir, done, ctx) if verify else None
    # Metadata, side files, publish.
    _write_json(os.path.join(params_dir, "_METADATA"), _orbax_metadata(plan))
    meta = _our_metadata(plan)
    now = time.time_ns()
    _write_json(os.path.join(params_dir, "_CHECKPOINT_METADATA"), {
        "item_handlers": ORBAX_HANDLER, "metrics": {}, "performance_metrics": {},
        "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now,
        "custom_metadata": {"format": ck.ORBAX_FORMAT, "storage": plan.storage}})
    _write_json(os.path.join(tmp, ck.META_FILE), meta)
    copied = _copy_side_files(plan, tmp)
    os.replace(manifest_path, os.path.join(tmp, MANIFEST))
    _fsync_file(os.path.join(tmp, MANIFEST))
    os.remove(state_path)
    _fsync_file(tmp)
    old = None
    if os.path.exists(out):
        if not overwrite:
            raise ConvertError(f"{out} appeared while converting; the result is in {tmp}")
        old = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.old-{os.getpid()}")
        os.rename(out, old)
    os.rename(tmp, out)
    _fsync_file(os.path.dirname(out))
    if old:
        shutil.rmtree(old, ignore_errors=True)
    dt = time.time() - t0
    return {"out": out, "tensors": sum(len(it.src) for it in plan.items), "items": len(plan.items),
            "resumed": len(skip), "written": written, "arrays": len(plan.arrays), "source_bytes": plan.total_bytes,
            "source_bytes_by_dtype": meta["source"]["bytes_by_dtype"], "bytes_by_dtype": meta["bytes_by_dtype"],
            "skipped_vision": len(plan.hf.vision), "skipped_unknown": len(plan.hf.unknown), "files": copied,
            "verified": verified, "seconds": dt}


def _verify(plan: Plan, params_dir: str, done: dict, ctx) -> dict:
    """Read every written region back and compare its CRC-32 with the manifest's; raises on the first
    mismatch. Returns what was checked: {"items": n, "bytes": bytes read back}."""
    import tensorstore as ts

    cur_name, cur = None, None
    nbytes = 0
    for it in plan.items:
        ap = plan.arrays[it.dest]
        if cur_name != it.dest:
            cur_name = it.dest
            cur = ts.open(ck.zarr_spec(os.path.join(params_dir, it.dest)), open=True, read=True, context=ctx).result()
        dst = cur if it.expert is None else cur[it.expert]
        crc = 0
        shape = tuple(dst.shape)
        for r0, r1 in ck.row_blocks(shape, ap.dtype.itemsize, BLOCK_BYTES):
            b = np.asarray((dst[r0:r1] if shape else dst).read().result())
            crc = zlib.crc32(b.reshape(-1).view(np.uint8), crc)
            nbytes += b.nbytes
        if crc != done[it.key]["dest_crc32"]:
            raise RuntimeError(f"verify: {it.dest}{'' if it.expert is None else f'[{it.expert}]'} (from {it.key}) "
                               f"reads back with CRC-32 {crc:#010x}, expected {done[it.key]['dest_crc32']:#010x}")
    return {"items": len(plan.items), "bytes": nbytes}


# ================================================================================== CLI


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m dsv41_jax.convert",
        description="Convert an HF DeepSeek-V4.1 Flash checkpoint (safetensors shards + config.json + "
                    "tokenizer.json) into an Orbax checkpoint that dsv41_jax.model.load_params reads. "
                    "A DeepSeek-V4 (Flash / Pro) release directory (config.json model_type deepseek_v4) "
                    "converts the same way, for one device (--tp 1 --ep 1). "
                    "Everything is validated before anything is written; the result appears at --out "
                    "atomically when complete.",
        epilog="Exit status: 0 done; 1 failed while writing (partial result kept for --resume); 2 invalid "
               "input or arguments (nothing written); 130 interrupted.")
    ap.add_argument("--hf-dir", required=True, metavar="DIR",
                    help="the HF model directory (DeepSeek-V4.1, or DeepSeek-V4 in its release layout): config.json "
                         "(or inference/config.json), model.safetensors.index.json and its shards, tokenizer.json")
    ap.add_argument("--out", required=True, metavar="DIR",
                    help="where the converted checkpoint is published (must not exist unless --overwrite); "
                         "work happens in .<name>.convert-tmp beside it")
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="tensor-parallel size of the intended mesh (axis 'tp'); sets the zarr chunking to the "
                         "per-device shards and is recorded in the metadata (default 1)")
    ap.add_argument("--ep", type=int, default=1, metavar="N",
                    help="expert-parallel size of the intended mesh (axis 'ep'), as --tp (default 1)")
    ap.add_argument("--dtype", choices=("keep", "bf16"), default="keep",
                    help="keep: store the fp8 weights, packed MXFP4 experts and e8m0 scales byte for byte "
                         "(default); bf16: store each quantized weight dequantized to bf16 (about 2x / 4x larger; "
                         "re-quantized exactly at load)")
    ap.add_argument("--resume", action="store_true",
                    help="continue an interrupted conversion from its temporary directory, skipping the tensors "
                         "already written (same --hf-dir/--dtype/--tp/--ep required)")
    ap.add_argument("--overwrite", action="store_true", help="replace --out if it already exists")
    ap.add_argument("--verify", action="store_true",
                    help="after writing, read every array back and check it against the manifest's CRC-32")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def _return_freed_memory() -> None:
    """glibc: serve every allocation >= 1 MiB with its own mmap, so freed stream blocks go back to the OS
    (the default dynamic threshold keeps them in per-thread heaps, growing the peak tensor after tensor)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _return_freed_memory()
    out = os.path.abspath(args.out)
    try:
        if os.path.exists(out) and not args.overwrite:
            raise ConvertError(f"--out {out} already exists (pass --overwrite to replace it)")
        if os.path.abspath(args.hf_dir) == out:
            raise ConvertError("--out must differ from --hf-dir")
        parent = os.path.dirname(out)
        if not os.path.isdir(parent):
            raise ConvertError(f"--out {out}: parent directory {parent} does not exist")
        plan = make_plan(args.hf_dir, args.dtype, args.tp, args.ep)
        free = shutil.disk_usage(parent).free
        need = sum(math.prod(a.shape) * a.dtype.itemsize for a in plan.arrays.values())
        if need > free:
            print(f"warning: the output needs up to {_human(need)} (before compression) and {parent} has "
                  f"{_human(free)} free", file=sys.stderr)
        print(f"converting {args.hf_dir}: {len(plan.items)} tensors, {_human(plan.total_bytes)} -> {out} "
              f"(storage {plan.storage}, mesh tp={plan.tp} ep={plan.ep})", file=sys.stderr)
        if plan.hf.vision:
            print(f"skipping {len(plan.hf.vision)} vision tensors (text-only model)", file=sys.stderr)
        if plan.hf.unknown:
            names = [f"{e.name} ({os.path.basename(e.file)})" for e in plan.hf.unknown]
            print(f"warning: ignoring {len(names)} tensors this config does not use: {', '.join(names[:20])}"
                  f"{' ...' if len(names) > 20 else ''}", file=sys.stderr)
    except (ConvertError, ck.CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        print("nothing was written.", file=sys.stderr)
        return 2
    try:
        s = convert(plan, out, resume=args.resume, overwrite=args.overwrite, progress=not args.quiet,
                    verify=args.verify, log=lambda m: print(m, file=sys.stderr))
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted; the partial conversion is kept in {temp_dir_for(out)}: rerun with --resume",
              file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001  (any I/O or tensorstore failure)
        print(f"error: conversion failed: {type(e).__name__}: {e}\nthe partial conversion is kept in "
              f"{temp_dir_for(out)}: fix the cause and rerun with --resume", file=sys.stderr)
        return 1
    lines = [f"converted {args.hf_dir} -> {s['out']} in {s['seconds']:.1f} s "
             f"({_human(s['source_bytes'] / max(s['seconds'], 1e-9))}/s)",
             f"  source tensors: {s['tensors']} ({_human(s['source_bytes'])}); written now: {s['written']} items, "
             f"resumed (already done): {s['resumed']}",
             f"  skipped: {s['skipped_vision']} vision, {s['skipped_unknown']} unknown",
             f"  orbax arrays: {s['arrays']} (storage {plan.storage}, mesh tp={plan.tp} ep={plan.ep})",
             "  bytes per dtype (stored): " + ", ".join(f"{k} {v:,}" for k, v in sorted(s["bytes_by_dtype"].items())),
             "  bytes per dtype (source): " + ", ".join(f"{k} {v:,}" for k, v in
                                                        sorted(s["source_bytes_by_dtype"].items())),
             f"  copied: {', '.join(s['files'])}"]
    if s["verified"] is not None:
        lines.append(f"  verified: {s['verified']['items']} items ({_human(s['verified']['bytes'])}) read back; every "
                     "CRC-32 matches the manifest")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
