#!/usr/bin/env bash
# tests-ext/impair/run.sh: RC exactly-once and in order over an impaired link. Two
# "hosts" are two network namespaces joined by a veth pair; in each, the RoCEv2 packets
# it sends (UDP port 4791) pass through a seeded NFQUEUE impairer (`impair`: loss,
# duplication, reordering, corruption, without rewriting any byte the ICRC covers). The
# `soak` server runs in one namespace and its client in the other: OPS work requests
# mixing WRITE (each read back), READ, SEND/RECV, FETCH_AND_ADD and COMPARE_AND_SWAP, every
# completion a success, every byte, the order of SENDs, the atomics' returned values and
# the final memory and counters checked (see tests-ext/impair/src/bin/soak.rs).
#
# Checks: the build; the namespaces, veth and NFQUEUE rules; both impairers ready; the
# soak (client and server exit 0 within TIMEOUT); the impairers saw the traffic and, when
# LOSS > 0, dropped some of it (so the run was really impaired).
#
#   sudo tests-ext/impair/run.sh
#   sudo LOSS=0.01 OPS=20000 tests-ext/impair/run.sh
#
# Env: LOSS (default 0.10), DUP, REORDER, CORRUPT (default 0) per packet and direction;
# OPS (default 100000), SEED (default 1), DEPTH (WRs in flight, default 16), TIMEOUT
# (seconds for the soak, default 600), SOAK_ARGS (more soak options, e.g.
# "--ack-timeout 10"), SERVER_ENV and CLIENT_ENV (VAR=VALUE words for one side, e.g.
# "SOFTRDMA_PCAP=/tmp/server.pcap SOFTRDMA_LOG=debug"), OUT (logs, default /tmp/softrdma-impair), SKIP_BUILD=1 (use the
# binaries in the target directory), SKIP_INSTALL=1, ONLY (regex of check names).
# As root on Debian 12 it installs iproute2 and iptables with apt when missing.
# Prints PASS/FAIL per check and "N passed, M failed"; exits 1 on any failure.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${OUT:-/tmp/softrdma-impair}
LOSS=${LOSS:-0.10} DUP=${DUP:-0} REORDER=${REORDER:-0} CORRUPT=${CORRUPT:-0}
OPS=${OPS:-100000} SEED=${SEED:-1} DEPTH=${DEPTH:-16} TIMEOUT=${TIMEOUT:-600}
SOAK_ARGS=${SOAK_ARGS:-} SERVER_ENV=${SERVER_ENV:-} CLIENT_ENV=${CLIENT_ENV:-}
ONLY=${ONLY:-}

LOG_TAG=impair
# shellcheck source=tests-ext/lib.sh
. "$REPO/tests-ext/lib.sh"
# shellcheck source=tests-ext/impair/netns.sh
. "$HERE/netns.sh"
mkdir -p "$OUT"

name="soak loss=$LOSS dup=$DUP reorder=$REORDER corrupt=$CORRUPT ops=$OPS seed=$SEED"
if [ "$(id -u)" != 0 ]; then
  skip "$name" "needs root for network namespaces and NFQUEUE"
  echo "run: sudo $0"
  exit 0
fi
if ! want "$name"; then
  skip "$name" "not in ONLY=$ONLY"
  exit 0
fi

need_pkgs=()
command -v ip >/dev/null || need_pkgs+=(iproute2)
command -v iptables >/dev/null || need_pkgs+=(iptables)
install_needed || finish

TARGET=$(cargo_target_dir)
if [ -z "${SKIP_BUILD:-}" ]; then
  log "cargo build --release -p softrdma-impair"
  (cd "$REPO" && timeout 1800 cargo build --release -p softrdma-impair) >"$OUT/build.log" 2>&1
  result "cargo build --release -p softrdma-impair" $? "see $OUT/build.log"
fi
IMPAIR=$TARGET/release/impair SOAK=$TARGET/release/soak
if [ ! -x "$IMPAIR" ] || [ ! -x "$SOAK" ]; then
  result "impair and soak binaries" 1 "not in $TARGET/release"
  finish
fi

trap netns_cleanup EXIT
trap 'exit 130' INT TERM

netns_setup
result "namespaces $NS_A and $NS_B, veth, NFQUEUE rules ($IPT)" $? "see $OUT/iptables.log"
[ "$fail" = 0 ] || finish
impair_start "$LOSS" "$DUP" "$REORDER" "$CORRUPT" "$SEED" soak
result "impairers ready" $? "see $OUT/impair-soak-{a,b}.log"
[ "$fail" = 0 ] || finish

log "$name"
start=$(date +%s.%N)
# shellcheck disable=SC2086
ns_bg B env SOFTRDMA_ADDR=$ADDR_B $SERVER_ENV timeout $((TIMEOUT + 60)) "$SOAK" --timeout "$TIMEOUT" \
  $SOAK_ARGS >"$OUT/soak-server.log" 2>&1
server=${NS_PIDS[-1]}
# shellcheck disable=SC2086
in_a env SOFTRDMA_ADDR=$ADDR_A $CLIENT_ENV timeout $((TIMEOUT + 30)) "$SOAK" "$ADDR_B" --ops "$OPS" \
  --seed "$SEED" --depth "$DEPTH" --timeout "$TIMEOUT" $SOAK_ARGS >"$OUT/soak-client.log" 2>&1
crc=$?
wait "$server"
src=$?
secs=$(echo "$start $(date +%s.%N)" | awk '{printf "%.1f", $2 - $1}')
impair_stop soak
grep -h 'ok:\|FAILED' "$OUT/soak-client.log" "$OUT/soak-server.log"
echo "$IMPAIR_COUNTERS"
echo "kernel drops on the queues (queue or socket buffer full): $IMPAIR_KERNEL_DROPS"
detail="client exit $crc, server exit $src after ${secs}s: $(grep -h FAILED "$OUT/soak-client.log" "$OUT/soak-server.log" | head -2 | tr '\n' ' ')see $OUT/soak-*.log"
result "$name (${secs}s)" $((crc | src)) "$detail"
[ "$IMPAIR_SEEN" -gt 0 ]
result "impairers saw the RoCEv2 traffic ($IMPAIR_SEEN packets)" $? "no packet went through the queue: the rules missed the traffic"
if awk "BEGIN { exit !($LOSS > 0) }"; then
  [ "$IMPAIR_DROPPED" -gt 0 ]
  result "impairers dropped packets ($IMPAIR_DROPPED of $IMPAIR_SEEN)" $? "LOSS=$LOSS but nothing was dropped"
fi
finish
