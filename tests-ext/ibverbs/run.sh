#!/usr/bin/env bash
# tests-ext/ibverbs/run.sh: unmodified C verbs programs on softrdma's drop-in
# libibverbs.so.1, each run through `softrdma run --`:
#
#   ibv_devices, ibv_devinfo -v (GID 0 of type RoCE v2);
#   the device view under `softrdma run` (/sys/class/infiniband, /dev/infiniband) as root
#     and as nobody, and the host unchanged after; `ucx_info -d` reported when installed;
#   ibv_rc/uc/ud/srq_pingpong between two processes (server and client each with its own
#     zero-config device, 127.0.0.1 and 127.0.0.2), -g 0, -s 64 and -s 4096 (UD: the
#     port MTU), -n 100, with and without -e; ibv_rc_pingpong -N, -t, -j;
#   perftest over RC: ib_{write,read,send,atomic}_{bw,lat} with default options, with -a
#     (not the atomics, which have no -a) and with -b (bandwidth tools); ib_send_bw and
#     ib_send_lat with -c UD and -c UC;
#   verbs_test.c (one PASS/FAIL line per check it makes, among them the GID's netdev by
#     if_indextoname beside sysfs's and the uverbs node; one process per test group, two
#     QPs on its device), verbs_test -f (the responder in a second process) and -F (the
#     same, forked while the parent's device is open);
#   the stand-in provider libraries (crates/ibverbs-stubs): each of libmlx5, libefa,
#     libmlx4 and libmana exports exactly the (symbol, version) pairs and version nodes of
#     Debian's, its generated code is up to date with the installed library and header
#     (gen.py --check), provider_test.c calls them as a program built against Debian's
#     headers does, and programs that link them load: ucx_info -d (no module fails to
#     load), fi_info -l.
#
# Idempotent and bounded: every step runs under `timeout`. Prints PASS/FAIL per check and
# "N passed, M failed"; exits 1 on any failure. Logs go to $OUT. Checks the library
# cannot pass yet are run all the same (not skipped) and show as FAIL.
#
# For CI as root on Debian 12 (installs ibverbs-utils, perftest, libibverbs-dev, gcc,
# ibverbs-providers, ucx-utils and libfabric-bin with apt when one is missing). Elsewhere
# install those first.
#
# Env:
#   OUT           artifacts directory (default /tmp/softrdma-ibverbs)
#   STEP_TIMEOUT  seconds for one program (default 120; the -a runs get 3x)
#   ONLY          run only the checks whose name matches this extended regex
#   SKIP_BUILD=1  use the libraries and softrdma already built in the target directory
#   SKIP_INSTALL=1  never run apt-get
#   ITERS         -n for the ping-pongs (default 100)
#   AITERS        -n for the perftest -a sweeps (default 100; perftest's own default is
#                 1000/5000 per size, up to 8 MiB, which takes minutes on a software RNIC)
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${OUT:-/tmp/softrdma-ibverbs}
STEP_TIMEOUT=${STEP_TIMEOUT:-120}
ONLY=${ONLY:-}
ITERS=${ITERS:-100}
AITERS=${AITERS:-100}
DEV=softrdma0
PEER=127.0.0.1 # the server's device takes the first free loopback address
PORT=${BASE_PORT:-18600}

LOG_TAG=ibverbs
# shellcheck source=tests-ext/lib.sh
. "$REPO/tests-ext/lib.sh"
nstep=0
slug() { printf '%03d-%s' "$nstep" "$(printf '%s' "$1" | tr -c 'A-Za-z0-9_.-' '_' | cut -c1-80)"; }

mkdir -p "$OUT"
rm -rf "${OUT:?}"/[0-9][0-9][0-9]-* "$OUT"/build.log "$OUT"/install.log "$OUT"/verbs_test*

