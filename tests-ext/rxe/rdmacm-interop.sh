#!/usr/bin/env bash
# tests-ext/rxe/rdmacm-interop.sh: Debian's unmodified rdma_cm programs on softrdma's
# drop-in librdmacm.so.1 <-> the same programs on Linux Soft-RoCE (rdma_rxe, the kernel's
# rdma_cm and IB CM) in a VM: the IB CM MADs, the CMA header, the QP attributes each side
# derives from the other's REQ/REP, and the data path after.
#
# Builds the rxe VM (../shared/rxe-vm/build, idempotent), boots it, and runs each program
# on the host through `softrdma run --` (inside the VM's network namespace, device
# softrdma0 at 10.47.91.1:4791) against the same program on rxe0 in the guest, both
# roles (guest server / host client, host server / guest client):
#   rping -v -V -C $PINGS        (RC: SEND, RDMA READ and WRITE, verified, disconnect)
#   ucmatose -c 2 -C $MSGS       (RC: several connections, SENDs both ways)
#   udaddy -c 2 -C $MSGS         (UD: SIDR, the peer's QPN and Q_Key from the event)
#   ib_write_bw -R both roles, ib_send_lat -R with a host server (perftest over rdma_cm)
#   rstream -S 1m -C $RS_XFERS -T v    (rsockets: connection data, WRITE WITH IMMEDIATE
#                                 data, buffer offers and credits, shutdown; verified)
#   riostream -S 64k -C $RS_XFERS -T v (rsockets' riomap offers and direct RDMA WRITEs)
#   rstream against `softrdma rsocket listen --echo` (the Rust face, softrdma::rsocket)
#   `softrdma rsocket connect` (the Rust face as client) against rstream's server, the
#                                 bytes both ways checked
# A check passes when both sides exit 0 and the programs report their work (rping's
# verified ping lines, "test complete", perftest's result row). Prints the guest's rxe
# counters after each check, then "N passed, M failed"; exits 1 on any failure. Needs
# root (VM, netns) and on the host rdmacm-utils and perftest. Every step is bounded by
# `timeout`.
#
#   sudo tests-ext/rxe/rdmacm-interop.sh
#
# Env:
#   SOFTRDMA_BIN   softrdma binary (default: <repo>/target/release/softrdma, or
#                  $CARGO_TARGET_DIR/release/softrdma), built with the drop-in libraries
#                  (cargo build --release --workspace)
#   SOFTRDMA_ADDR  host device address (default and required value 10.47.91.1:4791)
#   PINGS          rping -C (default 10)
#   MSGS           ucmatose/udaddy -C (default 10)
#   PT_ITERS       perftest -n (default 100)
#   RS_XFERS       rstream/riostream -C (default 20)
#   MTU            -m for perftest on both sides (default 1024, the guest's active MTU)
#   STEP_TIMEOUT   seconds per side of a check (default 60)
#   SETTLE         seconds a host server gets to start listening (default 3)
#   ONLY           run only checks whose name matches this extended regex
#   CAPTURE=1      also capture every check on tap0 with tshark (pcapng in OUT)
#   OUT            artifacts directory (default /tmp/softrdma-rxe-rdmacm-interop)
#   RXE_VM_DIR     rxe-vm scripts (default <repo>/../shared/rxe-vm)
#   RXE_VM_NAME    VM instance / netns name (default softrdma-interop; any stale
#                  instance of that name is stopped first)
#   KEEP_VM=1      leave the VM running at the end
#   SKIP_BUILD=1   do not run rxe-vm/build
#   RXE_VM_SHARED=1  use the running VM RXE_VM_NAME as it is, leave it running (run.sh
#                  boots one VM for all three scripts)
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
SOFTRDMA_BIN=${SOFTRDMA_BIN:-${CARGO_TARGET_DIR:-$REPO/target}/release/softrdma}
PINGS=${PINGS:-10}
MSGS=${MSGS:-10}
PT_ITERS=${PT_ITERS:-100}
RS_XFERS=${RS_XFERS:-20}
MTU=${MTU:-1024}
STEP_TIMEOUT=${STEP_TIMEOUT:-60}
SETTLE=${SETTLE:-3}
OUT=${OUT:-/tmp/softrdma-rxe-rdmacm-interop}
# the rdma_cm port every program here uses (rping's and perftest's default differ)
PORT=18515
LOG_TAG=rdmacm-interop
# shellcheck source=tests-ext/rxe/lib.sh
. "$HERE/lib.sh"

