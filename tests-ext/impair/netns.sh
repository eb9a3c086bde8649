# shellcheck shell=bash
# tests-ext/impair/netns.sh: two "hosts" as network namespaces joined by a veth pair, with
# the `impair` NFQUEUE impairer on the RoCEv2 traffic each one sends. Sourced by
# tests-ext/impair/run.sh and scripts/bench-loss, after tests-ext/lib.sh (for log) and
# with OUT set. Needs root, ip (iproute2) and iptables.
#
# Layout: namespace $NS_A holds veth $VETH_A with $ADDR_A, namespace $NS_B holds $VETH_B
# with $ADDR_B. In each namespace, UDP to port 4791 leaving through the veth goes to
# NFQUEUE queue 1, served by an impairer running in that namespace, so both directions
# (requests and responses/ACKs) are impaired, each by its own seeded stream. Packets
# marked $IMPAIR_MARK (the impairer's duplicates) skip the queue.
#
# NFQUEUE gives the packet to user space as the kernel will send it and takes it back:
# nothing rewrites addresses, ports or the IP ID, which the RoCEv2 ICRC covers.

NS_A=srimpA$$
NS_B=srimpB$$
VETH_A=srimpa$$
VETH_B=srimpb$$
ADDR_A=10.77.0.1
ADDR_B=10.77.0.2
IMPAIR_MARK=0x4791
IMPAIR_PIDS=()
NS_PIDS=()

# Run in namespace A or B.
in_a() { ip netns exec "$NS_A" "$@"; }
in_b() { ip netns exec "$NS_B" "$@"; }

# iptables, or iptables-legacy where the nf_tables flavour cannot load the NFQUEUE target.
IPT=iptables

netns_setup() {
  ip netns add "$NS_A" && ip netns add "$NS_B" &&
    ip link add "$VETH_A" netns "$NS_A" type veth peer name "$VETH_B" netns "$NS_B" &&
    in_a ip addr add "$ADDR_A/24" dev "$VETH_A" &&
    in_b ip addr add "$ADDR_B/24" dev "$VETH_B" &&
    in_a ip link set lo up && in_b ip link set lo up &&
    in_a ip link set "$VETH_A" up && in_b ip link set "$VETH_B" up || return 1
  MAC_A=$(in_a cat "/sys/class/net/$VETH_A/address") &&
    MAC_B=$(in_b cat "/sys/class/net/$VETH_B/address") || return 1
  local rule=(OUTPUT -o VETH -p udp --dport 4791 -m mark ! --mark "$IMPAIR_MARK" -j NFQUEUE --queue-num 1)
  for IPT in iptables iptables-legacy; do
    command -v "$IPT" >/dev/null || continue
    if in_a "$IPT" -w -A "${rule[@]/VETH/$VETH_A}" 2>>"$OUT/iptables.log" &&
      in_b "$IPT" -w -A "${rule[@]/VETH/$VETH_B}" 2>>"$OUT/iptables.log"; then
      return 0
    fi
    in_a "$IPT" -w -F OUTPUT 2>/dev/null
    in_b "$IPT" -w -F OUTPUT 2>/dev/null
  done
  return 1
}

# Start an impairer in each namespace: impair_start LOSS DUP REORDER CORRUPT SEED TAG.
# Logs in $OUT/impair-TAG-{a,b}.log. Returns non-zero when either is not ready in 10 s.
impair_start() {
  local loss=$1 dup=$2 reorder=$3 corrupt=$4 seed=$5 tag=$6 side
  IMPAIR_PIDS=()
  for side in a b; do
    local ns dev mac s
    if [ "$side" = a ]; then ns=$NS_A dev=$VETH_A mac=$MAC_B s=$seed; else ns=$NS_B dev=$VETH_B mac=$MAC_A s=$((seed + 1000003)); fi
    ip netns exec "$ns" "$IMPAIR" --queue 1 --seed "$s" --loss "$loss" --dup "$dup" \
      --reorder "$reorder" --corrupt "$corrupt" --inject-dev "$dev" --inject-mac "$mac" \
      --mark "$IMPAIR_MARK" >"$OUT/impair-$tag-$side.log" 2>&1 &
    IMPAIR_PIDS+=($!)
  done
  for _ in $(seq 100); do
    if grep -q ready "$OUT/impair-$tag-a.log" && grep -q ready "$OUT/impair-$tag-b.log"; then
      return 0
    fi
    sleep 0.1
  done
  return 1
}

# Stop the impairers (SIGTERM: they release what they hold and print their counters) and
# set IMPAIR_SEEN and IMPAIR_DROPPED (both directions summed), IMPAIR_COUNTERS (their
# lines) and IMPAIR_KERNEL_DROPS (packets the kernel dropped on the queues since the
# namespaces were made).
impair_stop() {
  local tag=$1 p
  # shellcheck disable=SC2034 # read by the scripts that source this file
  IMPAIR_KERNEL_DROPS=$(kernel_drops)
  for p in "${IMPAIR_PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${IMPAIR_PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null
    wait "$p" 2>/dev/null
  done
  IMPAIR_PIDS=()
  IMPAIR_COUNTERS=$(grep -h 'seen=' "$OUT/impair-$tag-a.log" "$OUT/impair-$tag-b.log")
  # shellcheck disable=SC2034 # read by the scripts that source this file
  IMPAIR_SEEN=$(impair_sum seen) IMPAIR_DROPPED=$(impair_sum dropped)
}

# Packets the kernel dropped on queue 1 in both namespaces (queue full, or the impairer's
# socket buffer full): losses too, and bursty ones. /proc/net is per namespace.
kernel_drops() {
  local ns k n=0
  for ns in "$NS_A" "$NS_B"; do
    # shellcheck disable=SC2016 # awk's own $6 and $7
    k=$(ip netns exec "$ns" awk '$1 == 1 { print $6 + $7 }' /proc/net/netfilter/nfnetlink_queue 2>/dev/null)
    n=$((n + ${k:-0}))
  done
  echo "$n"
}

# The sum of one counter over both impairers' lines.
impair_sum() {
  local n=0 v
  while read -r v; do n=$((n + v)); done < <(grep -o " $1=[0-9]*" <<<"$IMPAIR_COUNTERS" | cut -d= -f2)
  echo "$n"
}

# Start a background process in a namespace and remember it for cleanup: ns_bg A|B CMD...
ns_bg() {
  local w=$1
  shift
  if [ "$w" = A ]; then in_a "$@" & else in_b "$@" & fi
  NS_PIDS+=($!)
}

# Kill what we started (by PID) and delete the namespaces (which takes the veth pair).
netns_cleanup() {
  local p
  for p in "${IMPAIR_PIDS[@]}" "${NS_PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  sleep 0.2
  for p in "${IMPAIR_PIDS[@]}" "${NS_PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  ip netns del "$NS_A" 2>/dev/null
  ip netns del "$NS_B" 2>/dev/null
  return 0
}
