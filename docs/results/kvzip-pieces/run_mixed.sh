#!/usr/bin/env bash
# A plain stream beside KVzip requests, two builds alternating, two rounds:
#   bash run_mixed.sh BEFORE_BINARY AFTER_BINARY OUT_DIR
# Needs the `openai` client (the README's test command installs it in
# $PAGEKEEPER_HOME/test-deps/venv) and the book in ../shared/data.
set -u
before=$1 after=$2 out=$3; mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-$HOME/.cache/pagekeeper/test-deps/venv/bin/python3}
quiet=$here/../../../../shared/tools/host-quiet
"$quiet" > "$out/host-quiet-start.txt" 2>&1
for round in 1 2; do
  for b in before after; do
    bin=$before; [ $b = after ] && bin=$after
    "$py" "$here/mixed.py" "$bin" 8311 "$out/mixed-$b-$round.json" > /dev/null 2> "$out/mixed-$b-$round.err"
    "$quiet" > "$out/host-quiet-$b-$round.txt" 2>&1
  done
done
