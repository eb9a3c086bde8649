#!/usr/bin/env bash
# tests-ext/middleware/run.sh: the middleware RDMA users already run, from Debian's
# packages and unmodified, on softrdma through `softrdma run --`, two processes on one
# host:
#   UCX 1.13: `ucx_info -d` lists rc_verbs and ud_verbs on softrdma0:1; ucx_perftest
#     ucp_put_bw, ucp_get, tag_lat and tag_bw over rc_verbs (with ud_verbs, UCX's
#     auxiliary transport for wire-up) and over ud_verbs alone, each judged by the
#     transport UCX's log says it chose and a "Final:" row with a positive figure;
#   libfabric 1.17: `fi_info -p verbs` lists softrdma0's message and datagram domains;
#     fi_pingpong with data checks (-c) over verbs;ofi_rxd (reliable datagrams over UD),
#     over verbs;ofi_rxm (reliable datagrams over RC connections made through the
#     rdma_cm) and over verbs message endpoints (connected through the rdma_cm);
#   Open MPI 4.1: mpi_test.c (point-to-point, one-sided and collectives, every byte
#     checked by the rank that receives it), built with mpicc, run by
#     `softrdma run -- mpirun -np 2 --mca pml ucx` with UCX on rc_verbs (and ud_verbs)
#     and on ud_verbs alone; each rank opens its own softrdma device (127.0.0.x). Judged
#     by the exit code, the program's PASS lines and count, and UCX's log of the
#     transports each rank chose. Nothing can go by shared memory or TCP: UCX_TLS names
#     only the verbs transports (no posix/sysv/cma/self/tcp), `--mca btl self` loads no
#     shared-memory or TCP BTL, `--mca osc ucx` keeps one-sided windows off osc/sm, and
#     `--mca coll ^sm,han` keeps collectives on the point-to-point layer. The openib BTL
#     (pml ob1) runs when Open MPI's build has a connection scheme for RoCE (the rdmacm
#     CPC); Debian's has only udcm, which serves InfiniBand link layers only, so there
#     it is reported as SKIP with that reason.
# Prints PASS/FAIL per check (SKIP for what cannot run here, not counted) and
# "N passed, M failed"; exits 1 on any failure. Installs ucx-utils, libfabric-bin,
# openmpi-bin and libopenmpi-dev when missing (root). Every step runs under `timeout`.
#
#   sudo tests-ext/middleware/run.sh
#
# Env: SOFTRDMA_BIN (default <target>/release/softrdma, built with the drop-ins and the
# provider stand-ins: the script builds them unless SKIP_BUILD=1), ONLY (regex of check
# names), OUT (artifacts, default /tmp/softrdma-middleware), STEP_TIMEOUT (s, default 60).
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${OUT:-/tmp/softrdma-middleware}
STEP_TIMEOUT=${STEP_TIMEOUT:-60}
ONLY=${ONLY:-}
PORT=${BASE_PORT:-13400}

LOG_TAG=middleware
# shellcheck source=tests-ext/lib.sh
. "$REPO/tests-ext/lib.sh"

