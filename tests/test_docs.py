"""README is a user guide and docs/ holds what it cites: README at most 300 lines with no history
(dated narratives, per-run records, commit hashes); command 2 is what `.ci/run` runs; every figure in
README's results tables appears in docs/benchmarks.md; every file README, docs/benchmarks.md or a
design note links to exists; every raw artifact under docs/results/ is cited by benchmarks.md, a
design note or the code; the code's spec citations name sections that docs/design/spec.md has; the
user scripts' text names no internal issue. Text checks only (no subprocess, no JAX)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCH = ROOT / "docs" / "benchmarks.md"
DESIGN = ROOT / "docs" / "design"

# history markers: the words a run log or a narrative uses, a date, a commit hash (7+ hex digits with a
# letter and a digit, not inside a longer word)
HISTORY = re.compile(r"\bsession\b|\bseed-\d|PYTHONHASHSEED=\d|\b20\d\d-\d\d-\d\d\b", re.IGNORECASE)
HASH = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/.-])")


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def test_readme_is_short_and_has_no_history():
    text = _readme()
    assert len(text.splitlines()) <= 300
    assert not HISTORY.findall(text)
    assert not HASH.findall(text)


def test_history_patterns_can_fail():
    """The two patterns catch what they are meant to (a check that finds nothing must be able to)."""
    assert HISTORY.search("the nineteenth session's runs") and HISTORY.search("seed-89 and")
    assert HISTORY.search("PYTHONHASHSEED=90") and HISTORY.search("on 2026-11-30 we")
    assert HASH.findall("the run on 9f16b25 took") == ["9f16b25"]
    assert not HASH.findall("e.g. 1,280 of 1,537 tokens, docs/results/x.json, --dist loadfile, deadbeef")


def test_readme_command_2_is_what_ci_runs():
    """.ci/run runs README's command 2 as its main test run (it then runs the kernel tests again under
    the newest JAX, tests/test_ci.py)."""
    runs = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
            if ln.strip().startswith(". .venv/bin/activate && python -m pytest")]
    assert len(runs) == 1, runs
    block = _readme().split("```bash", 1)[1].split("```", 1)[0]
    assert runs[0] in [ln.strip() for ln in block.splitlines()]


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"README has no '## {title}' section"
    return m.group(1)


def test_readme_results_appear_in_benchmarks():
    """Each number in the result column of README's results tables is written in docs/benchmarks.md."""
    bench = BENCH.read_text(encoding="utf-8")
    rows = [ln for ln in _section(_readme(), "Results").splitlines()
            if ln.startswith("|") and not re.match(r"\|[-| ]+\|$", ln)]
    numbers = []
    for ln in rows:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        numbers += re.findall(r"\d[\d,]*(?:\.\d+)?", cells[-1])
    assert len(numbers) >= 15, numbers
    missing = [n for n in numbers if n not in bench]
    assert not missing, f"README results not in docs/benchmarks.md: {missing}"


def _links(path: pathlib.Path) -> list:
    """Markdown link targets and backticked docs/ paths, resolved relative to the file / the root."""
    text = path.read_text(encoding="utf-8")
    out = []
    for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            out.append((path.parent / target).resolve())
    for target in re.findall(r"`(docs/[^`\s]+)`", text):
        out.append((ROOT / target).resolve())
    return out


def test_linked_docs_exist():
    files = [README, BENCH, *sorted(DESIGN.glob("*.md")), ROOT / "research" / "README.md"]
    missing = [str(p.relative_to(ROOT)) for f in files for p in _links(f) if not p.exists()]
    assert not missing, missing
    assert len(_links(BENCH)) >= 20


def test_every_result_artifact_is_cited():
    """Raw outputs are kept only where something cites them (benchmarks.md, a design note, the code)."""
    cited = BENCH.read_text(encoding="utf-8") + "".join(p.read_text(encoding="utf-8") for p in DESIGN.glob("*.md"))
    cited += "".join(p.read_text(encoding="utf-8") for p in (ROOT / "research").glob("*.md"))
    cited += "".join(p.read_text(encoding="utf-8") for p in (ROOT / "dsv41_jax").rglob("*.py"))
    results = ROOT / "docs" / "results"
    uncited = []
    for p in sorted(results.rglob("*")):
        if p.is_file() and p.parent == results or p.is_dir():
            rel = p.relative_to(results).as_posix()
            if f"results/{rel}" not in cited:
                uncited.append(rel)
    assert not uncited, uncited


def test_spec_citations_resolve():
    """`spec.md §N` in the code names a numbered section of docs/design/spec.md."""
    spec = (DESIGN / "spec.md").read_text(encoding="utf-8")
    sections = set(re.findall(r"^## (\d+)\.", spec, re.M))
    assert sections >= {str(i) for i in range(1, 12)}
    cited = set()
    for p in list((ROOT / "dsv41_jax").rglob("*.py")) + list((ROOT / "scripts").glob("*.py")):
        cited |= set(re.findall(r"spec\.md §(\d+)", p.read_text(encoding="utf-8")))
    assert cited and cited <= sections, cited - sections


def test_scripts_name_no_internal_issue():
    """What users run describes itself, not the project's issue tracker."""
    bad = []
    for p in sorted((ROOT / "scripts").iterdir()):
        if p.suffix in (".py", ".sh"):
            for i, ln in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
                if re.search(r"\bissues? \d+|\bsession\b", ln, re.IGNORECASE):
                    bad.append(f"{p.name}:{i}: {ln.strip()}")
    assert not bad, bad
