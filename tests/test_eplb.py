"""Redundant-expert placement (`parallel.eplb`, issue 46 item 7): replication, packing, the distribution
file, the refusals, and the report script on a recorded distribution (no model run: a file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dsv41_jax.parallel import eplb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_replicate_gives_copies_to_the_hottest_per_copy():
    # 100 tokens on expert 1, 40 on 3: copies go 1, 1 (100/2 = 50 > 40), 3 (40 > 33.3), then 1 again
    assert eplb.replicate([10, 100, 10, 40], 1).tolist() == [1, 2, 1, 1]
    assert eplb.replicate([10, 100, 10, 40], 2).tolist() == [1, 3, 1, 1]
    assert eplb.replicate([10, 100, 10, 40], 3).tolist() == [1, 3, 1, 2]
    assert eplb.replicate([5, 5, 5, 5], 2).tolist() == [2, 2, 1, 1]  # ties: the lower id first
    with pytest.raises(ValueError, match="num_redundant"):
        eplb.replicate([1, 2], -1)
    with pytest.raises(ValueError, match=">= 0"):
        eplb.replicate([1, -2], 0)
    with pytest.raises(ValueError, match="do not fit"):
        eplb.replicate([1, 2], 3, max_copies=2)


def test_pack_fills_each_device_and_keeps_copies_apart():
    load = np.array([400, 30, 30, 30, 30, 30, 30, 20])
    assert eplb.replicate(load, 4).tolist() == [5, 1, 1, 1, 1, 1, 1, 1]  # uncapped: 5 copies of expert 0
    copies = eplb.replicate(load, 4, max_copies=4)  # at most one copy per device
    assert copies.tolist() == [4, 2, 1, 1, 1, 1, 1, 1]
    p = eplb.pack(load, copies, 4)
    assert [len(h) for h in p.physical] == [3, 3, 3, 3]
    assert sorted(e for h in p.physical for e in h) == sorted(e for e in range(8) for _ in range(copies[e]))
    for e in range(8):  # no device holds two copies of one expert
        assert len(set(p.owners(e))) == len(p.owners(e)) == copies[e]
    loads = eplb.device_loads(load, p)
    assert loads.sum() == pytest.approx(load.sum())
    # the hot expert's 400 tokens over its copies: far flatter than today's contiguous split
    today = np.array([load[0:2].sum(), load[2:4].sum(), load[4:6].sum(), load[6:8].sum()])
    assert loads.max() / loads.mean() < 1.1 < today.max() / today.mean()
    with pytest.raises(ValueError, match="evenly over 5 devices"):
        eplb.pack(load, copies, 5)


def test_plan_refuses_what_cannot_be_placed():
    dist = {0: np.arange(8), 3: np.arange(8)[::-1]}
    plan = eplb.plan_placement(dist, 4, 4)
    assert sorted(plan) == [0, 3] and all(sum(p.copies) == 12 for p in plan.values())
    with pytest.raises(ValueError, match="do not divide evenly over 4 devices"):
        eplb.plan_placement(dist, 4, 3)
    with pytest.raises(ValueError, match="more copies than"):
        eplb.plan_placement(dist, 2, 10)  # 8 experts over 2 devices hold at most 8 extra copies apart


def test_distribution_file_round_trip_and_bad_files(tmp_path):
    dist = {1: np.array([3, 0, 7, 1]), 14: np.array([2, 2, 2, 2])}
    f = tmp_path / "d.json"
    eplb.save_distribution(str(f), dist)
    back = eplb.load_distribution(str(f))
    assert sorted(back) == [1, 14] and all((back[k] == dist[k]).all() for k in dist)
    bad = tmp_path / "bad.json"
    for content, msg in (("{", "Expecting"), (json.dumps({"layers": {}}), "not an expert distribution"),
                         (json.dumps({"format": eplb.FORMAT, "num_experts": 4, "layers": {"0": [1, 2]}}),
                          "expected 4 non-negative"),
                         (json.dumps({"format": eplb.FORMAT, "num_experts": 4, "layers": {}}), "no layers")):
        bad.write_text(content)
        with pytest.raises(ValueError, match=msg):
            eplb.load_distribution(str(bad))
    with pytest.raises(ValueError, match="--init-expert-location"):
        eplb.load_distribution(str(tmp_path / "missing.json"))


def test_report_script_on_a_distribution_file(tmp_path):
    rng = np.random.default_rng(7)
    dist = {lid: rng.zipf(1.6, 8).astype(np.int64) * 10 for lid in range(3)}
    f = tmp_path / "d.json"
    eplb.save_distribution(str(f), dist)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "eplb_report.py"), "--distribution", str(f),
                        "--devices", "4", "--redundant", "0,4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {ln.split("|")[1].strip(): float(ln.split("|")[-2]) for ln in r.stdout.splitlines()
            if ln.startswith("| ") and not ln.startswith("| placement")}
    assert set(rows) == {"contiguous (today's EP)", "EPLB R=0", "EPLB R=4"}
    assert rows["EPLB R=4"] <= rows["EPLB R=0"] <= rows["contiguous (today's EP)"]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "eplb_report.py"), "--distribution", str(f),
                        "--devices", "4", "--redundant", "3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "eplb_report.py"), "--distribution", str(f),
                        "--measure-dispatch"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs a recording" in r.stderr and not r.stdout, r.stderr
