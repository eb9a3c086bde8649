#!/usr/bin/env bash
# tests-ext/rdmacore/run.sh: rdma-core's own test suite (../shared/rdma-core-tests, tag
# v44.0) run unmodified by Debian's python3-pyverbs 44.0 on softrdma through
# `softrdma run --`:
#
#   softrdma run -- /usr/bin/python3 tests/run_tests.py --dev softrdma0 --gid 0 -v
#
# Prints the counts (ran, passed, failed, errors, skipped), the skip reasons with how many
# tests gave each, and a PASS/FAIL line; exits 1 on any failure or error (skips are the
# suite's own decisions: not an mlx5 or EFA device, no ODP, no XRC, ...). The full log is
# $OUT/suite.log. Installs python3-pyverbs when missing (root). Bounded by `timeout`.
#
#   sudo tests-ext/rdmacore/run.sh
#
# Env: SOFTRDMA_BIN (default <target>/release/softrdma, built with the drop-ins and the
# provider stand-ins: the script builds them unless SKIP_BUILD=1), RDMA_CORE_TESTS (the
# suite, default ../shared/rdma-core-tests beside the repository), OUT (artifacts, default
# /tmp/softrdma-rdmacore), SUITE_TIMEOUT (s, default 600), ARGS (more run_tests.py
# arguments, e.g. "-k test_rdmacm"), HUGEPAGES (2 MiB huge pages to reserve for the run
# when none are and the script is root, for the suite's huge-page tests; default 16, 0
# for none; given back when the last run of the script ends).
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${OUT:-/tmp/softrdma-rdmacore}
SUITE=${RDMA_CORE_TESTS:-$REPO/../shared/rdma-core-tests}
SUITE_TIMEOUT=${SUITE_TIMEOUT:-600}
PY=/usr/bin/python3

LOG_TAG=rdmacore
# shellcheck source=tests-ext/lib.sh
. "$REPO/tests-ext/lib.sh"
fail() { echo "FAIL: rdma-core tests ($*)"; echo "artifacts: $OUT"; exit 1; }