mkdir -p "$OUT"
rm -f "$OUT"/*.log

# --- packages ----------------------------------------------------------------------------
need_pkgs=()
command -v ucx_perftest >/dev/null 2>&1 || need_pkgs+=(ucx-utils)
command -v fi_pingpong >/dev/null 2>&1 || need_pkgs+=(libfabric-bin)
[ -f /usr/lib/x86_64-linux-gnu/libmlx5.so.1 ] || need_pkgs+=(ibverbs-providers)
command -v mpirun >/dev/null 2>&1 || need_pkgs+=(openmpi-bin)
[ -f /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] || need_pkgs+=(libopenmpi-dev)
install_needed || finish

# --- build -------------------------------------------------------------------------------
cd "$REPO" || exit 1
build_dropins || finish

# A server and a client of one program, both through `softrdma run`; the client gets the
# server's address last. Sets SRC/CRC (exit codes) and SL/CL (logs).
#   pair NAME SERVER-ARGS... -- CLIENT-ARGS...
pair() {
  local name=$1 spid i
  shift
  local -a sargs=() cargs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do sargs+=("$1"); shift; done
  shift
  cargs=("$@")
  SL="$OUT/$(slug "$name").server.log" CL="$OUT/$(slug "$name").client.log"
  echo "\$ softrdma run -- ${sargs[*]}" > "$SL"
  timeout -k 5 "$STEP_TIMEOUT" "$SOFTRDMA" run -- "${sargs[@]}" >> "$SL" 2>&1 &
  spid=$!
  # Both programs wait on a TCP port for their out-of-band exchange.
  for i in $(seq 1 100); do
    grep -qE "^ *[0-9]+: [0-9A-F]+:$(printf '%04X' "$PORT") [0-9A-F]+:0000 0A" /proc/net/tcp /proc/net/tcp6 2>/dev/null && break
    kill -0 "$spid" 2>/dev/null || break
    sleep 0.1
  done
  echo "\$ softrdma run -- ${cargs[*]} 127.0.0.1" > "$CL"
  timeout -k 5 "$STEP_TIMEOUT" "$SOFTRDMA" run -- "${cargs[@]}" 127.0.0.1 >> "$CL" 2>&1
  CRC=$?
  if [ "$CRC" != 0 ]; then
    for i in $(seq 1 30); do kill -0 "$spid" 2>/dev/null || break; sleep 0.1; done
    kill "$spid" 2>/dev/null
  fi
  wait "$spid"
  SRC=$?
}
why() { echo "server exit $SRC, client exit $CRC; client: $(grep -v '^\$' "$CL" | tail -n 2 | tr '\n' ' ' | cut -c1-200); $OUT/$(slug "$1").*.log"; }

# --- UCX -----------------------------------------------------------------------------------
if want "ucx_info"; then
  timeout "$STEP_TIMEOUT" "$SOFTRDMA" run -- ucx_info -d > "$OUT/ucx_info.log" 2>&1
  rc=$?
  for tl in rc_verbs ud_verbs; do
    [ $rc = 0 ] && awk -v tl="$tl" '/Transport: /{t=$3} /Device: /{ if (t == tl && $3 == "softrdma0:1") ok=1 } END { exit !ok }' "$OUT/ucx_info.log"
    result "ucx_info -d: $tl on softrdma0:1" $? "exit $rc; $OUT/ucx_info.log"
  done
fi

# UCX_TLS names the transports; with rc_verbs UCX needs ud_verbs (or another transport
# that reaches the peer without a connection) to wire up, as on any RoCE device.
for tls in rc_verbs,ud_verbs ud_verbs; do
  used=${tls%%,*}
  for t in "ucp_put_bw -s 65536 -n 2000" "ucp_get -s 65536 -n 1000" "tag_lat -s 8 -n 5000" "tag_bw -s 65536 -n 1000"; do
    name="ucx_perftest -t $t over $used"
    want "$name" || continue
    PORT=$((PORT + 1))
    # shellcheck disable=SC2086
    UCX_TLS=$tls UCX_NET_DEVICES=softrdma0:1 UCX_LOG_LEVEL=info \
      pair "$name" ucx_perftest -p "$PORT" -- ucx_perftest -p "$PORT" -t $t
    # The row: "Final: iterations p50 avg overall bw_avg bw_overall rate_avg rate_overall".
    [ "$SRC" = 0 ] && [ "$CRC" = 0 ] && ! grep -q ' UCX  ERROR' "$CL" "$SL" &&
      grep -qE "ep_cfg\[[0-9]+\]: .*\($used/softrdma0:1\)" "$CL" &&
      awk '$1 == "Final:" && $2 > 0 && $4 > 0 { ok = 1 } END { exit !ok }' "$CL"
    result "$name: UCX chose $used on softrdma0:1, a Final row" $? "$(why "$name")"
  done
done

# --- libfabric -----------------------------------------------------------------------------
if want "fi_info"; then
  timeout "$STEP_TIMEOUT" "$SOFTRDMA" run -- fi_info -p verbs > "$OUT/fi_info.log" 2>&1
  rc=$?
  [ $rc = 0 ] && grep -qE 'domain: softrdma0$' "$OUT/fi_info.log" && grep -qE 'domain: softrdma0-dgram$' "$OUT/fi_info.log"
  result "fi_info -p verbs: softrdma0 and softrdma0-dgram" $? "exit $rc; $OUT/fi_info.log"
fi

# fi_pingpong: -c checks every message's data; both sides print the same result table.
for prov in "verbs;ofi_rxd rdm" "verbs;ofi_rxm rdm" "verbs msg"; do
  read -r p ep <<< "$prov"
  name="fi_pingpong -p $p -e $ep -c"
  want "$name" || continue
  PORT=$((PORT + 1))
  pair "$name" fi_pingpong -p "$p" -e "$ep" -c -I 200 -B "$PORT" -- \
    fi_pingpong -p "$p" -e "$ep" -c -I 200 -P "$PORT"
  # rows: "bytes iters total time MB/sec usec/xfer Mxfers/sec"; the 1m row ends the table
  [ "$SRC" = 0 ] && [ "$CRC" = 0 ] &&
    awk '$1 == "1m" && $2 == 200 && $5 > 0 { ok = 1 } END { exit !ok }' "$CL" "$SL"
  result "$name: data checked, 64 B to 1 MiB" $? "$(why "$name")"
done

# --- Open MPI ------------------------------------------------------------------------------
# Every rank under one `softrdma run` (one view); each rank process opens its own device.
# --bind-to none: the ranks' progress threads must not share the rank's one core.
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2)
MPI_TEST="$OUT/mpi_test"
# The checks mpi_test makes: its last line reports them; each must have passed.
MPI_CHECKS=59
mpi_built=0
if want "mpirun"; then
  timeout 120 mpicc -O2 -Wall -Werror -o "$MPI_TEST" "$HERE/mpi_test.c" > "$OUT/mpi_test.build.log" 2>&1
  rc=$?
  result "mpicc -O2 -Wall -Werror mpi_test.c" $rc "see $OUT/mpi_test.build.log"
  [ $rc = 0 ] && mpi_built=1
fi
# mpi_ok LOG: exit code 0 (RC), every check passed, none failed.
mpi_ok() {
  [ "$RC" = 0 ] && ! grep -q '^FAIL: ' "$1" &&
    [ "$(grep -c '^PASS: ' "$1")" = "$MPI_CHECKS" ] &&
    grep -qx "mpi_test: $MPI_CHECKS checks passed, 0 failed" "$1"
}
# UCX (UCX_LOG_LEVEL=info) prints the lanes of each endpoint configuration it makes:
# tag matching (pml ucx) and RMA/atomics (osc ucx), per rank ("[host:pid:thread]").
# lanes_ok LOG TL: both ranks made both, on TL/softrdma0:1, and no lane is on anything else.
lanes_ok() {
  local tag rma other
  tag=$(grep -E "ep_cfg\[[0-9]+\]: tag\($2/softrdma0:1\)" "$1" | sed -E 's/^\[[^]]*\] \[([^]]*)\].*/\1/' | sort -u | wc -l)
  rma=$(grep -E "ep_cfg\[[0-9]+\]: (rma|rma_am)\($2/softrdma0:1\)" "$1" | sed -E 's/^\[[^]]*\] \[([^]]*)\].*/\1/' | sort -u | wc -l)
  other=$(grep -E "ep_cfg\[[0-9]+\]:" "$1" | grep -oE '\([a-z_0-9]+/[^)]*\)' | grep -vcx "($2/softrdma0:1)")
  [ "$tag" = 2 ] && [ "$rma" = 2 ] && [ "$other" = 0 ]
}
for tls in rc_verbs,ud_verbs ud_verbs; do
  used=${tls%%,*}
  name="mpirun -np 2 --mca pml ucx over $used"
  { want "$name" && [ "$mpi_built" = 1 ]; } || continue
  L="$OUT/$(slug "$name").log"
  cmd=("${MPIRUN[@]}" --mca pml ucx --mca osc ucx --mca btl self --mca coll '^sm,han' "$MPI_TEST")
  echo "\$ UCX_TLS=$tls UCX_NET_DEVICES=softrdma0:1 softrdma run -- ${cmd[*]}" > "$L"
  start=$(date +%s%N)
  UCX_TLS=$tls UCX_NET_DEVICES=softrdma0:1 UCX_LOG_LEVEL=info \
    timeout -k 5 "$STEP_TIMEOUT" "$SOFTRDMA" run -- "${cmd[@]}" >> "$L" 2>&1
  RC=$?
  ms=$((($(date +%s%N) - start) / 1000000))
  mpi_ok "$L" && ! grep -q ' UCX  ERROR' "$L" && lanes_ok "$L" "$used"
  result "$name: $MPI_CHECKS data checks, UCX on $used/softrdma0:1 for tag and RMA on both ranks, ${ms} ms" $? \
    "exit $RC, $(grep -c '^PASS: ' "$L") PASS, $(grep -c '^FAIL: ' "$L") FAIL; $(grep -E '^FAIL: | UCX  ERROR' "$L" | head -n 2 | tr '\n' ' ' | cut -c1-200); $L"