check_softrdma_bin
need_tools "rdmacm-utils perftest" rping ucmatose udaddy ib_write_bw ib_send_lat rstream riostream
check_addr

rm -rf "$OUT"; mkdir -p "$OUT"
log "host: $SOFTRDMA_BIN run -- ...; SOFTRDMA_ADDR=$SOFTRDMA_ADDR"

vm_up

# wait (up to $1 s) until an rdma_cm id in the guest listens on port $2 (the kernel's
# `rdma resource show cm_id` lists it with state LISTEN)
guest_cm_listening() {
  timeout $(($1 + 30)) "$RUN" exec -t "$(($1 + 5))" -- "
    for i in \$(seq $(($1 * 10))); do
      rdma resource show cm_id 2>/dev/null | grep 'state LISTEN' | grep -q ':$2 ' && exit 0
      sleep 0.1
    done; exit 1" > /dev/null 2>&1
}

# did_work EXPECT FILE: FILE (one side's output) matches EXPECT. perftest measures its CPU
# clock against gettimeofday when it reports (get_cpu_mhz), and in a guest on a loaded host
# that fit can fail: it prints "Correlation coefficient r^2: X < 0.9" and reports every time
# as inf, after all its iterations were done. With UNTIMED (a regex of such a result row)
# set, a side that printed that warning is judged by UNTIMED instead; any other inf fails.
did_work() {
  grep -qE "$1" "$2" && return 0
  [ -n "${UNTIMED:-}" ] && grep -q '^Correlation coefficient r^2: .* < 0.9$' "$2" && grep -qE "$UNTIMED" "$2"
}