mkdir -p "$OUT"
rm -f "$OUT"/*.log

# --- packages ----------------------------------------------------------------------------
# pyverbs is Debian's (its libibverbs is replaced by softrdma's under `softrdma run`).
if ! "$PY" -c 'import pyverbs.device' > /dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && [ -z "${SKIP_INSTALL:-}" ] && command -v apt-get > /dev/null 2>&1; then
    log "installing python3-pyverbs"
    export DEBIAN_FRONTEND=noninteractive
    { timeout 600 apt-get update && timeout 900 apt-get install -y --no-install-recommends python3-pyverbs ibverbs-providers; } \
      > "$OUT/install.log" 2>&1 || fail "apt-get install python3-pyverbs failed, see $OUT/install.log"
  else
    fail "python3-pyverbs missing: apt-get install python3-pyverbs"
  fi
fi
[ -f "$SUITE/tests/run_tests.py" ] || fail "no suite at $SUITE (RDMA_CORE_TESTS)"

# --- build -------------------------------------------------------------------------------
cd "$REPO" || exit 1
TARGET=$(cargo_target_dir)
PKGS=$(dropin_pkgs)
if [ -z "${SKIP_BUILD:-}" ]; then
  log "cargo build --release $PKGS"
  # shellcheck disable=SC2086
  timeout 1800 cargo build --release $PKGS > "$OUT/build.log" 2>&1 ||
    fail "cargo build --release failed, see $OUT/build.log"
fi
SOFTRDMA=${SOFTRDMA_BIN:-$TARGET/release/softrdma}
[ -x "$SOFTRDMA" ] || fail "$SOFTRDMA not built"

# --- huge pages --------------------------------------------------------------------------
# Tests of MRs over huge pages skip unless some are reserved. A reservation is the
# machine's: it is taken only when there is none, and given back by the last run of this
# script to finish (each holds a shared lock while it runs; whoever then gets the lock
# alone gives back what a run of it reserved, as the marker file says).
NR_HUGE=/proc/sys/vm/nr_hugepages
HUGE_LOCK=/tmp/softrdma-rdmacore-hugepages.lock
HUGE_MARK=/tmp/softrdma-rdmacore-hugepages.reserved
# shellcheck disable=SC2317 # run by the EXIT trap
huge_release() {
  flock -u 9
  if flock -n -x 9 && [ -f "$HUGE_MARK" ]; then
    echo 0 > "$NR_HUGE"
    rm -f "$HUGE_MARK"
  fi
  exec 9>&-
}
if [ "${HUGEPAGES:-16}" -gt 0 ] && [ "$(id -u)" = 0 ] && [ -w "$NR_HUGE" ] &&
  exec 9>>"$HUGE_LOCK" && flock -s 9; then
  trap huge_release EXIT
  if [ "$(cat "$NR_HUGE")" = 0 ]; then
    echo "${HUGEPAGES:-16}" > "$NR_HUGE" 2>/dev/null && touch "$HUGE_MARK"
    log "reserved $(cat "$NR_HUGE") huge pages of 2 MiB for the run"
  fi
fi

# --- the suite ---------------------------------------------------------------------------
# From the suite's directory (it imports the `tests` package); no bytecode written there.
log "softrdma run -- $PY tests/run_tests.py --dev softrdma0 --gid 0 -v ${ARGS:-}"
start=$(date +%s)
# shellcheck disable=SC2086
(cd "$SUITE" && PYTHONDONTWRITEBYTECODE=1 timeout -k 10 "$SUITE_TIMEOUT" \
  "$SOFTRDMA" run -- "$PY" tests/run_tests.py --dev softrdma0 --gid 0 -v ${ARGS:-}) \
  > "$OUT/suite.log" 2>&1
rc=$?
secs=$(($(date +%s) - start))

# unittest ends with "Ran N tests in Ts" and "OK (skipped=S)" or
# "FAILED (failures=F, errors=E, skipped=S, ...)".
ran=$(sed -n 's/^Ran \([0-9]*\) tests\{0,1\} in .*/\1/p' "$OUT/suite.log" | tail -n 1)
last=$(grep -E '^(OK|FAILED)( \(|$)' "$OUT/suite.log" | tail -n 1)
count() { printf '%s\n' "$last" | sed -n "s/.*[( ]$1=\([0-9]*\).*/\1/p"; }
failures=$(count failures) errors=$(count errors) skipped=$(count skipped)
xfail=$(count 'expected failures') xpass=$(count 'unexpected successes')
failures=${failures:-0} errors=${errors:-0} skipped=${skipped:-0} xfail=${xfail:-0} xpass=${xpass:-0}
if [ -z "$ran" ] || [ -z "$last" ]; then
  tail -n 20 "$OUT/suite.log"
  fail "exit $rc after ${secs}s, no unittest summary (timeout ${SUITE_TIMEOUT}s?); see $OUT/suite.log"
fi
passed=$((ran - failures - errors - skipped - xfail - xpass))

echo "skip reasons:"
grep -oE "skipped '.*'$" "$OUT/suite.log" | sed "s/^skipped //" | sort | uniq -c | sort -rn | sed 's/^/  /'
if [ "$failures" != 0 ] || [ "$errors" != 0 ]; then
  echo "failed and erroring tests:"
  grep -E '^(FAIL|ERROR): ' "$OUT/suite.log" | sed 's/^/  /'
fi
echo "rdma-core tests: ran $ran, passed $passed, failed $failures, errors $errors, skipped $skipped (${secs}s)"
echo "artifacts: $OUT"
if [ "$rc" = 0 ] && [ "$failures" = 0 ] && [ "$errors" = 0 ] && [ "$ran" -gt 0 ] && [ "$passed" -gt 0 ]; then
  echo "PASS: rdma-core tests under softrdma run"
  exit 0
fi
echo "FAIL: rdma-core tests under softrdma run (exit $rc; see $OUT/suite.log)"
exit 1
