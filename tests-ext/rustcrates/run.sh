#!/usr/bin/env bash
# tests-ext/rustcrates/run.sh: the examples of the Rust RDMA crates from crates.io,
# built as published (unmodified, with their own Cargo.lock, --locked) and run on
# softrdma through `softrdma run --`:
#   ibverbs 0.9.2 (rust-ibverbs, over ibverbs-sys): `loopback`, an RC QP connected to
#     itself on GID index 1, one SEND and its RECV; judged by its "sent" and "received"
#     lines (it checks the received word) and exit 0;
#   sideway 0.4.3 (over rdma-mummy-sys, which dlopens libibverbs.so.1 and librdmacm.so.1
#     at run time): `show_gids` (a RoCEv2 GID of 127.0.0.x on port 1, on `lo`, the GID
#     the IPv4-mapped form of that address), `ibv_devinfo` (the device, its port Active
#     on an Ethernet link layer), `rc_pingpong` and `rc_pingpong_split` (server and
#     client, two processes, GID index 0, each side sending 1000 messages of 1 KiB and
#     receiving the other's 1000 with the extended QP and CQ API; each side must report
#     every byte and iteration and see the other's GID; a run lost to the example's fixed
#     retry budget on a host too busy to run a process for 134 ms is run once more, and
#     the result says so) and `cmtime` (server and client over the rdma_cm: 100
#     connections made and torn down; the client's table has every step and neither
#     side reports an event error; the server ends by itself once all are gone).
# Prints PASS/FAIL per check (SKIP for what cannot run here, not counted) and
# "N passed, M failed"; exits 1 on any failure. Logs in $OUT.
#
# Build: a scratch project depending on ibverbs = "=0.9.2" and sideway = "=0.4.3" makes
# cargo fetch both crates (checksums checked against the index); each .crate is unpacked
# under <target>/rustcrates/ and its examples built there (debug, the quicker build),
# target directory <target>/rustcrates/target, so a second run only checks freshness.
# A package unpacked below this repository would be taken for a member of softrdma's
# workspace; each sits instead in a one-member workspace of its own whose Cargo.lock is
# the one the package ships. The crates' build scripts run cmake and bindgen (libclang)
# over the C headers they carry (ibverbs-sys configures its vendored rdma-core, which
# needs libnl and python3). The shipped lock files need Rust 1.88 or newer (sideway's
# pins home 0.5.12, which asks 1.88; ibverbs's highest is ibverbs-sys's 1.82). For CI
# as root on Debian 12: installs cmake, make, gcc, pkg-config, python3, libclang1-14,
# libclang-common-14-dev, libnl-3-dev and libnl-route-3-dev with apt when missing.
# Nothing is downloaded while the examples run. Every step runs under `timeout`.
#
#   sudo tests-ext/rustcrates/run.sh
#
# Env: SOFTRDMA_BIN (default <target>/release/softrdma, built with the drop-ins and the
# provider stand-ins: the script builds them unless SKIP_BUILD=1; the examples are
# always built, which costs nothing once they are), ONLY (regex of check names), OUT
# (artifacts, default /tmp/softrdma-rustcrates), STEP_TIMEOUT (s, default 60),
# BASE_PORT (TCP ports of the examples' exchanges, default 13600), SKIP_INSTALL=1.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${OUT:-/tmp/softrdma-rustcrates}
STEP_TIMEOUT=${STEP_TIMEOUT:-60}
ONLY=${ONLY:-}
PORT=${BASE_PORT:-13600}

IBVERBS=ibverbs-0.9.2
SIDEWAY=sideway-0.4.3
SIDEWAY_EXAMPLES=(show_gids ibv_devinfo rc_pingpong rc_pingpong_split cmtime)

LOG_TAG=rustcrates
# shellcheck source=tests-ext/lib.sh
. "$REPO/tests-ext/lib.sh"

