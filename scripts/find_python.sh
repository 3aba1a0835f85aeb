#!/usr/bin/env bash
# Prints the path of a working Python interpreter of version $1 (e.g. 3.12): `python$1` on PATH if it
# runs, else the newest pyenv-installed $1.x. Exits 1 (printing nothing) when there is none.
set -uo pipefail
v="${1:?usage: find_python.sh 3.12}"
if p=$(command -v "python$v" 2>/dev/null) && "$p" -c 'pass' >/dev/null 2>&1; then echo "$p"; exit 0; fi
root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
for p in $(ls -d "$root"/versions/"$v".*/bin/"python$v" 2>/dev/null | sort -V -r); do
  "$p" -c 'pass' >/dev/null 2>&1 && { echo "$p"; exit 0; }
done
exit 1
