#!/usr/bin/env bash
# tests-ext/rxe/run.sh: every interop script of tests-ext/rxe, with one VM boot per VM
# kind instead of one per script (what scripts/test runs).
#
# For each kind it builds the VM image (../shared/rxe-vm/build, idempotent), boots the VM
# once, runs the kind's scripts one after another against it (RXE_VM_SHARED=1: a script
# uses the running VM, and boots it again only if it has died), and stops the VM when they
# are done, whatever they returned and also when this script is interrupted. Every script
# runs even when one before it failed. Ends with each script's "N passed, M failed" line
# and time; exits 1 if any script (or a VM build or boot) failed. Needs root.
#
#   sudo tests-ext/rxe/run.sh
#   sudo ONLY='rstream' tests-ext/rxe/run.sh      # ONLY etc. reach every script
#
# Each script still runs alone as well (sudo tests-ext/rxe/interop.sh), booting and
# stopping a VM of its own.
#
# Env (the scripts' own knobs, SOFTRDMA_BIN, ONLY, CAPTURE, ..., pass through):
#   RUN_OUT        this run's logs: each script's output, the VM builds and boots
#                  (default /tmp/softrdma-rxe-run); each script keeps its own OUT default
#   RXE_VM_DIR     rxe-vm scripts (default <repo>/../shared/rxe-vm)
#   KEEP_VM=1      leave the VMs running at the end
#   SKIP_BUILD=1   do not run rxe-vm/build
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
RXE_VM_DIR=${RXE_VM_DIR:-$(cd "$REPO/.." && pwd)/shared/rxe-vm}
export RXE_VM_DIR
RUN_OUT=${RUN_OUT:-/tmp/softrdma-rxe-run}
# a caller's OUT would make every script write into (and first empty) one directory
unset OUT

rm -rf "$RUN_OUT"; mkdir -p "$RUN_OUT"
failed=0
log() { printf '[rxe-run %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

# kind KIND VM_NAME SIW SCRIPT...: build and boot the VM of KIND (named VM_NAME; SIW=1
# boots Soft-iWARP, rxe-vm's RXE_VM_SIW) once, run each SCRIPT against it, stop it.
# Runs in a subshell, so the VM's environment and the trap that stops it stay there.
kind() {
  local kind=$1 name=$2 siw=$3
  shift 3
  (
    export RXE_VM_NAME=$name RXE_VM_SIW=$siw
    run="$RXE_VM_DIR/run"
    if [ "${SKIP_BUILD:-0}" != 1 ] &&
      ! timeout 900 "$RXE_VM_DIR/build" > "$RUN_OUT/$kind.build.log" 2>&1; then
      tail -n 30 "$RUN_OUT/$kind.build.log"
      echo "FAIL: $kind VM build (log $RUN_OUT/$kind.build.log); not run: $*"
      exit 1
    fi
    # a stale instance of this name (an interrupted run) is replaced
    timeout 60 "$run" stop > /dev/null 2>&1
    if [ "${KEEP_VM:-0}" != 1 ]; then trap 'timeout 60 "$run" stop > /dev/null 2>&1' EXIT; fi
    local t0=$SECONDS
    if ! timeout 300 "$run" start > "$RUN_OUT/$kind.start.log" 2>&1; then
      cat "$RUN_OUT/$kind.start.log"
      echo "FAIL: $kind VM start (log $RUN_OUT/$kind.start.log); not run: $*"
      exit 1
    fi
    log "$kind VM $name up in $((SECONDS - t0)) s"
    local s rc bad=0 line
    for s in "$@"; do
      t0=$SECONDS
      log "$s (VM $name)"
      RXE_VM_SHARED=1 SKIP_BUILD=1 "$HERE/$s" 2>&1 | tee "$RUN_OUT/$s.log"
      rc=${PIPESTATUS[0]}
      line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$RUN_OUT/$s.log" | tail -n 1)
      echo "$s: ${line:-no count} (rc $rc, $((SECONDS - t0)) s)" >> "$RUN_OUT/summary"
      [ "$rc" = 0 ] || bad=1
    done
    exit $bad
  ) || failed=1
}

t_all=$SECONDS
kind rxe softrdma-interop 0 interop.sh ibverbs-interop.sh rdmacm-interop.sh
# A Soft-iWARP VM is a kind of its own (its own name, so that both may exist at once):
#   kind siw softrdma-interop-siw 1 SCRIPT...

echo "== rxe interop run ($((SECONDS - t_all)) s; logs in $RUN_OUT)"
[ -s "$RUN_OUT/summary" ] && sed 's/^/   /' "$RUN_OUT/summary"
[ "$failed" = 0 ] && echo "rxe interop: all scripts passed" || echo "FAIL: rxe interop: some script or VM failed"
exit "$failed"