mkdir -p "$OUT"
rm -f "$OUT"/*.log

# --- packages ----------------------------------------------------------------------------
need_pkgs=()
# bindgen loads libclang at run time and needs clang's own headers beside it: libclang1-14
# and libclang-common-14-dev, not libclang-dev (which adds 240 MB of static libraries).
for p in cmake make gcc libc6-dev pkg-config python3 libclang1-14 libclang-common-14-dev \
  libnl-3-dev libnl-route-3-dev; do
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || need_pkgs+=("$p")
done
install_needed || finish

# --- build -------------------------------------------------------------------------------
cd "$REPO" || exit 1
build_dropins || finish

B="$TARGET/rustcrates"
CH=${CARGO_HOME:-$HOME/.cargo}
mkdir -p "$B/fetch/src"
# The scratch project only names the two crates for cargo to fetch (it is never built).
cat > "$B/fetch/Cargo.toml" <<EOF
[package]
name = "softrdma-rustcrates-fetch"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
ibverbs = "=${IBVERBS#ibverbs-}"
sideway = "=${SIDEWAY#sideway-}"

[workspace]
EOF
[ -f "$B/fetch/src/main.rs" ] || echo 'fn main() {}' > "$B/fetch/src/main.rs"
log "cargo fetch $IBVERBS $SIDEWAY"
(cd "$B/fetch" && timeout 900 cargo fetch) > "$OUT/fetch.log" 2>&1
result "cargo fetch ibverbs =${IBVERBS#ibverbs-}, sideway =${SIDEWAY#sideway-} from crates.io" $? "see $OUT/fetch.log"

# unpack PKG: the published .crate into $B/NAME/PKG, inside a one-member workspace whose
# Cargo.lock is the package's own (see the head of this file).
unpack() {
  local pkg=$1 name=${1%-*} crate tmp
  if [ ! -f "$B/$name/$pkg/Cargo.toml" ]; then
    crate=$(find "$CH/registry/cache" -name "$pkg.crate" 2>/dev/null | head -n 1)
    [ -n "$crate" ] || { echo "no $pkg.crate under $CH/registry/cache"; return 1; }
    rm -rf "${B:?}/$name"
    tmp=$(mktemp -d "$B/unpack.XXXXXX") || return 1
    tar -xzf "$crate" -C "$tmp" || return 1
    mkdir -p "$B/$name" && mv "$tmp/$pkg" "$B/$name/$pkg" && rmdir "$tmp" || return 1
  fi
  printf '[workspace]\nmembers = ["%s"]\nresolver = "2"\n' "$pkg" > "$B/$name/Cargo.toml"
  cmp -s "$B/$name/$pkg/Cargo.lock" "$B/$name/Cargo.lock" || cp "$B/$name/$pkg/Cargo.lock" "$B/$name/Cargo.lock"
}
EX="$B/target/debug/examples"
# build PKG EXAMPLE...: cargo build --locked of those examples, a result.
build() {
  local pkg=$1 name=${1%-*} ex args=()
  shift
  for ex in "$@"; do args+=(--example "$ex"); done
  log "cargo build --locked -p $name ${args[*]}"
  {
    unpack "$pkg" &&
      (cd "$B/$name" && CARGO_TARGET_DIR="$B/target" timeout 1800 cargo build --locked -p "$name" "${args[@]}")
  } > "$OUT/build.$name.log" 2>&1
  result "cargo build --locked $pkg examples: $*" $? "see $OUT/build.$name.log"
}
if want "loopback"; then
  build "$IBVERBS" loopback
fi
sw=()
for e in "${SIDEWAY_EXAMPLES[@]}"; do want "$e" && sw+=("$e"); done
[ "${#sw[@]}" -gt 0 ] && build "$SIDEWAY" "${sw[@]}"

# --- one process -------------------------------------------------------------------------
# single NAME EXAMPLE ARGS...: run it through `softrdma run`; RC and L (the log).
single() {
  local name=$1
  shift
  L="$OUT/$(slug "$name").log"
  echo "\$ softrdma run -- $*" > "$L"
  timeout -k 5 "$STEP_TIMEOUT" "$SOFTRDMA" run -- "$@" >> "$L" 2>&1
  RC=$?
}
last() { grep -v '^\$' "$1" | grep -v '^ *[0-9]*: \|^ *at \|^stack backtrace\|^note: ' | tail -n 3 | tr '\n' ' ' | cut -c1-220; }

name="${IBVERBS/-/ } loopback"
if want "loopback"; then
  single "$name" "$EX/loopback"
  [ "$RC" = 0 ] && grep -qx sent "$L" && grep -qx received "$L"
  result "$name: GID index 1, sent and received" $? "exit $RC; $(last "$L"); $L"
fi

name="${SIDEWAY/-/ } show_gids"
if want "show_gids"; then
  single "$name" "$EX/show_gids"
  # A row: Dev | Port | Index | GID | IPv4 | Ver | Netdev, the GID the IPv4-mapped address.
  [ "$RC" = 0 ] && awk -F'|' '
    { for (i = 1; i <= NF; i++) gsub(/^ +| +$/, "", $i) }
    $1 ~ /^softrdma[0-9]+$/ && $2 == 1 && $3 == 0 && $6 == "RoCEv2" && $7 == "lo" &&
      split($5, o, ".") == 4 && o[1] == 127 &&
      $4 == sprintf("0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x", o[1], o[2], o[3], o[4]) { ok = 1 }
    END { exit !ok }' "$L"
  result "$name: softrdma0 port 1 index 0, RoCEv2 GID of its 127.0.0.x on lo" $? "exit $RC; $(last "$L"); $L"
fi

name="${SIDEWAY/-/ } ibv_devinfo"
if want "ibv_devinfo"; then
  single "$name" "$EX/ibv_devinfo"
  [ "$RC" = 0 ] && grep -qE '^hca_id: softrdma[0-9]+$' "$L" && grep -qE 'phys_port_cnt: +1$' "$L" &&
    grep -qE '└── port: 1$' "$L" && grep -qE 'state: +Active \(4\)$' "$L" &&
    grep -qE 'link_layer: +Ethernet$' "$L" && grep -qE 'max_qp: +[1-9][0-9]*$' "$L"
  result "$name: softrdma0, one port, Active, Ethernet" $? "exit $RC; $(last "$L"); $L"
fi

# --- two processes -----------------------------------------------------------------------
# The rdma_cm processes share a registry of their own: no other program's binding collides
# with the ports here, and a server's record says when it listens.
REG="$OUT/registry"
rm -rf "$REG"
mkdir -m 700 "$REG"
export SOFTRDMA_CM_DIR="$REG"
BG=""   # the server running in the background (pid), if any: stopped on exit
trap '[ -n "$BG" ] && kill $BG 2>/dev/null' EXIT

# listens tcp|cm PORT: whether something listens on TCP port PORT (v4 or v6), or on
# rdma_cm port PORT.
listens() {
  case $1 in
    tcp) grep -qE "^ *[0-9]+: [0-9A-F]+:$(printf '%04X' "$2") [0-9A-F]+:0000 0A" /proc/net/tcp /proc/net/tcp6 2>/dev/null ;;
    cm) cm_listening "$REG" "$2" ;;
  esac
}
# pair NAME WAIT PORT SERVER-ARGS... -- CLIENT-ARGS...: the server in the background,
# once it listens (WAIT: tcp or cm, see listens; at most 10 s) the client.
# SRC/CRC (exit codes), SL/CL (logs). A server still running 10 s after its client
# ended is stopped (SRC 143); one whose client failed, at once.
pair() {
  local name=$1 wait=$2 port=$3 spid
  shift 3
  local -a sargs=() cargs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do sargs+=("$1"); shift; done
  shift
  cargs=("$@")
  SL="$OUT/$(slug "$name").server.log" CL="$OUT/$(slug "$name").client.log"
  echo "\$ softrdma run -- ${sargs[*]}" > "$SL"
  timeout -k 5 "$STEP_TIMEOUT" "$SOFTRDMA" run -- "${sargs[@]}" >> "$SL" 2>&1 &
  spid=$!
  BG=$spid
  for _ in $(seq 1 100); do
    listens "$wait" "$port" && break
    kill -0 "$spid" 2>/dev/null || break
    sleep 0.1
  done
  echo "\$ softrdma run -- ${cargs[*]}" > "$CL"
  timeout -k 5 "$STEP_TIMEOUT" "$SOFTRDMA" run -- "${cargs[@]}" >> "$CL" 2>&1
  CRC=$?
  if [ "$CRC" = 0 ]; then
    for _ in $(seq 1 100); do kill -0 "$spid" 2>/dev/null || break; sleep 0.1; done
  fi
  kill "$spid" 2>/dev/null
  wait "$spid"
  SRC=$?
  BG=""
}
why() { echo "server exit $SRC, client exit $CRC; client: $(last "$CL"); server: $(last "$SL"); $OUT/$(slug "$1").*.log"; }

# rc_pingpong and rc_pingpong_split: the server listens on [::]:port for the exchange of
# QPN, PSN and GID; the client connects to it. Each side prints "<2 x size x iters> bytes
# in ..." and "<iters> iters in ..." once it has sent and received every message.
ITERS=1000 SIZE=1024
v6=1
python3 -c 'import socket; socket.socket(socket.AF_INET6).bind(("::", 0))' 2>/dev/null || v6=0
for ex in rc_pingpong rc_pingpong_split; do
  name="${SIDEWAY/-/ } $ex"
  want "$ex" || continue
  if [ "$v6" = 0 ]; then
    skip "$name" "its server listens on [::], and this host has no IPv6 sockets"
    continue
  fi
  again=""
  for n in 1 2; do
    PORT=$((PORT + 1))
    args=(-p "$PORT" -g 0 -n "$ITERS" -s "$SIZE")
    pair "$name" tcp "$PORT" "$EX/$ex" "${args[@]}" -- "$EX/$ex" "${args[@]}" 127.0.0.1
    # The example gives its QP timeout 12 and retry_cnt 7: a send unacknowledged for about
    # 134 ms fails with "Failed status RetryCounterExceededError (12)" on that side, and
    # the other side's next send then too. A host too busy to run one of the two
    # processes for that long does just that (on two cores shared with other
    # busy-polling programs and compilers, a pcap showed a process neither receiving nor
    # firing its own retransmission timer for 280 ms, and a plain C loop reading the clock
    # saw gaps of up to 224 ms); such a run is run once more, and the result says so.
    if [ "$n" = 2 ] || { [ "$SRC" = 0 ] && [ "$CRC" = 0 ]; } ||
      ! grep -q 'Failed status RetryCounterExceededError (12)' "$SL" "$CL"; then
      break
    fi
    mv "$SL" "${SL%.log}.run1.log"
    mv "$CL" "${CL%.log}.run1.log"
    again="; run twice, the first ran out of retries: ${CL%.log}.run1.log"
  done
  ok=1
  for f in "$SL" "$CL"; do
    grep -qE "^$((2 * SIZE * ITERS)) bytes in [0-9.]+ seconds = " "$f" &&
      grep -qE "^$ITERS iters in [0-9.]+ seconds = " "$f" || ok=0
  done
  # Each side's "remote address" GID is the other's "local address" GID.
  sg=$(sed -nE 's/^ *local address: .*GID ([0-9a-f:]+)$/\1/p' "$SL")
  cg=$(sed -nE 's/^ *local address: .*GID ([0-9a-f:]+)$/\1/p' "$CL")
  [ "$SRC" = 0 ] && [ "$CRC" = 0 ] && [ "$ok" = 1 ] && [ -n "$sg" ] && [ -n "$cg" ] && [ "$sg" != "$cg" ] &&
    grep -qE "^remote address: .*GID $cg$" "$SL" && grep -qE "^remote address: .*GID $sg$" "$CL"
  result "$name: GID index 0, $ITERS messages of $SIZE B each way$again" $? "$(why "$name")$again"
done

# cmtime: the client makes, connects and disconnects 100 ids and prints a table of the
# steps; the server accepts them and ends once all 100 are disconnected. Failed events
# print "Event: <type>, error: <n>" or "Other events: ...".
name="${SIDEWAY/-/ } cmtime"
if want "cmtime"; then
  PORT=$((PORT + 1))
  pair "$name" cm "$PORT" "$EX/cmtime" -p "$PORT" -c 100 -- \
    "$EX/cmtime" -s 127.0.0.1 -p "$PORT" -c 100
  steps=0
  for st in CreateId ResolveAddr ResolveRoute CreateQueuePair Connect Disconnect; do
    grep -qE "^ *$st +\| +[0-9.]+ +\| +[0-9.]+ +\| +[0-9.]+ *$" "$CL" && steps=$((steps + 1))
  done
  errs=$(grep -hE '^(Event|Other events): ' "$CL" "$SL" | head -n 3 | tr '\n' ' ')
  [ "$SRC" = 0 ] && [ "$CRC" = 0 ] && [ "$steps" = 6 ] && [ -z "$errs" ]
  result "$name: 100 connections over the rdma_cm, all 6 steps in the table, no event errors" $? \
    "$steps of 6 steps, errors: ${errs:-none}; $(why "$name")"
fi

finish
