#!/usr/bin/env bash
# tests-ext/rdmacm/run.sh: softrdma's librdmacm.so.1, which is the file of its drop-in
# libibverbs.so.1 under a second name, against Debian 12's rdma-core 44:
#
#   exports   the RDMACM_x.y exports of the built library are exactly the RDMACM lines of
#             crates/ibverbs/exports.txt (what is implemented), each with the version
#             Debian's librdmacm gives it (crates/ibverbs/rdmacm-abi.txt, itself checked
#             against Debian's library); the version nodes RDMACM_1.0..1.3 exist and none
#             inherits an IBVERBS node; the IBVERBS exports are the IBVERBS lines;
#   layout    layout.c, compiled against Debian's headers, prints what
#             crates/ibverbs/src/rdmacm/layout.txt records (the Rust mirrors are unit-tested
#             against that file);
#   loader    `softrdma run` gives librdmacm.so.1 and libibverbs.so.1 as
#             one file, and a program linked against Debian's librdmacm and libibverbs
#             (either order, BIND_NOW), or one that dlopens librdmacm.so.1, gets one object
#             (loader_test.c); with SOFTRDMA_RDMACM=0 a program gets the system's
#             librdmacm;
#   functions rdmacm_test.c on softrdma's librdmacm.so.1 (through `softrdma run --`) and on
#             Debian's librdmacm over softrdma's libibverbs.so.1: its checks pass on both,
#             and what the two libraries return is the same;
#   connections
#             cm_test.c (compiled against Debian's headers, run through `softrdma run --`),
#             one process per group, its two-sided groups across two processes (two
#             devices) or two threads: connect/accept/reject/disconnect with private data
#             and their limits, data over the connected QP (its completion channel waited
#             on in a thread), disconnects with 64 WRs in flight, REJECTED 28 and 8,
#             UNREACHABLE, port conflicts, wildcard listeners, rdma_init_qp_attr,
#             rdma_migrate_id, rdma_set_option, the rdma_verbs.h flow with RDMA WRITE and
#             READ, UD ids (see the file's head); then Debian's unmodified programs between
#             two processes on loopback, judged by their output: rping (-C 100 -v -V, the
#             client's ping data against the server's), ucmatose (4 connections, 10
#             messages), udaddy, mckey (multicast: a sender, two receivers of its 20
#             datagrams), rdma_server/rdma_client, cmtime (-c 100, its table in
#             $OUT/cmtime.txt), perftest with -R: ib_{send,write,read,atomic}_{bw,lat} and
#             ib_send_bw -c UD (-n 200, the result line; a run lost to perftest's own race
#             between its two connections is run again, see there). Those processes share
#             a registry of their own ($OUT/registry, SOFTRDMA_CM_DIR), which also tells
#             when a server listens.
#
# Prints PASS/FAIL per check and "N passed, M failed"; exits 1 on any failure. Logs in
# $OUT. For CI as root on Debian 12: installs librdmacm-dev, rdmacm-utils, perftest,
# libibverbs-dev, gcc and binutils with apt when missing.
#
# Env:
#   OUT           artifacts directory (default /tmp/softrdma-rdmacm)
#   SKIP_BUILD=1  use the libraries and softrdma already built in the target directory
#                 (the drop-in, the stub providers perftest loads, the softrdma command)
#   SOFTRDMA_BIN  the softrdma command to use (default: target/release/softrdma)
#   SKIP_INSTALL=1  never run apt-get
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${OUT:-/tmp/softrdma-rdmacm}
T=60 # seconds for one program

LOG_TAG=rdmacm
# shellcheck source=tests-ext/lib.sh
. "$REPO/tests-ext/lib.sh"
# Fold a program's "PASS: x" / "FAIL: x (why)" lines into the results, prefixed.
fold() { # prefix logfile
  local line n=0
  while IFS= read -r line; do
    case $line in
      PASS:\ *) result "$1: ${line#PASS: }" 0 ""; n=$((n + 1)) ;;
      FAIL:\ *) body=${line#FAIL: }; result "$1: ${body% (*}" 1 "${body##* (}"; n=$((n + 1)) ;;
    esac
  done < "$2"
  FOLDED=$n
}

