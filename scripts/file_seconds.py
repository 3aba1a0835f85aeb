"""Per-file test seconds from a `pytest --durations=0` report, for the suite's scheduler (tests/conftest.py,
`HeaviestFirst`): the README test command runs files on two workers, and a heavy file started last keeps one
worker busy while the other idles, so the scheduler starts the heaviest files first.

    python -m pytest -q -n 2 --dist loadfile --durations=0 > /tmp/durations.txt
    python scripts/file_seconds.py /tmp/durations.txt > tests/data/file_seconds.json

Seconds are the sum of each file's setup, call and teardown durations (rounded to whole seconds). Only the
order matters to the scheduler, so a run on a loaded machine serves as well as an idle one.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

LINE = re.compile(r"^\s*([\d.]+)s\s+(?:setup|call|teardown)\s+(tests/[^:\s]+)::")


def file_seconds(lines) -> dict:
    """{test file: seconds} summed over a --durations report's lines (other lines are skipped)."""
    out = collections.Counter()
    for ln in lines:
        m = LINE.match(ln)
        if m:
            out[m.group(2)] += float(m.group(1))
    return {f: round(s) for f, s in sorted(out.items())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="the output of `pytest --durations=0` (a file path, or - for stdin)")
    args = ap.parse_args(argv)
    try:
        f = sys.stdin if args.report == "-" else open(args.report)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with f:
        got = file_seconds(f)
    if not got:
        print(f"error: no durations in {args.report!r} (run pytest with --durations=0)", file=sys.stderr)
        return 2
    json.dump(got, sys.stdout, indent=0, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
