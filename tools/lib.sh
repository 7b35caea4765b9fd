# Shell helpers shared by tools/*.sh (sourced, not run).

# run_logged LABEL LOG LINES COMMAND...: runs COMMAND with its output in LOG and a heartbeat on
# stderr every 30 s, so a long build is never silent; on failure prints LOG's last LINES lines
# and exits 1.
run_logged() {
  local label="$1" log="$2" lines="$3"
  shift 3
  local start=$SECONDS status=0
  ( while sleep 30; do echo "$label: still running ($((SECONDS - start)) s; log $log)..." >&2; done ) &
  local ticker=$!
  "$@" >"$log" 2>&1 || status=$?
  kill "$ticker" 2>/dev/null || true
  wait "$ticker" 2>/dev/null || true
  if [[ $status -ne 0 ]]; then
    echo "error: $label failed; last lines of $log:" >&2
    tail -n "$lines" "$log" >&2
    exit 1
  fi
}
