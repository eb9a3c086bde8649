# tests-ext/rxe/lib.sh: shell functions shared by interop.sh, ibverbs-interop.sh and
# rdmacm-interop.sh.
# Sourced, not run. The caller sets, before sourcing:
#   REPO          repository root
#   OUT           artifacts directory
#   STEP_TIMEOUT  seconds per side of a check (used by capture_start)
#   LOG_TAG       prefix of log lines (default "rxe")
# and optionally RXE_VM_DIR, RXE_VM_NAME (default softrdma-interop), SKIP_BUILD, KEEP_VM,
# RXE_VM_SHARED, CAPTURE. Provides: log, result, finish, check_addr, check_softrdma_bin, need_tools,
# vm_up, ns, host_run, host_listening, guest_listening, capture_start, capture_stop,
# stats. SOFTRDMA_BIN (the softrdma binary) is read by check_softrdma_bin and host_run. PORT (TCP port of the out-of-band exchange, default
# 18515) is read by host_listening and guest_listening.

RXE_VM_DIR=${RXE_VM_DIR:-$(cd "$REPO/.." && pwd)/shared/rxe-vm}
RUN="$RXE_VM_DIR/run"
export RXE_VM_DIR
export RXE_VM_NAME=${RXE_VM_NAME:-softrdma-interop}
# fixed by the rxe-vm network layout; the host side must use the tap0 address
export RXE_VM_HOST_IP=10.47.91.1 RXE_VM_GUEST_IP=10.47.91.2
export SOFTRDMA_ADDR=${SOFTRDMA_ADDR:-10.47.91.1:4791}
GUEST_IP=$RXE_VM_GUEST_IP
PORT=${PORT:-18515}

pass=0 fail=0
log() { printf '[%s %(%H:%M:%S)T] %s\n' "${LOG_TAG:-rxe}" -1 "$*" >&2; }
result() {
  if [ "$2" = 0 ]; then echo "PASS: $1"; pass=$((pass + 1)); else echo "FAIL: $1 ($3)"; fail=$((fail + 1)); fi
}
finish() {
  echo "artifacts: $OUT"
  echo "$pass passed, $fail failed"
  [ "$fail" = 0 ] && [ "$pass" -gt 0 ]
  exit $?
}

# the host side must be on tap0's address in the namespace
check_addr() {
  case $SOFTRDMA_ADDR in
    10.47.91.1:*) ;;
    *) echo "FAIL: SOFTRDMA_ADDR=$SOFTRDMA_ADDR: the host side must be 10.47.91.1 (tap0 in the netns)"; fail=1; finish ;;
  esac
}

# fail fast (otherwise every check waits out its timeout) unless $SOFTRDMA_BIN finds the
# drop-in libraries, the way `softrdma run` does
check_softrdma_bin() {
  local env_out=""
  if [ ! -x "$SOFTRDMA_BIN" ] || ! env_out=$(timeout 30 "$SOFTRDMA_BIN" env 2>&1); then
    echo "FAIL: $SOFTRDMA_BIN env: ${env_out:-not found} (cargo build --release --workspace, or set SOFTRDMA_BIN)"
    fail=1; finish
  fi
}

# need_tools "PACKAGES" TOOL...: fail unless every TOOL is on the host's PATH
need_tools() {
  local pkgs=$1 missing="" t
  shift
  for t in "$@"; do command -v "$t" > /dev/null || missing="$missing $t"; done
  if [ -n "$missing" ]; then
    echo "FAIL: not on the host:$missing (apt-get install -y $pkgs)"
    fail=1; finish
  fi
}

# the host side of a check: PROGRAM ARGS... through the drop-in libraries, in the namespace
host_run() {
  timeout -k 5 "$STEP_TIMEOUT" "$RUN" ns -- env SOFTRDMA_ADDR="$SOFTRDMA_ADDR" \
    "$SOFTRDMA_BIN" run -- "$@"
}