done

name="mpirun -np 2 --mca pml ob1 --mca btl openib,self"
if want "$name" && [ "$mpi_built" = 1 ]; then
  # The CPCs (connection schemes) this build of the openib BTL has; RoCE needs rdmacm.
  cpcs=$(ompi_info --param btl openib --level 9 2>/dev/null | grep -A1 '"btl_openib_cpc_include"' |
    sed -nE 's/.*valid values: ([^)]*)\).*/\1/p')
  if ! ompi_info 2>/dev/null | grep -q 'MCA btl: openib'; then
    skip "$name" "this Open MPI has no openib BTL"
  elif ! grep -qw rdmacm <<< "$cpcs"; then
    skip "$name" "this openib BTL's connection schemes are '${cpcs:-none}'; udcm serves InfiniBand link layers only and softrdma is RoCE, which needs the rdmacm CPC Open MPI was built without"
  else
    L="$OUT/$(slug "$name").log"
    cmd=("${MPIRUN[@]}" --mca pml ob1 --mca btl openib,self --mca btl_openib_allow_ib true
      --mca btl_openib_cpc_include rdmacm --mca btl_openib_warn_no_device_params_found 0
      --mca osc '^sm,ucx' --mca coll '^sm,han' "$MPI_TEST")
    echo "\$ softrdma run -- ${cmd[*]}" > "$L"
    timeout -k 5 "$STEP_TIMEOUT" "$SOFTRDMA" run -- "${cmd[@]}" >> "$L" 2>&1
    RC=$?
    mpi_ok "$L"
    result "$name: $MPI_CHECKS data checks" $? "exit $RC; $(grep -E '^FAIL: ' "$L" | head -n 2 | tr '\n' ' ' | cut -c1-200); $L"
  fi
fi

finish
