#!/usr/bin/env bash
# tests-ext/rxe/ibverbs-interop.sh: Debian's unmodified verbs programs on softrdma's drop-in
# libibverbs.so.1 <-> the same programs on Linux Soft-RoCE (rdma_rxe) in a VM.
#
# Builds the rxe VM (../shared/rxe-vm/build, idempotent), boots it, and runs each program
# on the host through `softrdma run --` (inside the VM's network namespace, device
# softrdma0 at 10.47.91.1:4791) against the same program on rxe0 in the guest, both
# roles (guest server / host client, host server / guest client):
#   ibv_rc_pingpong -s 64 and -s 4096 (> the guest's active MTU 1024)
#   perftest ib_write_bw, ib_read_lat, ib_send_lat (-m 1024, -n $PT_ITERS)
# A check passes when both sides exit 0. Prints the guest's rxe counters after each
# check, then "N passed, M failed"; exits 1 on any failure. Needs root (VM, netns) and
# on the host `apt-get install -y ibverbs-utils perftest`. Every step is bounded by
# `timeout`.
#
#   sudo tests-ext/rxe/ibverbs-interop.sh
#
# Env:
#   SOFTRDMA_BIN   softrdma binary (default: <repo>/target/release/softrdma, or
#                  $CARGO_TARGET_DIR/release/softrdma), built with the drop-in
#                  libibverbs.so.1 (cargo build --release --workspace)
#   SOFTRDMA_ADDR  host device address (default and required value 10.47.91.1:4791)
#   SIZES          ibv_rc_pingpong message sizes (default "64 4096")
#   ITERS          ibv_rc_pingpong iterations (default 20)
#   PT_TOOLS       perftest programs (default "ib_write_bw ib_read_lat ib_send_lat")
#   PT_ITERS       perftest -n (default 100)
#   MTU            -m for perftest on both sides (default 1024, the guest's active MTU)
#   STEP_TIMEOUT   seconds per side of a check (default 60)
#   ONLY           run only checks whose name matches this extended regex
#   CAPTURE=1      also capture every check on tap0 with tshark (pcapng in OUT)
#   OUT            artifacts directory (default /tmp/softrdma-rxe-ibverbs-interop)
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
SOFTRDMA_BIN=${SOFTRDMA_BIN:-${CARGO_TARGET_DIR:-$REPO/target}/release/softrdma}
SIZES=${SIZES:-64 4096}
ITERS=${ITERS:-20}
PT_TOOLS=${PT_TOOLS:-ib_write_bw ib_read_lat ib_send_lat}
PT_ITERS=${PT_ITERS:-100}
MTU=${MTU:-1024}
STEP_TIMEOUT=${STEP_TIMEOUT:-60}
OUT=${OUT:-/tmp/softrdma-rxe-ibverbs-interop}
# ibv_rc_pingpong's and perftest's default TCP port; passed explicitly (-p) to both sides
PORT=18515
LOG_TAG=ibverbs-interop
# shellcheck source=tests-ext/rxe/lib.sh
. "$HERE/lib.sh"

HOST_DEV=softrdma0
check_softrdma_bin
# shellcheck disable=SC2086 # PT_TOOLS is a list
need_tools "ibverbs-utils perftest" ibv_rc_pingpong $PT_TOOLS
check_addr

rm -rf "$OUT"; mkdir -p "$OUT"
log "host: $SOFTRDMA_BIN run -- ...; SOFTRDMA_ADDR=$SOFTRDMA_ADDR; sizes $SIZES x $ITERS; perftest $PT_TOOLS -n $PT_ITERS -m $MTU"

vm_up

