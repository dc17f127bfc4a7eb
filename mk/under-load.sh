#!/usr/bin/env bash
# `make test` while another process keeps one core busy: a shared CI runner or a laptop doing other
# work. Every test must pass here too; one that fails only under load waits on the wall clock or races.
#   bash mk/under-load.sh [make target ...]     (default: test)
set -uo pipefail
cd "$(dirname "$0")/.."
# One spinning process: the scheduler gives it a core's worth of time, whichever core.
python3 -c 'while True: pass' &
spinner=$!
trap 'kill "$spinner" 2>/dev/null' EXIT
echo "under-load: pid $spinner keeps one core busy"
start=$(date +%s)
make "${@:-test}"
status=$?
echo "under-load: make ${*:-test} exited $status after $(( $(date +%s) - start )) s"
exit "$status"