# pair NAME ROLE HOST_ARGS GUEST_ARGS EXPECT [GUEST_PORT]
#   ROLE guest-server: guest runs GUEST_ARGS (server), host runs HOST_ARGS $GUEST_IP
#   ROLE host-server:  host runs HOST_ARGS (server), guest runs GUEST_ARGS $HOST_IP
#   EXPECT: an extended regex both sides' output must match (the work was done)
#   GUEST_PORT: the rdma_cm port a guest server listens on (default $PORT)
# HOST_ARGS is word-split; GUEST_ARGS is a guest shell string. A guest server is waited
# for in the guest's cm_id table; a host server gets SETTLE seconds to start.
# Optional, set around a call: HOST_IN (a file for the host side's standard input,
# otherwise /dev/null), HOST_OUT (a file for its standard output, otherwise with its
# standard error in NAME.host.txt), PEER_SUFFIX (appended to the guest's address, e.g.
# :PORT), VERIFY (a command run after both sides ended; its failure fails the check).
pair() {
  local name=$1 role=$2 hargs=$3 gargs=$4 expect=$5 gport=${6:-$PORT} g h hp id ok
  if [ -n "${ONLY:-}" ] && ! [[ $name =~ $ONLY ]]; then return 0; fi
  local -a ha
  read -r -a ha <<< "$hargs"
  local hin=${HOST_IN:-/dev/null} hout=${HOST_OUT:-$OUT/$name.host.txt}
  capture_start "$name"
  if [ "$role" = guest-server ]; then
    local run
    for run in 1 2 3; do
      id=$(timeout 30 "$RUN" exec --bg -t "$STEP_TIMEOUT" -- \
        "$gargs & p=\$!; echo \$p > /tmp/$name.pid; wait \$p")
      if [ -z "$id" ]; then capture_stop; result "$name" 1 "could not submit guest job"; return; fi
      guest_cm_listening "$STEP_TIMEOUT" "$gport" || log "$name: guest server not seen listening; trying anyway"
      # perftest lists its listening id a moment before the kernel CM serves its service
      # ID (seen once: REJ 8 right after the probe succeeded)
      sleep 1
      [ -z "${HOST_OUT:-}" ] || : > "$HOST_OUT"
      echo "\$ softrdma run -- ${ha[*]} $GUEST_IP${PEER_SUFFIX:-}" > "$OUT/$name.host.txt"
      host_run "${ha[@]}" "$GUEST_IP${PEER_SUFFIX:-}" < "$hin" >> "$hout" 2>> "$OUT/$name.host.txt"
      h=$?
      if [ "$h" != 0 ]; then
        timeout 30 "$RUN" exec -t 10 -- "kill \$(cat /tmp/$name.pid) 2>/dev/null" > /dev/null 2>&1
      fi
      timeout $((STEP_TIMEOUT + 30)) "$RUN" wait "$id" > "$OUT/$name.guest.txt" 2>&1
      g=$?
      # perftest -R connects twice: once for its parameter exchange and once for the
      # test, for which the server makes a new listener. A client whose second REQ
      # arrives before that listener exists is rejected (reason 8, as Linux's CM must),
      # and perftest 4.5-0.17's retry then reuses the ids it has just destroyed and
      # gives up (fixed upstream in perftest 3d9d8d0). The guest is slow enough that
      # the host wins that race now and then; a run that failed exactly so is run again
      # (at most 3 runs, each kept as NAME.runN.*.txt).
      [ "$h" != 0 ] && [ "${PERFTEST_RACE:-0}" = 1 ] && [ "$run" -lt 3 ] &&
        grep -q 'Event: RDMA_CM_EVENT_REJECTED; error: 8\.' "$OUT/$name.host.txt" || break
      log "$name: run $run lost perftest's reconnect race (REJ 8 on its second connection); running again"
      mv "$OUT/$name.host.txt" "$OUT/$name.run$run.host.txt"
      mv "$OUT/$name.guest.txt" "$OUT/$name.run$run.guest.txt"
    done
  else
    echo "\$ softrdma run -- ${ha[*]}" > "$OUT/$name.host.txt"
    host_run "${ha[@]}" < "$hin" >> "$hout" 2>> "$OUT/$name.host.txt" &
    hp=$!
    sleep "$SETTLE"
    timeout $((STEP_TIMEOUT + 30)) "$RUN" exec -t "$STEP_TIMEOUT" -- \
      "$gargs \$HOST_IP" > "$OUT/$name.guest.txt" 2>&1
    g=$?
    if [ "$g" != 0 ]; then
      for _ in $(seq 50); do kill -0 "$hp" 2> /dev/null || break; sleep 0.1; done
      kill "$hp" 2> /dev/null
    fi
    wait "$hp"; h=$?
  fi
  capture_stop
  ok=0
  did_work "$expect" "$OUT/$name.guest.txt" || ok=1
  did_work "$expect" "$OUT/$name.host.txt" || ok=$((ok | 2))
  if [ -n "${VERIFY:-}" ]; then $VERIFY || ok=$((ok | 4)); fi
  echo "== $name  (guest rc=$g, host rc=$h, output checks: $ok)"
  if [ "$g" = 0 ] && [ "$h" = 0 ] && [ "$ok" = 0 ]; then
    grep -hE "$expect" "$OUT/$name.guest.txt" | tail -n 2 | sed 's/^/   guest: /'
  else
    echo "-- guest output:"; tail -n 20 "$OUT/$name.guest.txt" | sed 's/^/   /'
    echo "-- host output:"; tail -n 20 "$OUT/$name.host.txt" | sed 's/^/   /'
  fi
  stats "$name"
  result "$name" $((g | h | ok)) "guest rc=$g, host rc=$h, output $ok; $OUT/$name.*.txt"
}

# rping: the server binds the wildcard address; -V verifies every payload; the client's
# -v lines and the server's (`server ping data`) prove the data went both ways.
for role in guest-server host-server; do
  pair "rping-$role" "$role" \
    "rping $( [ $role = host-server ] && echo -s || echo -c ) -v -V -C $PINGS -p $PORT $( [ $role = host-server ] || echo -a )" \
    "rping $( [ $role = guest-server ] && echo -s || echo -c ) -v -V -C $PINGS -p $PORT $( [ $role = guest-server ] || echo -a )" \
    "ping data: rdma-ping-$((PINGS - 1)):"
done

# ucmatose / udaddy: the client names the server with -s; both print "test complete".
# ucmatose's -p is the port; udaddy's -p is the port space, so udaddy keeps its default
# port, 7174.
for role in guest-server host-server; do
  pair "ucmatose-$role" "$role" \
    "ucmatose -c 2 -C $MSGS -p $PORT $( [ $role = host-server ] || echo -s )" \
    "ucmatose -c 2 -C $MSGS -p $PORT $( [ $role = guest-server ] || echo -s )" \
    "test complete"
done
for role in guest-server host-server; do
  pair "udaddy-$role" "$role" \
    "udaddy -c 2 -C $MSGS $( [ $role = host-server ] || echo -s )" \
    "udaddy -c 2 -C $MSGS $( [ $role = guest-server ] || echo -s )" \
    "test complete" 7174
done