# pair NAME ROLE HOST_ARGS GUEST_ARGS
#   ROLE guest-server: guest runs GUEST_ARGS (server), host runs HOST_ARGS $GUEST_IP
#   ROLE host-server:  host runs HOST_ARGS (server), guest runs GUEST_ARGS $HOST_IP
# HOST_ARGS is word-split; GUEST_ARGS is a guest shell string (quote \$RXE_GID_INDEX).
pair() {
  local name=$1 role=$2 hargs=$3 gargs=$4 g h hp id
  if [ -n "${ONLY:-}" ] && ! [[ $name =~ $ONLY ]]; then return 0; fi
  local -a ha
  read -r -a ha <<< "$hargs"
  capture_start "$name"
  if [ "$role" = guest-server ]; then
    # the pid file lets us end the guest server at once if the host side fails
    id=$(timeout 30 "$RUN" exec --bg -t "$STEP_TIMEOUT" -- \
      "$gargs & p=\$!; echo \$p > /tmp/$name.pid; wait \$p")
    if [ -z "$id" ]; then capture_stop; result "$name" 1 "could not submit guest job"; return; fi
    guest_listening 20 || log "$name: guest server not seen listening; trying anyway"
    echo "\$ softrdma run -- ${ha[*]} $GUEST_IP" > "$OUT/$name.host.txt"
    host_run "${ha[@]}" "$GUEST_IP" >> "$OUT/$name.host.txt" 2>&1
    h=$?
    if [ "$h" != 0 ]; then
      timeout 30 "$RUN" exec -t 10 -- "kill \$(cat /tmp/$name.pid) 2>/dev/null" > /dev/null 2>&1
    fi
    timeout $((STEP_TIMEOUT + 30)) "$RUN" wait "$id" > "$OUT/$name.guest.txt" 2>&1
    g=$?
  else
    echo "\$ softrdma run -- ${ha[*]}" > "$OUT/$name.host.txt"
    host_run "${ha[@]}" >> "$OUT/$name.host.txt" 2>&1 &
    hp=$!
    if host_listening 20 "$hp"; then
      timeout $((STEP_TIMEOUT + 30)) "$RUN" exec -t "$STEP_TIMEOUT" -- \
        "$gargs \$HOST_IP" > "$OUT/$name.guest.txt" 2>&1
      g=$?
      # a guest client that failed may leave the host server waiting: give it a moment
      if [ "$g" != 0 ]; then
        for _ in $(seq 50); do kill -0 "$hp" 2> /dev/null || break; sleep 0.1; done
        kill "$hp" 2> /dev/null
      fi
    else
      echo "host server never listened on TCP $PORT" > "$OUT/$name.guest.txt"
      g=125
    fi
    wait "$hp"; h=$?
  fi
  capture_stop
  echo "== $name  (guest rc=$g, host rc=$h)"
  if [ "$g" = 0 ] && [ "$h" = 0 ]; then
    # ibv_rc_pingpong's summary, or perftest's header and result row
    grep -hE 'iters in|bytes in|^ *#bytes|^ *[0-9]+ +[0-9]+ +[0-9.]+' "$OUT/$name.guest.txt" | sed 's/^/   guest: /'
  else
    echo "-- guest output:"; tail -n 20 "$OUT/$name.guest.txt" | sed 's/^/   /'
    echo "-- host output:"; tail -n 20 "$OUT/$name.host.txt" | sed 's/^/   /'
  fi
  stats "$name"
  result "$name" $((g | h)) "guest rc=$g, host rc=$h; $OUT/$name.*.txt"
}

for size in $SIZES; do
  for role in guest-server host-server; do
    pair "ibv_rc_pingpong-s$size-$role" "$role" \
      "ibv_rc_pingpong -d $HOST_DEV -g 0 -s $size -n $ITERS -p $PORT" \
      "ibv_rc_pingpong -d rxe0 -g \$RXE_GID_INDEX -s $size -n $ITERS -p $PORT"
  done
done

# perftest: -x GID index (host 0 = ::ffff:10.47.91.1, guest 1 = ::ffff:10.47.91.2), -m so
# that both sides use the guest's MTU, -F: no cpufreq check
for tool in $PT_TOOLS; do
  for role in guest-server host-server; do
    pair "$tool-$role" "$role" \
      "$tool -d $HOST_DEV -x 0 -F -m $MTU -n $PT_ITERS -p $PORT" \
      "$tool -d rxe0 -x \$RXE_GID_INDEX -F -m $MTU -n $PT_ITERS -p $PORT"
  done
done

timeout 20 "$RUN" console > "$OUT/console.log" 2>&1
finish