mkdir -p "$OUT"
rm -rf "${OUT:?}"/*

# --- packages ------------------------------------------------------------------------------
need_pkgs=()
[ -f /usr/include/rdma/rdma_cma.h ] || need_pkgs+=(librdmacm-dev)
command -v rping >/dev/null 2>&1 || need_pkgs+=(rdmacm-utils)
command -v ib_write_bw >/dev/null 2>&1 || need_pkgs+=(perftest)
[ -f /usr/include/infiniband/verbs.h ] || need_pkgs+=(libibverbs-dev)
command -v gcc >/dev/null 2>&1 || need_pkgs+=(gcc)
command -v nm >/dev/null 2>&1 || need_pkgs+=(binutils)
install_needed
DEB_RDMACM=$(ls /usr/lib/*-linux-gnu/librdmacm.so.1 2>/dev/null | head -n 1)

# --- build ---------------------------------------------------------------------------------
cd "$REPO" || exit 1
build_dropins || finish
DIR=$(timeout 30 "$SOFTRDMA" env --dir 2> "$OUT/env.log")
result "softrdma env --dir" $? "$(head -c 300 "$OUT/env.log")"
LIB=$DIR/libibverbs.so.1

# --- run directory ---------------------------------------------------------------------------
[ -e "$DIR/rdmacm/librdmacm.so.1" ] && [ "$DIR/rdmacm/librdmacm.so.1" -ef "$LIB" ]
result "run directory: rdmacm/librdmacm.so.1 is the file of libibverbs.so.1" $? \
  "$(ls -lR "$DIR" 2>&1 | tr '\n' ' ' | cut -c1-300)"
# softrdma's librdmacm.so.1 (the default) for the programs run below.
unset SOFTRDMA_RDMACM

# --- exports -------------------------------------------------------------------------------
EXPORTS=$REPO/crates/ibverbs/exports.txt
ABI=$REPO/crates/ibverbs/rdmacm-abi.txt
exports_of() { # library -> "TAG name" per defined function ("- name": no version), sorted
  nm -D --defined-only --with-symbol-versions "$1" |
    awk '$2 == "T" { if (split($3, a, "@@") == 2) print a[2], a[1]; else print "-", $3 }' | sort
}
listed() { # file family -> its "TAG name" lines of that family, sorted
  grep -E "^$2_[0-9.]+ [A-Za-z_]" "$1" | awk '{ print $1, $2 }' | sort
}
exports_of "$LIB" > "$OUT/exports.built.txt"
grep -E '^RDMACM_' "$OUT/exports.built.txt" > "$OUT/exports.rdmacm.built.txt"
listed "$EXPORTS" RDMACM > "$OUT/exports.rdmacm.listed.txt"
diff "$OUT/exports.rdmacm.listed.txt" "$OUT/exports.rdmacm.built.txt" > "$OUT/exports.rdmacm.diff"
result "exports: the RDMACM exports are the RDMACM lines of exports.txt" $? \
  "$(tr '\n' ' ' < "$OUT/exports.rdmacm.diff" | cut -c1-300)"
listed "$ABI" RDMACM > "$OUT/rdmacm-abi.sorted.txt"
comm -23 "$OUT/exports.rdmacm.listed.txt" "$OUT/rdmacm-abi.sorted.txt" > "$OUT/exports.not-in-debian.txt"
[ ! -s "$OUT/exports.not-in-debian.txt" ]
result "exports: each RDMACM export has Debian's name and version (rdmacm-abi.txt)" $? \
  "$(tr '\n' ' ' < "$OUT/exports.not-in-debian.txt")"
if [ -n "$DEB_RDMACM" ]; then
  exports_of "$DEB_RDMACM" > "$OUT/exports.debian.txt"
  diff "$OUT/rdmacm-abi.sorted.txt" "$OUT/exports.debian.txt" > "$OUT/rdmacm-abi.diff"
  result "exports: rdmacm-abi.txt lists Debian's librdmacm.so.1 exports" $? \
    "$(tr '\n' ' ' < "$OUT/rdmacm-abi.diff" | cut -c1-300)"
fi
grep -E '^IBVERBS_' "$OUT/exports.built.txt" > "$OUT/exports.ibverbs.built.txt"
listed "$EXPORTS" 'IBVERBS(_PRIVATE)?' > "$OUT/exports.ibverbs.listed.txt"
diff "$OUT/exports.ibverbs.listed.txt" "$OUT/exports.ibverbs.built.txt" > "$OUT/exports.ibverbs.diff"
result "exports: the IBVERBS exports are the IBVERBS lines of exports.txt" $? \
  "$(tr '\n' ' ' < "$OUT/exports.ibverbs.diff" | cut -c1-300)"
other=$(grep -vE '^(IBVERBS|RDMACM)_' "$OUT/exports.built.txt")
[ -z "$other" ]
result "exports: every function has an IBVERBS or RDMACM version" $? "$(echo "$other" | tr '\n' ' ' | cut -c1-300)"
readelf -V "$LIB" | sed -n '/\.gnu\.version_d/,/\.gnu\.version_r/p' > "$OUT/verdef.txt"
missing=""
for v in RDMACM_1.0 RDMACM_1.1 RDMACM_1.2 RDMACM_1.3; do
  grep -qE "Name: $v\$" "$OUT/verdef.txt" || missing="$missing $v"
done
[ -z "$missing" ]
result "version nodes RDMACM_1.0, 1.1, 1.2, 1.3 defined" $? "missing:$missing"
# A node's parents follow it as "Parent N: NAME" lines: an RDMACM node's must be RDMACM.
crossed=$(awk '/Name: / { node = $NF } /Parent/ { print node, $NF }' "$OUT/verdef.txt" |
  awk '{ split($1, a, "_"); split($2, b, "_"); if (a[1] != b[1]) print }')
[ -z "$crossed" ]
result "no version node inherits one of the other library" $? "$crossed"

# --- layout --------------------------------------------------------------------------------
timeout 120 gcc -Wall -Werror -o "$OUT/layout" "$HERE/layout.c" > "$OUT/layout.build.log" 2>&1
result "gcc layout.c" $? "see $OUT/layout.build.log"
if [ -x "$OUT/layout" ]; then
  "$OUT/layout" > "$OUT/layout.txt"
  diff "$REPO/crates/ibverbs/src/rdmacm/layout.txt" "$OUT/layout.txt" > "$OUT/layout.diff"
  result "layout: Debian's rdma_cma.h is what layout.txt (and so the Rust mirror) records" $? \
    "$(head -n 6 "$OUT/layout.diff" | tr '\n' ' ')"
fi

# --- loader --------------------------------------------------------------------------------
loader() { # name (a file name) gcc-args...
  local name=$1; shift
  local exe="$OUT/loader_test.$name"
  timeout 120 gcc -O1 -Wall -Werror -o "$exe" "$HERE/loader_test.c" "$@" -ldl \
    > "$exe.build.log" 2>&1
  result "gcc loader_test.c ($name)" $? "see $exe.build.log"
  [ -x "$exe" ] || return
  LD_DEBUG=files,versions LD_DEBUG_OUTPUT="$exe.lddebug" \
    timeout -k 5 $T "$SOFTRDMA" run -- "$exe" > "$exe.log" 2> "$exe.stderr.log"
  local rc=$?
  fold "loader ($name)" "$exe.log"
  [ "$rc" = 0 ] && [ "$FOLDED" -gt 0 ]
  result "loader ($name) exits 0" $? "exit $rc; $(tail -n 2 "$exe.stderr.log" | tr '\n' ' ')"
}
loader rdmacm-first -Wl,-z,now -Wl,--no-as-needed -lrdmacm -libverbs
loader ibverbs-first -Wl,-z,now -Wl,--no-as-needed -libverbs -lrdmacm
loader dlopen-only -DDLOPEN_ONLY
# The loader's own account: the program's RDMACM_1.0 requirement is checked in softrdma's file.
cat "$OUT"/loader_test.rdmacm-first.lddebug.* > "$OUT/loader.lddebug.txt" 2>/dev/null
grep -qE "checking for version .RDMACM_1\.0. in file $DIR/(rdmacm/librdmacm|libibverbs)\.so\.1" "$OUT/loader.lddebug.txt"
result "LD_DEBUG=versions: RDMACM_1.0 found in softrdma's library" $? "see $OUT/loader.lddebug.txt"

# --- functions -----------------------------------------------------------------------------
RT="$OUT/rdmacm_test"
timeout 120 gcc -O1 -Wall -Werror -o "$RT" "$HERE/rdmacm_test.c" -lrdmacm -libverbs -ldl \
  > "$RT.build.log" 2>&1
result "gcc rdmacm_test.c -lrdmacm -libverbs" $? "see $RT.build.log"
if [ -x "$RT" ]; then
  # Debian's librdmacm over softrdma's libibverbs: a directory with libibverbs.so.1 alone.
  ORACLE="$OUT/debian-rdmacm"
  mkdir -p "$ORACLE"
  ln -sfn "$(readlink -f "$LIB")" "$ORACLE/libibverbs.so.1"
  ours() { timeout -k 5 $T "$SOFTRDMA" run -- "$RT" "$@"; }
  theirs() { LD_LIBRARY_PATH="$ORACLE" timeout -k 5 $T "$RT" "$@"; }

  w=$(ours -w 2>&1)
  [[ "$w" == "$DIR/"* ]]
  result "softrdma run: rdma_getaddrinfo comes from softrdma's library" $? "$w"
  w=$(SOFTRDMA_RDMACM=0 timeout -k 5 $T "$SOFTRDMA" run -- "$RT" -w 2>&1)
  [ -n "$DEB_RDMACM" ] && [ "$(readlink -f "$w")" = "$(readlink -f "$DEB_RDMACM")" ]
  result "SOFTRDMA_RDMACM=0 softrdma run: rdma_getaddrinfo comes from the system's librdmacm" $? "$w"
  oracle=""
  if [ -n "$DEB_RDMACM" ]; then
    w=$(theirs -w 2>&1)
    [ "$(readlink -f "$w")" = "$(readlink -f "$DEB_RDMACM")" ]
    result "oracle: rdma_getaddrinfo comes from Debian's librdmacm" $? "$w"
    [ "$(readlink -f "$w")" = "$(readlink -f "$DEB_RDMACM")" ] && oracle=1
  fi
  # group [env assignments...]: run one group on both libraries, compare their OUT lines.
  group() {
    local g=$1; shift
    local base="$OUT/rdmacm_test.$g" rc
    env "$@" timeout -k 5 $T "$SOFTRDMA" run -- "$RT" -t "$g" > "$base.ours.log" 2> "$base.ours.stderr.log"
    rc=$?
    fold "rdmacm_test $g" "$base.ours.log"
    [ "$rc" = 0 ] && [ "$FOLDED" -gt 0 ]
    result "rdmacm_test $g exits 0" $? "exit $rc; $(tail -n 2 "$base.ours.stderr.log" | tr '\n' ' ')"
    [ -n "$oracle" ] || return 0
    env "$@" LD_LIBRARY_PATH="$ORACLE" timeout -k 5 $T "$RT" -t "$g" > "$base.debian.log" 2> "$base.debian.stderr.log"
    rc=$?
    fold "rdmacm_test $g on Debian's librdmacm" "$base.debian.log"
    [ "$rc" = 0 ] && [ "$FOLDED" -gt 0 ]
    result "rdmacm_test $g on Debian's librdmacm exits 0" $? "exit $rc; $(tail -n 2 "$base.debian.stderr.log" | tr '\n' ' ')"
    diff <(grep '^OUT:' "$base.debian.log") <(grep '^OUT:' "$base.ours.log") > "$base.diff"
    result "rdmacm_test $g: softrdma returns what Debian's librdmacm returns" $? \
      "$(head -n 4 "$base.diff" | tr '\n' ' ' | cut -c1-300); $base.diff"
  }
  for g in events ports getaddrinfo devices; do
    group "$g"
  done
  group nodev SOFTRDMA_ADDR=not-an-address   # a configuration error leaves no device
  # A device listed but unable to open: its address is this host's, but another program
  # holds its UDP port (an address that is not this host's is a configuration error: the nodev group).
  held=""
  for x in 250 249 248 247; do
    python3 -c "import socket,sys,time; s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); s.bind(('127.0.0.$x',4791)); print('bound',flush=True); time.sleep(120)" \
      > "$OUT/deaddev.hold" 2>&1 &
    hp=$!
    for _ in $(seq 20); do grep -q bound "$OUT/deaddev.hold" && break; kill -0 "$hp" 2>/dev/null || break; sleep 0.1; done
    if grep -q bound "$OUT/deaddev.hold"; then held=127.0.0.$x; break; fi
    wait "$hp" 2>/dev/null
  done
  if [ -n "$held" ]; then
    group deaddev SOFTRDMA_ADDR="$held"
    kill "$hp" 2>/dev/null; wait "$hp" 2>/dev/null
  else
    result "rdmacm_test deaddev: hold a 127.0.0.x:4791 for the device that cannot open" 1 "$(cat "$OUT/deaddev.hold")"
  fi
  base="$OUT/rdmacm_test.softrdma"
  ours -t softrdma > "$base.log" 2> "$base.stderr.log"
  rc=$?
  fold "rdmacm_test softrdma" "$base.log"
  [ "$rc" = 0 ] && [ "$FOLDED" -gt 0 ]
  result "rdmacm_test softrdma exits 0" $? "exit $rc; $(tail -n 2 "$base.stderr.log" | tr '\n' ' ')"
fi


# --- connections ---------------------------------------------------------------------------
# Every process below uses a registry of its own: no binding of another program on the host
# collides with the ports chosen here, and a server's record says when it listens.
REG="$OUT/registry"
mkdir -p -m 700 "$REG"
export SOFTRDMA_CM_DIR="$REG"
BG=""   # the background processes running (pids), if any: stopped on exit
trap '[ -n "$BG" ] && kill $BG 2>/dev/null' EXIT

CT="$OUT/cm_test"
timeout 120 gcc -O1 -Wall -Werror -o "$CT" "$HERE/cm_test.c" -lrdmacm -libverbs -lpthread \
  > "$CT.build.log" 2>&1
result "gcc cm_test.c -lrdmacm -libverbs" $? "see $CT.build.log"
if [ -x "$CT" ]; then
  for g in $("$CT" -l); do
    base="$OUT/cm_test.$g"
    envs=()
    # A peer that never answers: short CM timeouts (one retry, 2^12 x 4.096 us).
    [ "$g" = unreachable ] && envs=(SOFTRDMA_CM_RETRIES=1 SOFTRDMA_CM_RESPONSE_TIMEOUT=12)
    env "${envs[@]}" timeout -k 5 200 "$SOFTRDMA" run -- "$CT" -t "$g" \
      > "$base.log" 2> "$base.stderr.log"
    rc=$?
    fold "cm_test $g" "$base.log"
    [ "$rc" = 0 ] && [ "$FOLDED" -gt 0 ]
    result "cm_test $g exits 0" $? "exit $rc; $(tail -n 2 "$base.stderr.log" | tr '\n' ' ')"
  done
fi

# rsockets: rsocket_test.c (streams, half close, non-blocking calls with rpoll, refused
# connects, options, riowrite into riomap regions, many connections, a half-open request
# that must not stall the listener, a peer killed with SIGKILL while the other waits in
# rrecv), one group per process.
RST="$OUT/rsocket_test"
timeout 120 gcc -O1 -Wall -Werror -o "$RST" "$HERE/rsocket_test.c" -lrdmacm -lpthread \
  > "$RST.build.log" 2>&1
result "gcc rsocket_test.c -lrdmacm" $? "see $RST.build.log"
if [ -x "$RST" ]; then
  for g in $("$RST" -l); do
    base="$OUT/rsocket_test.$g"
    timeout -k 5 120 "$SOFTRDMA" run -- "$RST" -t "$g" > "$base.log" 2> "$base.stderr.log"
    rc=$?
    fold "rsocket_test $g" "$base.log"
    [ "$rc" = 0 ] && [ "$FOLDED" -gt 0 ]
    result "rsocket_test $g exits 0" $? "exit $rc; $(tail -n 2 "$base.stderr.log" | tr '\n' ' ')"
  done
fi

# Debian's programs, a server in the background and its client. A port per test.
PT=60           # seconds for one program
# Wait (at most 10 s) until something listens on port $1 (any port space).
wait_listen() {
  local i
  for i in $(seq 100); do
    cm_listening "$REG" "$1" && return 0
    sleep 0.1
  done
  return 1
}
# pair NAME PORT "SERVER ARGS" "CLIENT ARGS" [keep]: logs $OUT/NAME.server.log and
# $OUT/NAME.client.log; SRC and CRC are the exit codes. A server still running 10 s after
# its client succeeded is stopped (SRC 143); so is one whose client failed, at once, and
# with "keep" (a server that never ends, after checking it is still there: SALIVE=1).
pair() {
  local name=$1 port=$2 scmd=$3 ccmd=$4 keep=${5:-} spid i
  # shellcheck disable=SC2086
  timeout -k 5 $PT "$SOFTRDMA" run -- $scmd > "$OUT/$name.server.log" 2>&1 &
  spid=$!
  BG=$spid
  wait_listen "$port" || echo "(nothing listened on port $port within 10 s)" > "$OUT/$name.wait.log"
  # shellcheck disable=SC2086
  timeout -k 5 $PT "$SOFTRDMA" run -- $ccmd > "$OUT/$name.client.log" 2>&1
  CRC=$?
  SALIVE=0
  if [ -n "$keep" ]; then
    kill -0 "$spid" 2>/dev/null && SALIVE=1
  elif [ "$CRC" = 0 ]; then
    for i in $(seq 100); do
      kill -0 "$spid" 2>/dev/null || break
      sleep 0.1
    done
  fi
  kill "$spid" 2>/dev/null
  wait "$spid"
  SRC=$?
  BG=""
}
# the first lines of a log that say what went wrong (a program's own error reports, CM
# events), else its last two: CI keeps only what is printed, and a failure's cause is
# usually early in the log, its consequences at the end.
reason() { # logfile
  local r
  r=$(grep -m 3 -E 'Event:|[Uu]nexpected|[Ff]ailed|[Ee]rror|Couldn|Unable' "$1" 2>/dev/null | tr '\n' ' ')
  [ -n "$r" ] || r=$(tail -n 2 "$1" 2>/dev/null | tr '\n' ' ')
  echo "$r" | cut -c1-200
}
why() { # name: what both logs say, for a FAIL line
  echo "client exit $CRC, server exit $SRC; client: $(reason "$OUT/$1.client.log"); server: $(reason "$OUT/$1.server.log")"
}

# rping: 100 pings; in each the server RDMA READs the client's buffer and RDMA WRITEs it
# into another, which the client compares with the first (-V: "data mismatch!" and a failure
# on a difference). The client prints each ping's data, the server the same; line-buffered
# (stdbuf), as the server's stderr goes to the same log and would otherwise land inside a
# data line where stdio flushes a full buffer.
pair rping 27501 "stdbuf -oL rping -s -v -V -C 100 -a 0.0.0.0 -p 27501" \
  "stdbuf -oL rping -c -v -V -C 100 -a 127.0.0.1 -p 27501"
sed -n 's/^ping data: //p' "$OUT/rping.client.log" > "$OUT/rping.client.data"
sed -n 's/^server ping data: //p' "$OUT/rping.server.log" > "$OUT/rping.server.data"
seq 0 99 | sed 's/^/rdma-ping-/' > "$OUT/rping.want"
[ "$CRC" = 0 ] && [ "$SRC" = 0 ] && diff -q "$OUT/rping.want" <(cut -d: -f1 "$OUT/rping.client.data") >/dev/null &&
  cmp -s "$OUT/rping.client.data" "$OUT/rping.server.data" && ! grep -q 'data mismatch' "$OUT/rping.client.log"
result "rping -C 100 -v -V: 100 pings rdma-ping-0..99, the client's data lines are the server's" $? "$(why rping)"

# ucmatose: 4 connections, 10 messages each way on each.
pair ucmatose 27502 "ucmatose -p 27502 -c 4 -C 10" "ucmatose -s 127.0.0.1 -p 27502 -c 4 -C 10"
[ "$CRC" = 0 ] && [ "$SRC" = 0 ] &&
  grep -q '^data transfers complete' "$OUT/ucmatose.client.log" && grep -q '^return status 0' "$OUT/ucmatose.client.log" &&
  grep -q '^data transfers complete' "$OUT/ucmatose.server.log" && grep -q '^return status 0' "$OUT/ucmatose.server.log" &&
  grep -q '^disconnected' "$OUT/ucmatose.server.log"
result "ucmatose -c 4 -C 10: data transfers complete, both sides return status 0" $? "$(why ucmatose)"

# udaddy: UD ids, SIDR, datagrams both ways (its port is fixed: 7174 of the UDP space).
pair udaddy 7174 "udaddy" "udaddy -s 127.0.0.1"
[ "$CRC" = 0 ] && [ "$SRC" = 0 ] &&
  grep -q '^data transfers complete' "$OUT/udaddy.client.log" && grep -q '^return status 0' "$OUT/udaddy.client.log" &&
  grep -q '^data transfers complete' "$OUT/udaddy.server.log" && grep -q '^return status 0' "$OUT/udaddy.server.log"
result "udaddy: data transfers complete, both sides return status 0" $? "$(why udaddy)"

# mckey: multicast on UD ids (RDMA_PS_UDP) between processes on one host. Two receivers
# join 239.1.2.3 (MGID ::ffff:239.1.2.3) with 20 receives posted each, then a sender joins
# and sends 20 datagrams to the group. A receiver says "data transfers complete" only after
# 20 completions on its CQ and polls without end before (so a datagram lost to either one
# is a timeout here); mckey does not look at the completions' status. Its stdout is made
# line-buffered (stdbuf) to see each receiver's join before the sender starts; a sender
# waits 3 s after its own join before sending, so receivers complete within a few seconds.
MC_RECV="mckey -m 239.1.2.3 -b 127.0.0.1 -C 20"
MC_SEND="mckey -m 239.1.2.3 -b 127.0.0.1 -C 20 -s"
mc_pids=()
for r in 1 2; do
  # shellcheck disable=SC2086
  timeout -k 5 30 "$SOFTRDMA" run -- stdbuf -oL $MC_RECV > "$OUT/mckey.recv$r.log" 2>&1 &
  mc_pids+=($!)
done
BG="${mc_pids[*]}"
joined=0
for i in $(seq 100); do
  joined=$(grep -l '^mckey: joined dgid: ::ffff:239\.1\.2\.3 ' "$OUT"/mckey.recv[12].log 2>/dev/null | wc -l)
  [ "$joined" = 2 ] && break
  sleep 0.1
done
# shellcheck disable=SC2086
timeout -k 5 $PT "$SOFTRDMA" run -- $MC_SEND > "$OUT/mckey.send.log" 2>&1
CRC=$?
[ "$CRC" = 0 ] || kill "${mc_pids[@]}" 2>/dev/null
mc_rc=()
for p in "${mc_pids[@]}"; do
  wait "$p"
  mc_rc+=($?)
done
BG=""
mc_ok() { # log: joined the group, the transfers complete, status 0
  grep -q '^mckey: joined dgid: ::ffff:239\.1\.2\.3 ' "$1" && grep -q '^data transfers complete' "$1" &&
    grep -q '^return status 0' "$1"
}
[ "$joined" = 2 ] && [ "$CRC" = 0 ] && [ "${mc_rc[*]}" = "0 0" ] && mc_ok "$OUT/mckey.send.log" &&
  grep -q '^initiating data transfers' "$OUT/mckey.send.log" &&
  mc_ok "$OUT/mckey.recv1.log" && mc_ok "$OUT/mckey.recv2.log" &&
  grep -q '^receiving data transfers' "$OUT/mckey.recv1.log" && grep -q '^receiving data transfers' "$OUT/mckey.recv2.log"
result "mckey -m 239.1.2.3 -C 20: a sender's 20 datagrams reach both receivers, all return status 0" $? \
  "$joined of 2 receivers joined before the sender; sender exit $CRC: $(tail -n 2 "$OUT/mckey.send.log" | tr '\n' ' '); receivers exit ${mc_rc[*]}: $(tail -n 1 "$OUT/mckey.recv1.log") / $(tail -n 1 "$OUT/mckey.recv2.log")"

# rdma_server / rdma_client: rdma_verbs.h on synchronous ids.
pair rdma_server 27503 "rdma_server -p 27503" "rdma_client -s 127.0.0.1 -p 27503"
[ "$CRC" = 0 ] && [ "$SRC" = 0 ] &&
  grep -qx 'rdma_client: end 0' "$OUT/rdma_server.client.log" && grep -qx 'rdma_server: end 0' "$OUT/rdma_server.server.log"
result "rdma_server / rdma_client: both end 0" $? "$(why rdma_server)"

# cmtime: 100 connections made and torn down; its server never ends by itself. cmtime
# exits 0 and prints its table even when connections failed: it says so only in lines of
# "event: REJECTED, error: 8", "failure ..." and the like, which neither side may print.
pair cmtime 27504 "cmtime -p 27504" "cmtime -s 127.0.0.1 -p 27504 -c 100" keep
sed -n '/^step /,$p' "$OUT/cmtime.client.log" > "$OUT/cmtime.txt"
steps=0
for st in "create id" "resolve addr" "resolve route" "create qp" "connect" "disconnect" "destroy"; do
  grep -qE "^$st *: +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$" "$OUT/cmtime.txt" && steps=$((steps + 1))
done
errs=$(grep -hiE 'error|fail' "$OUT/cmtime.client.log" "$OUT/cmtime.server.log" | head -n 3 | tr '\n' ' ')
[ "$CRC" = 0 ] && [ "$SALIVE" = 1 ] && [ "$steps" = 7 ] && [ -z "$errs" ]
result "cmtime -c 100: no errors, the client's table has all 7 steps, the server still serves (table in $OUT/cmtime.txt)" $? \
  "client exit $CRC, server alive $SALIVE, $steps of 7 steps, errors: ${errs:-none}; $(why cmtime)"

# rsockets' own programs. rstream: its whole latency and bandwidth series (64 B to 1 MiB,
# each size a connection's worth of transfers both ways), every byte checked (-T v); both
# sides print the eight result rows. Then the same through rpoll with non-blocking calls
# (-T a -T n), where a reader must see the last bytes before the peer's disconnect.
RS_ROWS='^(64|4k|64k|1m)_(lat|bw) +[0-9]+[km]? +[0-9]+[km]? +[0-9]+[km]? +[0-9.]+[km]? +[0-9.]+s'
rs_rows() { grep -cE "$RS_ROWS" "$1"; }
pair rstream 27506 "rstream -p 27506 -T v" "rstream -s 127.0.0.1 -p 27506 -T v"
[ "$CRC" = 0 ] && [ "$SRC" = 0 ] && [ "$(rs_rows "$OUT/rstream.client.log")" = 8 ] &&
  [ "$(rs_rows "$OUT/rstream.server.log")" = 8 ]
result "rstream -T v: 8 verified result rows on each side" $? "$(why rstream)"
pair rstream-async 27507 "rstream -p 27507 -T a -T n" "rstream -s 127.0.0.1 -p 27507 -T a -T n"
[ "$CRC" = 0 ] && [ "$SRC" = 0 ] && [ "$(rs_rows "$OUT/rstream-async.client.log")" = 8 ] &&
  [ "$(rs_rows "$OUT/rstream-async.server.log")" = 8 ]
result "rstream -T a -T n (rpoll, non-blocking): 8 result rows on each side" $? "$(why rstream-async)"

# riostream: riomap on both sides, riowrite into the peer's buffer, which the reader watches
# (its last byte); -T v checks every byte. Its application threads spin on that byte, so a
# bounded size and count keep it quick on two cores.
pair riostream 27508 "riostream -p 27508 -S 65536 -C 200 -T v" "riostream -s 127.0.0.1 -p 27508 -S 65536 -C 200 -T v"
[ "$CRC" = 0 ] && [ "$SRC" = 0 ] &&
  grep -qE '^custom +64k +200 +1 ' "$OUT/riostream.client.log" &&
  grep -qE '^custom +64k +200 +1 ' "$OUT/riostream.server.log"
result "riostream -S 65536 -C 200 -T v: both sides report the transfers" $? "$(why riostream)"

# rcopy: a 3 MB file of random bytes copied to the server, compared.
head -c 3000000 /dev/urandom > "$OUT/rcopy.src"
rm -f "$OUT/rcopy.dst"
# (rcopy takes a first argument that starts with "-" for server mode: -p comes last)
pair rcopy 27509 "rcopy -p 27509" "rcopy $OUT/rcopy.src 127.0.0.1:$OUT/rcopy.dst -p 27509" keep
[ "$CRC" = 0 ] && cmp -s "$OUT/rcopy.src" "$OUT/rcopy.dst" && grep -q '^3000000 bytes' "$OUT/rcopy.client.log"
result "rcopy: a 3 MB file arrives byte for byte" $? "$(why rcopy); $(cmp "$OUT/rcopy.src" "$OUT/rcopy.dst" 2>&1 | head -n 1)"

# librspreload (rdma-core's, from librdmacm1): a plain socket program with it preloaded
# runs its TCP connection over rsockets on softrdma's librdmacm. preload_test -r checks
# the bytes and that both of its sockets answer an rsockets-only option.
PRELOAD=$(find /usr/lib/*-linux-gnu/rsocket -name librspreload.so.1 2>/dev/null | head -n 1)
PLT="$OUT/preload_test"
timeout 120 gcc -O1 -Wall -Werror -o "$PLT" "$HERE/preload_test.c" -lpthread > "$PLT.build.log" 2>&1
result "gcc preload_test.c" $? "see $PLT.build.log"
if [ -n "$PRELOAD" ] && [ -x "$PLT" ]; then
  timeout -k 5 $PT "$SOFTRDMA" run -- env LD_PRELOAD="$PRELOAD" "$PLT" -r 27510 > "$PLT.log" 2>&1
  rc=$?
  [ "$rc" = 0 ] && grep -q "^sent 1048576 bytes, reply 'ok', rsockets$" "$PLT.log"
  result "librspreload: a socket program's 1 MiB goes over rsockets, byte for byte" $? \
    "exit $rc; $(tail -n 2 "$PLT.log" | tr '\n' ' ')"
else
  result "librspreload: found (librdmacm1's rsocket/librspreload.so.1)" 1 "not found or not built"
fi

# perftest over rdma_cm (-R): the client's result line (200 iterations, a positive figure).
# perftest connects twice: an exchange connection, then, right after a handshake on it, the
# test's, for which the server makes a new listener. A client whose second REQ arrives
# before that listener exists is rejected (REJECTED, reason 8, as on Linux; with -c UD its
# SIDR_REQ gets a SIDR_REP "unsupported": UNREACHABLE, status 1), and perftest 4.5-0.17's
# retry then uses the ids it has just destroyed and gives up (fixed upstream in perftest
# 3d9d8d0, "Fix crashes and logical flaws in RDMA CM connection retry"). softrdma resolves
# loopback addresses fast enough to lose that race now and then, so a run that failed
# exactly so is run again (at most 5 runs; the runs are in $OUT/NAME.runs.log).
perf_pair() { # name port server-args client-args
  local n
  : > "$OUT/$1.runs.log"
  for n in 1 2 3 4 5; do
    pair "$@"
    echo "run $n: client exit $CRC, server exit $SRC" >> "$OUT/$1.runs.log"
    [ "$CRC" != 0 ] && grep -qE 'Event: RDMA_CM_EVENT_(REJECTED; error: 8|UNREACHABLE; error: 1)\.' \
      "$OUT/$1.client.log" || break
    cp "$OUT/$1.client.log" "$OUT/$1.client.run$n.log"
    cp "$OUT/$1.server.log" "$OUT/$1.server.run$n.log"
  done
}
port=27510
for t in send_bw write_bw read_bw atomic_bw send_lat write_lat read_lat atomic_lat; do
  port=$((port + 1))
  perf_pair "ib_$t" $port "ib_$t -R -n 200 -p $port" "ib_$t -R -n 200 -p $port 127.0.0.1"
  case $t in
    *_bw) col=4 ;;  # BW average
    *) col=6 ;;     # t_avg
  esac
  [ "$CRC" = 0 ] && [ "$SRC" = 0 ] && grep -q 'Data ex. method : rdma_cm' "$OUT/ib_$t.client.log" &&
    awk -v c=$col '$1 ~ /^[0-9]+$/ && $2 == 200 && $c > 0 { ok = 1 } END { exit !ok }' "$OUT/ib_$t.client.log"
  result "ib_$t -R -n 200: rdma_cm exchange, a result line of 200 iterations" $? "$(why "ib_$t")"
done
port=$((port + 1))
perf_pair ib_send_bw_ud $port "ib_send_bw -c UD -R -n 200 -p $port" "ib_send_bw -c UD -R -n 200 -p $port 127.0.0.1"
[ "$CRC" = 0 ] && [ "$SRC" = 0 ] && grep -q 'Data ex. method : rdma_cm' "$OUT/ib_send_bw_ud.client.log" &&
  awk '$1 ~ /^[0-9]+$/ && $2 == 200 && $4 > 0 { ok = 1 } END { exit !ok }' "$OUT/ib_send_bw_ud.client.log"
result "ib_send_bw -c UD -R -n 200: rdma_cm exchange, a result line of 200 iterations" $? "$(why ib_send_bw_ud)"

finish