# --- 1. packages -----------------------------------------------------------------------
need_pkgs=()
command -v ibv_devinfo >/dev/null 2>&1 || need_pkgs+=(ibverbs-utils)
command -v ib_write_bw >/dev/null 2>&1 || need_pkgs+=(perftest)
[ -f /usr/include/infiniband/verbs.h ] || need_pkgs+=(libibverbs-dev)
command -v gcc >/dev/null 2>&1 || need_pkgs+=(gcc)
[ -f /usr/lib/x86_64-linux-gnu/libmlx5.so.1 ] || need_pkgs+=(ibverbs-providers)
command -v ucx_info >/dev/null 2>&1 || need_pkgs+=(ucx-utils)
command -v fi_info >/dev/null 2>&1 || need_pkgs+=(libfabric-bin)
install_needed

# --- 2. build ----------------------------------------------------------------------------
cd "$REPO" || exit 1
build_dropins || finish
timeout 30 "$SOFTRDMA" env > "$OUT/env.txt" 2>&1
result "softrdma env" $? "$(head -c 300 "$OUT/env.txt")"

VT="$OUT/verbs_test"
timeout 120 gcc -O1 -Wall -Werror -o "$VT" "$HERE/verbs_test.c" -libverbs > "$OUT/verbs_test.build.log" 2>&1
result "gcc -O1 -Wall -Werror verbs_test.c -libverbs" $? "see $OUT/verbs_test.build.log"
PT_BIN="$OUT/provider_test"
timeout 120 gcc -O1 -Wall -Werror -o "$PT_BIN" "$HERE/provider_test.c" \
  -lmlx5 -lefa -lmlx4 -lmana -libverbs -ldl > "$OUT/provider_test.build.log" 2>&1
result "gcc -O1 -Wall -Werror provider_test.c -lmlx5 -lefa -lmlx4 -lmana -libverbs" $? "see $OUT/provider_test.build.log"

sr() { # run one program through softrdma run, bounded
  local t=$1; shift
  timeout -k 5 "$t" "$SOFTRDMA" run -- "$@"
}

# --- 3. single-process checks -------------------------------------------------------------
single() { # name grep-pattern timeout program args...
  local name=$1 pat=$2 t=$3; shift 3
  nstep=$((nstep + 1))
  want "$name" || return 0
  local lf
  lf="$OUT/$(slug "$name").log"
  echo "\$ softrdma run -- $*" > "$lf"
  sr "$t" "$@" >> "$lf" 2>&1
  local rc=$?
  if [ $rc = 0 ] && [ -n "$pat" ] && ! grep -qE "$pat" "$lf"; then
    result "$name" 1 "exit 0 but no /$pat/ in the output; $lf"
  else
    result "$name" $rc "exit $rc$([ $rc = 124 ] && echo ' (timeout)'); $(tail -n 2 "$lf" | tr '\n' ' ' | cut -c1-200); $lf"
  fi
}

