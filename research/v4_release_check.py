"""Hold our DeepSeek-V4 side against release files brought into a scratch folder by hand (issue 48; never committed).

DeepSeek's own V4 repository is not reachable from here (no GitHub repository; the checkpoints and their
``inference/`` and ``encoding/`` folders live on Hugging Face). What was reachable is a third-party GitHub copy of
the DeepSeek-V4-Pro release folder without weights (Nicooo-Wang/DeepSeek-V4-Pro-code: config.json,
encoding/encoding_dsv4.py with its tests, inference/ with a model.py modified for debugging and a pure-torch
kernel.py replacing the TileLang kernels). This script checks what can be checked from such a folder:

1. ``config.json`` read by `ModelConfig.from_pretrained` equals our ``pro-v4`` (or ``flash-v4``) preset, field for
   field (the presets were transcribed from third-party copies; docs/design/v4.md);
2. the release encoder's test suite (``encoding/tests/test_input_N.json`` -> ``test_output_N.txt``, thinking mode
   for cases 1-3, chat for 4, as its ``test_encoding_dsv4.py`` calls it) against `encode_messages_v4` with the
   folder's own prose (`load_v4_wording`, read with ``ast``, never executed).

The forward comparison against ``inference/model.py`` is not run here: docs/benchmarks.md says why.

    mkdir /tmp/v4ref && (cd <copy> && git archive HEAD encoding inference config.json | tar -x -C /tmp/v4ref)
    python research/v4_release_check.py --ref /tmp/v4ref
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

# the release test suite's cases: (input file number, thinking mode), as encoding/test_encoding_dsv4.py runs them
CASES = ((1, True), (2, True), (3, True), (4, False))


def check_config(ref: str) -> dict:
    from dsv41_jax.model import ModelConfig

    cfg = ModelConfig.from_pretrained(ref)
    preset = "pro-v4" if cfg.num_hidden_layers == 61 else "flash-v4"
    want = ModelConfig.preset(preset)
    diff = {f.name: [repr(getattr(cfg, f.name)), repr(getattr(want, f.name))] for f in dataclasses.fields(cfg)
            if f.name != "name" and getattr(cfg, f.name) != getattr(want, f.name)}
    return {"check": "config", "preset": preset, "equal": not diff, "differences": diff}


def check_encoding(ref: str) -> list:
    from dsv41_jax.chat_format.encoding_v4 import encode_messages_v4, load_v4_wording

    wording = load_v4_wording(ref)
    out = []
    for i, thinking in CASES:
        with open(os.path.join(ref, "encoding", "tests", f"test_input_{i}.json"), encoding="utf-8") as f:
            data = json.load(f)
        with open(os.path.join(ref, "encoding", "tests", f"test_output_{i}.txt"), encoding="utf-8") as f:
            gold = f.read()
        msgs, tools = (data["messages"], data.get("tools")) if isinstance(data, dict) else (data, None)
        row = {"check": "encoding", "case": i, "thinking": thinking, "wording": wording.source}
        try:
            got = encode_messages_v4(msgs, tools=tools, thinking=thinking, wording=wording)
        except Exception as e:  # noqa: BLE001 - a refusal is a result here (e.g. a role we do not accept)
            out.append(dict(row, result="refused", error=str(e)))
            continue
        if got == gold:
            out.append(dict(row, result="match", chars=len(gold)))
        else:
            k = next((j for j in range(min(len(got), len(gold))) if got[j] != gold[j]), min(len(got), len(gold)))
            out.append(dict(row, result="differs", at=k, ours=got[max(0, k - 60):k + 60], gold=gold[max(0, k - 60):k + 60]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="scratch folder holding the release files (config.json, encoding/)")
    args = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(args.ref, "config.json")):
        print(f"error: --ref {args.ref!r}: no config.json there", file=sys.stderr)
        return 2
    rows = [check_config(args.ref)]
    if os.path.isdir(os.path.join(args.ref, "encoding", "tests")):
        rows += check_encoding(args.ref)
    for r in rows:
        print(json.dumps(r, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
