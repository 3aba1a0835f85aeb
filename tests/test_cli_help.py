"""The server CLI's --help and spellings: each default said once (no argparse "(default: None)" after a
help text that already explains it), the compilation cache default as it resolves here, and vLLM's
flag names as aliases of ours."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import pytest

from dsv41_jax.serve import build_parser


def _options_help(parser) -> dict:
    """{first option string: its help text with whitespace collapsed}."""
    text = parser.format_help()
    out = {}
    for block in re.split(r"\n  (?=-)", text)[1:]:  # [0]: usage and description
        head = block.split()[0].rstrip(",")
        out[head] = " ".join(block.split())
    return out


def test_help_states_each_default_once(monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg/cache")
    helps = _options_help(build_parser())
    assert len(helps) > 40
    assert not [o for o, h in helps.items() if "(default: None)" in h]
    twice = [o for o, h in helps.items() if len(re.findall(r"\bdefault\b", h, re.IGNORECASE)) > 1
             and o != "--log-level-http"]  # the last option's block also holds the epilog
    assert not twice, twice
    assert "default 32, 4 for a small model" in helps["--max-running-requests"]
    assert "(default: 30000)" in helps["--port"]  # argparse's own note stays where the help gives none
    cache = helps["--compilation-cache-dir"]
    assert "here: /xdg/cache/dsv41_jax/jax" in cache


def test_vllm_spellings_parse_to_our_flags():
    p = build_parser()
    ours = p.parse_args(["--context-length", "2048", "--tp-size", "2", "--max-running-requests", "8"])
    vllm = p.parse_args(["--max-model-len", "2048", "--tensor-parallel-size", "2", "--max-num-seqs", "8"])
    assert vars(vllm) == vars(ours)
    assert (ours.context_length, ours.tp_size, ours.max_running_requests) == (2048, 2, 8)


SCRIPTS = sorted(p.stem for p in (pathlib.Path(__file__).resolve().parents[1] / "scripts").glob("*.py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_help_describes_the_script(name, capsys, monkeypatch):
    """Every user script's --help: a description of what it does, each default said once, no internal
    references (issue numbers)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"help_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    description = text.split("\n\n", 1)[1].split("options:", 1)[0].strip()
    assert len(description.split()) >= 5, text[:500]
    assert "(default: None)" not in text
    assert not re.search(r"\bissues? \d+", text, re.IGNORECASE)
    for block in re.split(r"\n  (?=-)", text)[1:-1]:  # the last option's block may run into an epilog
        assert len(re.findall(r"\(default", " ".join(block.split()))) <= 1, block
