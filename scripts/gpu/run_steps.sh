# Sourced by the device scripts (sglang_device.sh, multi_gpu.sh): runs the functions step_<name> for the
# names given, in order, each one's output in $OUT/<name>.log and "<name> rc=<code> <seconds>s" appended to
# $OUT/steps.txt; a failed step does not stop the next, so one device call returns every result it can.
run_steps() {
  local step start rc
  for step in "$@"; do
    start=$(date +%s)
    "step_$step" > "$OUT/$step.log" 2>&1; rc=$?
    echo "$step rc=$rc $(( $(date +%s) - start ))s" | tee -a "$OUT/steps.txt"
    tail -n 15 "$OUT/$step.log"
  done
}

logged_step() {  # NAME LIMIT CMD...: one command under a time limit, its output in $OUT/NAME.log, "NAME RC" in $OUT/steps.txt
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name $?" >>"$OUT/steps.txt"
}
