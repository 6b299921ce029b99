#!/usr/bin/env bash
# Device side: run one command past a device call's 10 minutes, so that a whole comparison (every verl and rlrun
# run of a shape) is one invocation of benchmarks/peer_step.py. `start` launches it in a process session of its
# own, which the device tool leaves running after the call returns, as long as the machine stays warm; `wait`
# blocks in a later call (issue it at once: the machine goes back after 30 s idle) until the command ends or
# SECONDS pass, prints what its log gained, and puts what it has written so far in $OUT (the JSON files, and one
# archive of its output folder and log).
#
#   bash scripts/gpu/background.sh start NAME -- CMD [ARGS...]   # CMD sees OUT=/tmp/bg/NAME/out
#   bash scripts/gpu/background.sh wait NAME SECONDS              # exit 0: ended (its rc in NAME.rc); 3: still running
#
# State lives in /tmp/bg/NAME: log (CMD's stdout and stderr), rc (written when CMD ends), out/ (CMD's $OUT), tree/
# (the checkout CMD runs in). CMD runs in a copy of the checkout's top-level entries (not its dot-folders: the staging
# pieces), because every later device call re-sends the working tree into the repository root: a run reading the
# checkout while a call rewrote it failed once (2026-12-04: verl's input writer could not import rlrun.tools.bench.engines).
set -uo pipefail
ROOT=${BG_ROOT:-/tmp/bg}
OUT=${OUT:-/tmp/out}
usage() { echo "usage: $0 start NAME -- CMD [ARGS...] | wait NAME SECONDS" >&2; exit 2; }

start() {
  local name=$1; shift
  [ "${1:-}" = "--" ] || usage; shift
  [ $# -gt 0 ] || usage
  local dir=$ROOT/$name
  if [ -f "$dir/pid" ] && [ ! -f "$dir/rc" ]; then echo "$name is already running (pid $(cat "$dir/pid"))" >&2; exit 1; fi
  rm -rf "$dir"; mkdir -p "$dir/out" "$dir/tree"
  cp -a ./* "$dir/tree/" || { echo "copying the checkout into $dir/tree failed" >&2; exit 1; }
  cd "$dir/tree"
  OUT=$dir/out setsid bash -c '"$@"; echo $? > "'"$dir"'/rc"' bash "$@" > "$dir/log" 2>&1 < /dev/null &
  echo $! > "$dir/pid"
  echo "started $name (pid $!): $*"
}

wait_for() {
  local name=$1 seconds=$2 dir=$ROOT/$1
  [ -f "$dir/pid" ] || { echo "no run named $name under $ROOT (machine cold?)" >&2; exit 1; }
  local shown=0 deadline=$((SECONDS + seconds))
  [ -f "$dir/shown" ] && shown=$(cat "$dir/shown")
  # the JSON go to $OUT as they change, not only at the end: a call the device tool stops (its limit, or the session's
  # device time running out) still returns what $OUT holds, so the runs finished by then are kept
  mkdir -p "$OUT"
  while [ ! -f "$dir/rc" ] && [ $SECONDS -lt $deadline ]; do cp -u "$dir"/out/*.json "$OUT/" 2>/dev/null; sleep 5; done
  tail -c +$((shown + 1)) "$dir/log"; stat -c %s "$dir/log" > "$dir/shown"
  # what it has written so far, finished or not (a machine taken back during a later wait returns nothing); the
  # device tool returns at most 8 files: the JSON as they are, everything else (logs) in one archive
  cp "$dir"/out/*.json "$OUT/" 2>/dev/null; tar -C "$dir" -czf "$OUT/${name}_files.tgz" out log
  if [ ! -f "$dir/rc" ]; then echo "[background] $name still running after ${seconds} s more; \$OUT has its files so far"; exit 3; fi
  cp "$dir/rc" "$OUT/$name.rc"
  echo "[background] $name ended with rc $(cat "$dir/rc"); \$OUT has its JSON and ${name}_files.tgz (out/, log)"
}

case "${1:-}" in
  start) [ $# -ge 4 ] || usage; shift; start "$@" ;;
  wait) [ $# -eq 3 ] || usage; wait_for "$2" "$3" ;;
  *) usage ;;
esac