# build the VM image (unless SKIP_BUILD=1), replace any stale instance, boot; on failure
# prints FAIL and exits. Stops the VM at exit unless KEEP_VM=1.
# With RXE_VM_SHARED=1 (set by run.sh, which runs several scripts against one VM) the VM
# is the caller's, already built and booted: it is used as it is, neither built, replaced
# nor stopped here. Should it be down (it died during an earlier script) it is booted
# again, and left for the caller to stop.
vm_up() {
  if [ "${RXE_VM_SHARED:-0}" = 1 ]; then
    { timeout 300 "$RUN" start && timeout 20 "$RUN" env; } > "$OUT/start.log" 2>&1 \
      || { cat "$OUT/start.log"; echo "FAIL: shared VM $RXE_VM_NAME (log $OUT/start.log)"; fail=1; finish; }
    cat "$OUT/start.log"
    return 0
  fi
  if [ "${SKIP_BUILD:-0}" != 1 ]; then
    timeout 900 "$RXE_VM_DIR/build" > "$OUT/build.log" 2>&1 \
      || { tail -n 30 "$OUT/build.log"; echo "FAIL: rxe-vm build (log $OUT/build.log)"; fail=1; finish; }
  fi
  # idempotent: a stale instance of this name (an interrupted run) is replaced
  timeout 60 "$RUN" stop > /dev/null 2>&1
  if [ "${KEEP_VM:-0}" != 1 ]; then trap 'timeout 60 "$RUN" stop >/dev/null 2>&1' EXIT; fi
  timeout 300 "$RUN" start > "$OUT/start.log" 2>&1 \
    || { cat "$OUT/start.log"; echo "FAIL: VM start (log $OUT/start.log)"; fail=1; finish; }
  cat "$OUT/start.log"
}

# the running VM's network namespace ($RUN ns) -- used directly for short probes
ns() { timeout "${T:-20}" "$RUN" ns -- "$@"; }

# wait (up to $1 s) until something in the namespace listens on TCP $PORT; give up
# early if the host process $2 has exited
host_listening() {
  local end=$(($(date +%s) + $1))
  while [ "$(date +%s)" -lt "$end" ] && kill -0 "$2" 2> /dev/null; do
    ns ss -Hltn "sport = :$PORT" 2> /dev/null | grep -q . && return 0
    sleep 0.1
  done
  return 1
}

# wait (up to $1 s) until the guest listens on TCP $PORT (one guest job polling
# /proc/net/tcp: a test connect would be taken as the ping-pong client)
guest_listening() {
  timeout $(($1 + 30)) "$RUN" exec -t "$(($1 + 5))" -- "
    for i in \$(seq $(($1 * 10))); do
      awk '\$2 ~ /:$(printf %04X "$PORT")\$/ && \$4 == \"0A\" {f=1} END {exit !f}' /proc/net/tcp && exit 0
      sleep 0.1
    done; exit 1" > /dev/null 2>&1
}

# CAPTURE=1: capture check $1 on tap0 with tshark into $OUT/$1.pcapng
capture_start() {
  cap=""
  [ "${CAPTURE:-0}" = 1 ] && command -v tshark > /dev/null || return 0
  "$RUN" ns -- timeout $((STEP_TIMEOUT * 2 + 60)) tshark -q -i tap0 -f 'udp port 4791' -w "$OUT/$1.pcapng" > "$OUT/$1.tshark.log" 2>&1 &
  cap=$!
  for _ in $(seq 50); do grep -q Capturing "$OUT/$1.tshark.log" 2> /dev/null && break; sleep 0.1; done
}
capture_stop() {
  [ -n "$cap" ] || return 0
  sleep 0.3; kill -INT "$cap" 2> /dev/null; wait "$cap" 2> /dev/null; cap=""
}

stats() {
  echo "-- rxe0 counters after $1:"
  timeout 40 "$RUN" exec -t 20 -- 'rdma statistic show link rxe0/1' 2>&1 | sed 's/^/   /'
}