# perftest over rdma_cm: -R; GID index is taken from the CM's route. ib_send_lat runs
# with a host server only: against the guest's ib_send_lat server, the host's perftest 4.5
# client loses its own reconnect race (REJ 8 on the second connection, see `pair`) on
# nearly every run, three runs in a row in one CI run, because the guest's server takes
# longer to listen again than the host's client takes to ask; that is perftest's bug
# (fixed upstream in 3d9d8d0), not a question about either CM.
PERFTEST_RACE=1
UNTIMED="^ *[0-9]+ +$PT_ITERS +inf +inf"
for tr in ib_write_bw:guest-server ib_write_bw:host-server ib_send_lat:host-server; do
  tool=${tr%%:*} role=${tr#*:}
  pair "$tool-R-$role" "$role" \
    "$tool -d softrdma0 -R -F -m $MTU -n $PT_ITERS -p $PORT" \
    "$tool -d rxe0 -R -F -m $MTU -n $PT_ITERS -p $PORT" \
    "^ *[0-9]+ +$PT_ITERS +[0-9.]+"
done

# rsockets against rdma-core's own (librdmacm's rsocket.c in the guest): rstream moves
# 1 MiB transfers (eight times its 128 KiB receive buffer, so every transfer needs the
# peer's buffer offers and credits) and checks each byte; riostream writes straight into
# the peer's riomap'ed buffer. Each side prints the "custom" result row.
PERFTEST_RACE=0
UNTIMED=""
for role in guest-server host-server; do
  pair "rstream-$role" "$role" \
    "rstream -S 1048576 -C $RS_XFERS -T v -p $PORT $( [ $role = host-server ] || echo -s )" \
    "rstream -S 1048576 -C $RS_XFERS -T v -p $PORT $( [ $role = guest-server ] || echo -s )" \
    "^custom +1m +$RS_XFERS +1 "
  pair "riostream-$role" "$role" \
    "riostream -S 65536 -C $RS_XFERS -T v -p $PORT $( [ $role = host-server ] || echo -s )" \
    "riostream -S 65536 -C $RS_XFERS -T v -p $PORT $( [ $role = guest-server ] || echo -s )" \
    "^custom +64k +$RS_XFERS +1 "
done

# The Rust face (softrdma::rsocket, through `softrdma rsocket listen --echo`) against
# rdma-core's rstream: ping-pong iterations of 64 KiB, every byte checked by rstream (-T v),
# each one crossing both ways through the Rust face's buffer offers and credits.
pair "rsocket-rust-host-server" host-server \
  "$SOFTRDMA_BIN rsocket listen $PORT --echo" \
  "rstream -S 65536 -C 1 -I $RS_XFERS -T v -p $PORT -s" \
  "(^custom +64k +1 +$RS_XFERS |: [0-9]+ bytes echoed)"

# The Rust face as the active side: `softrdma rsocket connect` against rstream's server.
# rstream -T v (verify: no wire option, only a check of the bytes) runs from one counter
# per direction: byte k of all it sends is k mod 256 (format_buf), and byte k of all it
# receives must be k mod 256 (verify_buf). A server first receives 16 bytes and sends 16
# (sync_test), then per iteration receives -S bytes and sends -S bytes back. So the
# client's standard input is that pattern, 16 + I * S bytes, and its standard output must
# be the same bytes: what rstream sent, in order, none missing; rstream checked ours.
RS_BYTES=$((16 + RS_XFERS * 65536))
python3 -c 'import sys; n = int(sys.argv[1]); sys.stdout.buffer.write((bytes(range(256)) * (n // 256 + 1))[:n])' \
  "$RS_BYTES" > "$OUT/rsocket-rust-guest-server.in"
rust_client_got_the_pattern() {
  cmp "$OUT/rsocket-rust-guest-server.in" "$OUT/rsocket-rust-guest-server.host.out" \
    >> "$OUT/rsocket-rust-guest-server.host.txt" 2>&1
}
HOST_IN=$OUT/rsocket-rust-guest-server.in HOST_OUT=$OUT/rsocket-rust-guest-server.host.out \
  PEER_SUFFIX=:$PORT VERIFY=rust_client_got_the_pattern \
  pair "rsocket-rust-guest-server" guest-server \
  "$SOFTRDMA_BIN rsocket connect" \
  "rstream -S 65536 -C 1 -I $RS_XFERS -T v -p $PORT" \
  "(^custom +64k +1 +$RS_XFERS |: $RS_BYTES bytes sent, $RS_BYTES received)"

timeout 20 "$RUN" console > "$OUT/console.log" 2>&1
finish