# Listening on TCP port $1 (any address)? From /proc/net/tcp{,6}, state 0A.
listening() {
  local hex
  hex=$(printf '%04X' "$1")
  grep -qE "^ *[0-9]+: [0-9A-F]+:$hex [0-9A-F]+:0000 0A" /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

# A server and a client of the same program; passes when both exit 0.
#   pair NAME TIMEOUT PROGRAM ARGS...   (the port option is added: -p PORT)
pair() {
  local name=$1 t=$2; shift 2
  nstep=$((nstep + 1))
  want "$name" || return 0
  PORT=$((PORT + 1))
  local base sl cl spid src crc i
  base="$OUT/$(slug "$name")"
  sl="$base.server.log" cl="$base.client.log"
  echo "\$ softrdma run -- $* -p $PORT" > "$sl"
  timeout -k 5 "$t" "$SOFTRDMA" run -- "$@" -p "$PORT" >> "$sl" 2>&1 &
  spid=$!
  for i in $(seq 1 100); do # the server opens its device first, then listens
    listening "$PORT" && break
    kill -0 "$spid" 2>/dev/null || break
    sleep 0.1
  done
  echo "\$ softrdma run -- $* -p $PORT $PEER" > "$cl"
  sr "$t" "$@" -p "$PORT" "$PEER" >> "$cl" 2>&1
  crc=$?
  if [ $crc != 0 ]; then
    # a client that failed may leave the server waiting for it: give it a moment, then stop it
    for i in $(seq 1 50); do kill -0 "$spid" 2>/dev/null || break; sleep 0.1; done
    kill "$spid" 2>/dev/null
  fi
  wait "$spid"
  src=$?
  local detail="server exit $src, client exit $crc"
  [ $src = 124 ] || [ $crc = 124 ] && detail="$detail (124 = timeout)"
  if [ $src != 0 ] || [ $crc != 0 ]; then
    detail="$detail; client: $(grep -v '^\$' "$cl" | tail -n 2 | tr '\n' ' ' | cut -c1-160); server: $(grep -v '^\$' "$sl" | tail -n 2 | tr '\n' ' ' | cut -c1-160); $base.*.log"
  fi
  [ $src = 0 ] && [ $crc = 0 ]
  result "$name" $? "$detail"
}

single "ibv_devices" "$DEV" 30 ibv_devices
single "ibv_devinfo -v" "PORT_ACTIVE" 30 ibv_devinfo -v
single "ibv_devinfo -d $DEV -v" "GID\[ *0\]:.*, RoCE v2" 30 ibv_devinfo -d "$DEV" -v

# The device view of `softrdma run` (/sys/class/infiniband, infiniband_verbs and
# /dev/infiniband for the program only), as root and as a regular user (nobody): the
# values, the uverbs node UCX tests for, and the host unchanged afterwards.
VIEW_SH='set -e
p=/sys/class/infiniband/softrdma0/ports/1
test "$(ls /sys/class/infiniband)" = softrdma0
test "$(cat $p/state)" = "4: ACTIVE"
test "$(cat $p/link_layer)" = Ethernet
test "$(cat $p/gids/0)" = 0000:0000:0000:0000:0000:ffff:7f00:00c8
test "$(cat $p/gid_attrs/types/0)" = "RoCE v2"
test "$(cat $p/gid_attrs/ndevs/0)" = lo
test "$(ls /sys/class/infiniband/softrdma0/device/net)" = lo
test "$(cat /sys/class/infiniband_verbs/uverbs0/ibdev)" = softrdma0
test -c /dev/infiniband/uverbs0 -a -r /dev/infiniband/uverbs0 -a -w /dev/infiniband/uverbs0
test -c /dev/infiniband/rdma_cm
echo "view ok as uid $(id -u)"'
view_before="$(ls -d /sys/class/infiniband* /dev/infiniband 2>&1; wc -l < /proc/self/mountinfo)"
for who in root nobody; do
  nstep=$((nstep + 1))
  want "device view as $who" || continue
  lf="$OUT/$(slug "device view as $who").log"
  if [ $who = root ]; then
    SOFTRDMA_ADDR=127.0.0.200 timeout 30 "$SOFTRDMA" run -- sh -c "$VIEW_SH" > "$lf" 2>&1
  else
    (cd / && SOFTRDMA_ADDR=127.0.0.200 timeout 30 setpriv --reuid=65534 --regid=65534 --clear-groups \
      "$SOFTRDMA" run -- sh -c "$VIEW_SH") > "$lf" 2>&1
  fi
  rc=$?
  [ $rc = 0 ] && ! grep -q "view ok" "$lf" && rc=1
  result "device view as $who" $rc "$(tail -n 3 "$lf" | tr '\n' ' ' | cut -c1-300); $lf"
done
view_after="$(ls -d /sys/class/infiniband* /dev/infiniband 2>&1; wc -l < /proc/self/mountinfo)"
[ "$view_before" = "$view_after" ]
result "device view: host unchanged" $? "before: $view_before; after: $view_after"
# UCX, when installed, is reported (not judged: whether libuct_ib loads is the provider
# stand-ins' matter).
if command -v ucx_info > /dev/null 2>&1; then
  UCX_LOG_LEVEL=diag timeout 60 "$SOFTRDMA" run -- ucx_info -d > "$OUT/ucx_info-d.log" 2>&1
  log "ucx_info -d: $(grep -cE '^#[[:space:]]+Transport:' "$OUT/ucx_info-d.log") transports, on softrdma0: $(grep -E 'Transport:|Device:' "$OUT/ucx_info-d.log" | grep -c softrdma0) lines; $OUT/ucx_info-d.log"
fi

# The UD ping-pong's message must fit the port MTU (its receive buffer adds the 40-byte GRH).
MTU=$(sed -nE 's/.*active_mtu:[[:space:]]*([0-9]+).*/\1/p' "$OUT"/*-ibv_devinfo_-v.log 2>/dev/null | head -n 1)
MTU=${MTU:-1024}
UDBIG=$((MTU < 4096 ? MTU : 4096))

# --- 3b. the stand-in provider libraries -------------------------------------------------
# Functions as "name@@NODE" (default) or "name@NODE" (older), sorted; the version nodes
# by name. Debian's are in /usr/lib, ours in the build directory. (The nodes' parents are
# not compared: rustc links with LLD, which writes no version-definition parents; the
# dynamic loader binds by (name, version) and never reads them.)
DEBLIB=/usr/lib/x86_64-linux-gnu
exports_of() { nm -D --with-symbol-versions --defined-only "$1" | awk '$2 != "A" { print $3 }' | sort; }
nodes_of() {
  readelf -V -W "$1" | sed -n '/Version definition/,/Version needs/p' |
    awk '/Flags:/ && !/BASE/ { print $NF }' | sort -u
}
for lib in mlx5 efa mlx4 mana; do
  nstep=$((nstep + 1))
  want "lib$lib.so.1 exports" || continue
  ours="$TARGET/release/lib$lib.so" lf="$OUT/$(slug "lib$lib exports").log"
  if [ ! -f "$ours" ] || [ ! -f "$DEBLIB/lib$lib.so.1" ]; then
    result "lib$lib.so.1 exports Debian's (symbol, version) pairs" 1 "missing $ours or $DEBLIB/lib$lib.so.1"
    continue
  fi
  diff <(exports_of "$DEBLIB/lib$lib.so.1") <(exports_of "$ours") > "$lf" 2>&1
  result "lib$lib.so.1 exports Debian's (symbol, version) pairs and no others ($(exports_of "$ours" | wc -l))" $? \
    "< Debian's only, > ours only: $(grep '^[<>]' "$lf" | head -n 5 | tr '\n' ' '); $lf"
  diff <(nodes_of "$DEBLIB/lib$lib.so.1") <(nodes_of "$ours") > "$lf.nodes" 2>&1
  result "lib$lib.so.1 defines Debian's version nodes" $? "$(grep '^[<>]' "$lf.nodes" | head -n 5 | tr '\n' ' ')"
done
if want "gen.py --check"; then
  nstep=$((nstep + 1))
  lf="$OUT/$(slug "gen.py --check").log"
  python3 "$REPO/crates/ibverbs-stubs/gen.py" --check > "$lf" 2>&1
  result "crates/ibverbs-stubs/gen.py --check (generated exports match the installed libraries and headers)" $? "$(tail -n 3 "$lf" | tr '\n' ' '); $lf"
fi
if want "provider_test" && [ -x "$PT_BIN" ]; then
  nstep=$((nstep + 1))
  lf="$OUT/$(slug "provider_test").log"
  sr 60 "$PT_BIN" -d "$DEV" > "$lf" 2> "$lf.stderr"
  rc=$?
  while IFS= read -r line; do
    case $line in
      PASS:\ *) result "provider_test: ${line#PASS: }" 0 "" ;;
      FAIL:\ *) result "provider_test: ${line#FAIL: }" 1 "$lf" ;;
    esac
  done < "$lf"
  [ "$rc" = 0 ] || [ "$rc" = 1 ] || result "provider_test exited" 1 "exit $rc; $(tail -n 3 "$lf.stderr" | tr '\n' ' ')"
fi
# Programs linked against the provider libraries load. UCX reports a module it cannot
# load (libuct_ib: libmlx5's version nodes) only at debug level.
if want "ucx_info -d"; then
  nstep=$((nstep + 1))
  lf="$OUT/$(slug "ucx_info -d").log"
  UCX_LOG_LEVEL=debug sr 60 ucx_info -d > "$lf" 2>&1
  rc=$?
  if [ $rc = 0 ] && grep -q "dlopen.*failed" "$lf"; then rc=1; fi
  result "ucx_info -d loads every UCX module (libuct_ib, libuct_rdmacm)" $rc \
    "exit $rc; $(grep -m 2 "dlopen.*failed" "$lf" | cut -c1-200 | tr '\n' ' '); $lf"
  log "ucx_info -d: transports $(grep -E '^# +Transport:' "$lf" | awk '{print $3}' | sort -u | tr '\n' ' ')"
fi
if want "fi_info -l"; then
  single "fi_info -l" "verbs" 60 fi_info -l
fi

# --- 4. ping-pongs between two processes ---------------------------------------------------
for prog in ibv_rc_pingpong ibv_uc_pingpong ibv_ud_pingpong ibv_srq_pingpong; do
  for size in 64 4096; do
    s=$size
    [ "$prog" = ibv_ud_pingpong ] && [ "$size" = 4096 ] && s=$UDBIG
    for ev in "" "-e"; do
      pair "$prog -g 0 -s $s -n $ITERS${ev:+ $ev}" "$STEP_TIMEOUT" "$prog" -d "$DEV" -g 0 -s "$s" -n "$ITERS" $ev
    done
  done
done
pair "ibv_rc_pingpong -g 0 -c (validate the buffer)" "$STEP_TIMEOUT" ibv_rc_pingpong -d "$DEV" -g 0 -n "$ITERS" -c
pair "ibv_rc_pingpong -g 0 -N (new post send API)" "$STEP_TIMEOUT" ibv_rc_pingpong -d "$DEV" -g 0 -n "$ITERS" -N
pair "ibv_rc_pingpong -g 0 -t (completion timestamps)" "$STEP_TIMEOUT" ibv_rc_pingpong -d "$DEV" -g 0 -n "$ITERS" -t
pair "ibv_rc_pingpong -g 0 -j (device memory)" "$STEP_TIMEOUT" ibv_rc_pingpong -d "$DEV" -g 0 -n "$ITERS" -j

# --- 5. perftest ---------------------------------------------------------------------------
# What perftest needs for RoCE: the device (-d) and the GID index (-x 0; without it perftest
# looks for a RoCE v2 GID in sysfs, where a user-space device has no entry). -F: no
# cpufreq warning.
PT=(-d "$DEV" -x 0 -F)
for tool in ib_write_bw ib_read_bw ib_send_bw ib_atomic_bw ib_write_lat ib_read_lat ib_send_lat ib_atomic_lat; do
  pair "$tool" "$STEP_TIMEOUT" "$tool" "${PT[@]}"
done
for tool in ib_write_bw ib_read_bw ib_send_bw ib_write_lat ib_read_lat ib_send_lat; do
  pair "$tool -a -n $AITERS" $((STEP_TIMEOUT * 3)) "$tool" "${PT[@]}" -a -n "$AITERS"
done
for tool in ib_write_bw ib_read_bw ib_send_bw ib_atomic_bw; do
  pair "$tool -b" "$STEP_TIMEOUT" "$tool" "${PT[@]}" -b
done
# UC does not retransmit and has no flow control: a sender that outruns its receiver loses
# messages (the receiver's socket buffer overflows; on loopback both sides cost about the
# same per packet, so any preemption of the receiver does it), and ib_send_bw's server then
# waits forever for them, as it would on a NIC whose receiver falls behind. perftest's
# software rate limiter keeps the sender at a pace the receiver sustains: 100 MiB/s (the
# unit M is MiB/s), in bursts of 4 messages (256 KiB). Its default burst is the whole send
# queue, 128 x 64 KiB = 8 MiB, twice the receiver's 4 MiB socket buffer: with that, a
# receiver preempted for a few milliseconds mid-burst lost messages (4 runs in 10 with two
# busy loops beside the pair, none in 40 with these settings). (A window, -t, bounds nothing
# here: a UC send completes once it is on the wire.)
for tool in ib_send_bw ib_send_lat; do
  for c in UD UC; do
    win=()
    [ "$tool $c" = "ib_send_bw UC" ] && win=(--rate_limit=100 --rate_units=M --rate_limit_type=SW --burst_size=4)
    pair "$tool -c $c" "$STEP_TIMEOUT" "$tool" "${PT[@]}" -c "$c" "${win[@]}"
  done
done

# --- 6. verbs_test ---------------------------------------------------------------------------
# One process per test group (verbs_test -l), so that a hang (the program's watchdog fails
# the check and exits) or a crash in one group does not hide the others. Every PASS/FAIL
# line of verbs_test becomes a check here.
vt_lines() { # prefix logfile: fold verbs_test's lines into the results; prints how many
  local pre=$1 lf=$2 n=0 line body why
  while IFS= read -r line; do
    case $line in
      PASS:\ *) result "$pre: ${line#PASS: }" 0 ""; n=$((n + 1)) ;;
      FAIL:\ *)
        # "FAIL: name (line N: reason)" or "FAIL: name (watchdog ...)": the name for the list
        body=${line#FAIL: }
        if [[ "$body" == *" (line "* ]]; then
          why="line ${body#* (line }"; body=${body%% (line *}
        else
          why="${body##* (}"; body=${body% (*}
        fi
        result "$pre: $body" 1 "${why%)}"
        n=$((n + 1)) ;;
    esac
  done < "$lf"
  VT_N=$n
}
verbs_test_run() { # name args...
  local name=$1; shift
  nstep=$((nstep + 1))
  local base lf el rc
  base="$OUT/$(slug "$name")" lf="$base.log" el="$base.stderr.log"
  sr 600 "$VT" "$@" > "$lf" 2> "$el"
  rc=$?
  vt_lines "verbs_test" "$lf"
  if [ "$VT_N" = 0 ] || { [ "$rc" != 0 ] && [ "$rc" != 1 ]; }; then
    result "verbs_test: $name exited" 1 "exit $rc$([ $rc = 124 ] && echo ' (timeout)'); $(tail -n 3 "$el" | tr '\n' ' ' | cut -c1-300); $el"
  fi
}
if [ ! -x "$VT" ]; then
  result "verbs_test" 1 "verbs_test was not built"
else
  if want "verbs_test: device"; then
    verbs_test_run "device" -d "$DEV" -g 0 -t none
  fi
  for g in $("$VT" -l); do
    want "verbs_test: $g" || continue
    verbs_test_run "$g" -q -d "$DEV" -g 0 -t "$g"
  done
  # GID index 1, the device's second address (::1 beside 127.0.0.x, the first device of
  # the host to open takes it): every group again in one process, so that every opcode
  # also crosses the IPv6 socket. Hosts without IPv6 on lo have no GID 1.
  if want "verbs_test -g 1"; then
    if python3 -c 'import socket; socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).bind(("::1", 4791))' 2> /dev/null; then
      nstep=$((nstep + 1))
      base="$OUT/$(slug "verbs_test -g 1")"
      sr 600 "$VT" -d "$DEV" -g 1 > "$base.log" 2> "$base.stderr.log"
      rc=$?
      vt_lines "verbs_test -g 1" "$base.log"
      if [ "$VT_N" = 0 ] || { [ "$rc" != 0 ] && [ "$rc" != 1 ]; }; then
        result "verbs_test -g 1 exited" 1 "exit $rc; $(tail -n 3 "$base.stderr.log" | tr '\n' ' ' | cut -c1-300)"
      fi
    else
      echo "SKIP: verbs_test -g 1 ([::1]:4791 cannot be bound here: no IPv6 on lo, or another device holds it)"
    fi
  fi
  # -F: the parent's device is open when it forks; the child must open one of its own.
  for fm in -f -F; do
    want "verbs_test $fm" || continue
    nstep=$((nstep + 1))
    base="$OUT/$(slug "verbs_test $fm")"
    sr 600 "$VT" -d "$DEV" -g 0 "$fm" > "$base.log" 2> "$base.stderr.log"
    rc=$?
    vt_lines "verbs_test $fm" "$base.log"
    if [ "$VT_N" = 0 ] || { [ "$rc" != 0 ] && [ "$rc" != 1 ]; }; then
      result "verbs_test $fm exited" 1 "exit $rc; $(tail -n 3 "$base.stderr.log" | tr '\n' ' ' | cut -c1-300)"
    fi
  done
fi

finish
