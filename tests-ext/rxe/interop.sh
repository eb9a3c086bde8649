#!/usr/bin/env bash
# tests-ext/rxe/interop.sh: softrdma <-> Linux Soft-RoCE (rdma_rxe) interop checks.
#
# Builds the rxe VM (../shared/rxe-vm/build, idempotent), boots it, and runs
# rdma-core's ibv_rc_pingpong in the guest against `softrdma pingpong` on the host
# (inside the VM's network namespace, device address 10.47.91.1:4791), both roles,
# for each message size. A check passes when both sides exit 0. Prints the guest's
# rxe counters after each check, then "N passed, M failed"; exits 1 on any failure.
# Needs root (VM, netns). Every step is bounded by `timeout`.
#
#   sudo tests-ext/rxe/interop.sh
#   sudo HOST_PEER_CMD=tests-ext/rxe/py-pingpong tests-ext/rxe/interop.sh   # python peer
#
# Env:
#   SOFTRDMA_BIN   softrdma binary (default: <repo>/target/release/softrdma)
#   HOST_PEER_CMD  host command taking ibv_rc_pingpong's options instead of
#                  "$SOFTRDMA_BIN pingpong" (word-split), e.g. tests-ext/rxe/py-pingpong
#   SOFTRDMA_ADDR  host device address (default and required value 10.47.91.1:4791)
#   SIZES          message sizes (default "64 1024 4096 10000"; guest active MTU is 1024)
#   ITERS          ping-pong iterations per check (default 20)
#   STEP_TIMEOUT   seconds per ping-pong side (default 60)
#   ONLY           run only checks whose name matches this extended regex
#   CAPTURE=1      also capture every check on tap0 with tshark (pcapng in OUT)
#   OUT            artifacts directory (default /tmp/softrdma-rxe-interop)
#   RXE_VM_DIR     rxe-vm scripts (default <repo>/../shared/rxe-vm)
#   RXE_VM_NAME    VM instance / netns name (default softrdma-interop; any stale
#                  instance of that name is stopped first)
#   KEEP_VM=1      leave the VM running at the end (stop: RXE_VM_NAME=... run stop)
#   SKIP_BUILD=1   do not run rxe-vm/build
#   RXE_VM_SHARED=1  use the running VM RXE_VM_NAME as it is, leave it running (run.sh
#                  boots one VM for all three scripts)
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
SOFTRDMA_BIN=${SOFTRDMA_BIN:-$REPO/target/release/softrdma}
SIZES=${SIZES:-64 1024 4096 10000}
ITERS=${ITERS:-20}
STEP_TIMEOUT=${STEP_TIMEOUT:-60}
OUT=${OUT:-/tmp/softrdma-rxe-interop}
PORT=18515 # ibv_rc_pingpong's TCP port
LOG_TAG=interop
# shellcheck source=tests-ext/rxe/lib.sh
. "$HERE/lib.sh"

if [ -n "${HOST_PEER_CMD:-}" ]; then
  read -r -a HOST_CMD <<< "$HOST_PEER_CMD"
else
  HOST_CMD=("$SOFTRDMA_BIN" pingpong)
  if [ ! -x "$SOFTRDMA_BIN" ]; then
    # fail fast: otherwise every check waits out its guest timeout
    echo "FAIL: softrdma binary $SOFTRDMA_BIN not found (cargo build --release -p softrdma, or set SOFTRDMA_BIN)"
    fail=1; finish
  fi
fi
check_addr

rm -rf "$OUT"; mkdir -p "$OUT"
log "host command: ${HOST_CMD[*]}; SOFTRDMA_ADDR=$SOFTRDMA_ADDR; sizes $SIZES; $ITERS iterations"

vm_up

# guest ibv_rc_pingpong server, host client
check_guest_server() {
  local size=$1 name="guest-server-s$1" g h
  capture_start "$name"
  local id
  # the pid file lets us end the guest server at once if the host side fails
  id=$(timeout 30 "$RUN" exec --bg -t "$STEP_TIMEOUT" -- \
    "ibv_rc_pingpong -g \$RXE_GID_INDEX -s $size -n $ITERS & p=\$!; echo \$p > /tmp/$name.pid; wait \$p")
  if [ -z "$id" ]; then capture_stop; result "$name" 1 "could not submit guest job"; return; fi
  guest_listening 20 || log "$name: guest server not seen listening; trying anyway"
  timeout "$STEP_TIMEOUT" "$RUN" ns -- env SOFTRDMA_ADDR="$SOFTRDMA_ADDR" PY_PEER_PCAP="${PY_PEER_PCAP:-}" \
    "${HOST_CMD[@]}" -g 0 -s "$size" -n "$ITERS" "$GUEST_IP" > "$OUT/$name.host.txt" 2>&1
  h=$?
  if [ "$h" != 0 ]; then
    timeout 30 "$RUN" exec -t 10 -- "kill \$(cat /tmp/$name.pid) 2>/dev/null" > /dev/null 2>&1
  fi
  timeout $((STEP_TIMEOUT + 30)) "$RUN" wait "$id" > "$OUT/$name.guest.txt" 2>&1
  g=$?
  capture_stop
  report "$name" "$g" "$h"
}

# host server, guest ibv_rc_pingpong client
check_host_server() {
  local size=$1 name="host-server-s$1" g h hp
  capture_start "$name"
  timeout "$STEP_TIMEOUT" "$RUN" ns -- env SOFTRDMA_ADDR="$SOFTRDMA_ADDR" PY_PEER_PCAP="${PY_PEER_PCAP:-}" \
    "${HOST_CMD[@]}" -s "$size" -n "$ITERS" > "$OUT/$name.host.txt" 2>&1 &
  hp=$!
  if host_listening 20 "$hp"; then
    timeout $((STEP_TIMEOUT + 30)) "$RUN" exec -t "$STEP_TIMEOUT" -- \
      "ibv_rc_pingpong -g \$RXE_GID_INDEX -s $size -n $ITERS \$HOST_IP" > "$OUT/$name.guest.txt" 2>&1
    g=$?
  else
    echo "host server never listened on TCP $PORT" > "$OUT/$name.guest.txt"
    g=125
  fi
  wait "$hp"; h=$?
  capture_stop
  report "$name" "$g" "$h"
}

report() {
  local name=$1 g=$2 h=$3 size=${1##*-s}
  echo "== $name  (guest rc=$g, host rc=$h)"
  if [ "$g" = 0 ] && [ "$h" = 0 ]; then
    grep -hE 'iters in|bytes in' "$OUT/$name.guest.txt" | sed 's/^/   guest: /'
  else
    echo "-- guest output:"; tail -n 20 "$OUT/$name.guest.txt" | sed 's/^/   /'
    echo "-- host output:"; tail -n 20 "$OUT/$name.host.txt" | sed 's/^/   /'
  fi
  stats "$name"
  result "$name: ibv_rc_pingpong <-> host, -s $size -n $ITERS" $((g | h)) "guest rc=$g, host rc=$h"
}

for size in $SIZES; do
  for check in guest_server host_server; do
    name="${check/_/-}-s$size"
    if [ -n "${ONLY:-}" ] && ! [[ $name =~ $ONLY ]]; then continue; fi
    "check_$check" "$size"
  done
done

timeout 20 "$RUN" console > "$OUT/console.log" 2>&1
finish
