#!/usr/bin/env bash
# tests-ext/ibverbs/bench.sh: the drop-in libibverbs.so.1 (perftest through
# `softrdma run --`) beside the Rust path (`softrdma perf`), same sizes, same machine,
# same run, printed as a markdown table with ratios for BENCHMARKS.md.
#
#   ib_write_bw 1 MiB and 64 KiB, ib_read_bw 64 KiB, ib_send_bw 64 KiB: average MiB/s
#   ib_send_lat and ib_write_lat 8 B: typical (median) half round trip in µs; ib_write_lat
#   also beside `softrdma perf write-lat --memory-wait`, which waits as it does (watching
#   memory only, so the device's progress thread delivers every WRITE)
#
# Each figure is one server/client pair on loopback, server pinned to core 1 and client
# to core 0 (as scripts/bench), each process with its own zero-configuration device. Both
# paths use the same path MTU (the device's active MTU unless MTU is set) and the same
# iteration counts. A figure is the median of REPS runs (default 3).
#
# Env: REPS, MTU, SKIP_BUILD=1, OUT (raw logs; default a new /tmp directory),
#      STEP_TIMEOUT (seconds per program, default 180).
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
cd "$REPO" || exit 1
REPS=${REPS:-3}
OUT=${OUT:-$(mktemp -d /tmp/softrdma-ibverbs-bench.XXXXXX)}
STEP_TIMEOUT=${STEP_TIMEOUT:-180}
DEV=softrdma0
mkdir -p "$OUT"
log() { printf '[ibverbs-bench %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

for t in ib_write_bw ib_read_bw ib_send_bw ib_send_lat ib_write_lat taskset; do
  command -v "$t" >/dev/null 2>&1 || { echo "bench: $t not found (apt-get install perftest util-linux)" >&2; exit 1; }
done
TARGET=$(timeout 120 cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
PKGS=$(timeout 120 cargo metadata --format-version 1 --no-deps | python3 -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    if "/crates/ibverbs" in p["manifest_path"] or p["name"] == "softrdma-cli":
        print("-p", p["name"])' | tr '\n' ' ')
if [ -z "${SKIP_BUILD:-}" ]; then
  log "cargo build --release $PKGS"
  # shellcheck disable=SC2086
  timeout 1800 cargo build --release $PKGS >&2 || exit 1
fi
BIN=$TARGET/release/softrdma
[ -x "$BIN" ] || { echo "bench: $BIN not built" >&2; exit 1; }

if [ -z "${MTU:-}" ]; then
  MTU=$(timeout 30 "$BIN" run -- ibv_devinfo -d "$DEV" 2>/dev/null |
    sed -nE 's/.*active_mtu:[[:space:]]*([0-9]+).*/\1/p' | head -n 1)
  MTU=${MTU:-1024}
fi
log "path MTU $MTU, $REPS rep(s), raw logs in $OUT"

port=18700
# pair NAME SERVER_CMD... ::: CLIENT_CMD... : server on core 1, client on core 0; the
# client's output is in $OUT/NAME.client.log.
pair() {
  local name=$1; shift
  local scmd=() ccmd=()
  while [ "$1" != ::: ]; do scmd+=("$1"); shift; done
  shift
  ccmd=("$@")
  timeout -k 5 "$STEP_TIMEOUT" taskset -c 1 "${scmd[@]}" > "$OUT/$name.server.log" 2>&1 &
  local sp=$! i
  local hex
  hex=$(printf '%04X' "$port")
  for i in $(seq 1 100); do
    grep -qE "^ *[0-9]+: [0-9A-F]+:$hex [0-9A-F]+:0000 0A" /proc/net/tcp /proc/net/tcp6 2>/dev/null && break
    kill -0 "$sp" 2>/dev/null || break
    sleep 0.1
  done
  timeout -k 5 "$STEP_TIMEOUT" taskset -c 0 "${ccmd[@]}" > "$OUT/$name.client.log" 2>&1
  local crc=$? src
  echo "[exit $crc]" >> "$OUT/$name.client.log"
  [ $crc = 0 ] || log "$name: client exit $crc (see $OUT/$name.client.log)"
  wait "$sp"
  src=$?
  echo "[exit $src]" >> "$OUT/$name.server.log"
  [ $src = 0 ] || log "$name: server exit $src (see $OUT/$name.server.log)"
}

# perftest through the drop-in: "MiB/s" (bw) or "usec" (lat) on stdout, empty on failure.
dropin() { # name tool size iters kind
  local name=$1 tool=$2 size=$3 iters=$4 kind=$5
  port=$((port + 1))
  local args=(-d "$DEV" -x 0 -F -m "$MTU" -s "$size" -n "$iters" -p "$port")
  pair "$name" "$BIN" run -- "$tool" "${args[@]}" ::: "$BIN" run -- "$tool" "${args[@]}" 127.0.0.1
  python3 - "$OUT/$name.client.log" "$kind" <<'EOF'
import sys
kind = sys.argv[2]
lines = open(sys.argv[1], errors="replace").read().splitlines()
for i, l in enumerate(lines):
    if "#bytes" in l:
        for row in lines[i + 1:]:
            f = row.split()
            if len(f) >= 5 and f[0].isdigit():
                # bw: bytes iters peak avg rate; lat: bytes iters min max typical avg ...
                print(f[3] if kind == "bw" else f[4])
                sys.exit(0)
EOF
}

# softrdma perf (the Rust path): the same figure.
rust() { # name test size iters kind [extra softrdma perf options]
  local name=$1 test=$2 size=$3 iters=$4 kind=$5
  shift 5
  port=$((port + 1))
  local args=(perf "$test" -d "$DEV" -m "$MTU" -s "$size" -n "$iters" -p "$port" --json "$@")
  pair "$name" "$BIN" "${args[@]}" ::: "$BIN" "${args[@]}" 127.0.0.1
  python3 - "$OUT/$name.client.log" "$kind" <<'EOF'
import json, sys
kind = sys.argv[2]
for l in open(sys.argv[1], errors="replace"):
    l = l.strip()
    if l.startswith("{"):
        try:
            r = json.loads(l)["results"][0]
        except Exception:
            continue
        print(r["bw_avg_mb_per_sec"] if kind == "bw" else r["t_typical_usec"])
        sys.exit(0)
EOF
}

# name | perftest tool | softrdma perf test | size | iterations | kind
CASES="write_bw_1MiB ib_write_bw write-bw 1048576 2000 bw
write_bw_64KiB ib_write_bw write-bw 65536 20000 bw
read_bw_64KiB ib_read_bw read-bw 65536 20000 bw
send_bw_64KiB ib_send_bw send-bw 65536 20000 bw
send_lat_8B ib_send_lat send-lat 8 20000 lat
write_lat_8B ib_write_lat write-lat 8 20000 lat
write_lat_8B_memory_wait ib_write_lat write-lat 8 20000 lat --memory-wait"

RES="$OUT/results.tsv"
: > "$RES"
for r in $(seq "$REPS"); do
  while read -r name tool test size iters kind extra; do
    log "rep $r: $name: $tool / softrdma perf $test $extra, $size B x $iters"
    d=$(dropin "$name.dropin.$r" "$tool" "$size" "$iters" "$kind")
    # shellcheck disable=SC2086
    s=$(rust "$name.rust.$r" "$test" "$size" "$iters" "$kind" $extra)
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$tool" "$test${extra:+ $extra}" "$size" "$kind" "${d:-nan}" "${s:-nan}" >> "$RES"
  done <<< "$CASES"
done

python3 - "$RES" "$MTU" "$REPS" <<'EOF'
import statistics, sys, math
rows, mtu, reps = sys.argv[1], sys.argv[2], sys.argv[3]
data = {}
order = []
for l in open(rows):
    name, tool, test, size, kind, d, s = l.rstrip("\n").split("\t")
    if name not in data:
        order.append(name)
        data[name] = dict(tool=tool, test=test, size=int(size), kind=kind, d=[], s=[])
    for k, v in (("d", d), ("s", s)):
        try:
            x = float(v)
            if not math.isnan(x):
                data[name][k].append(x)
        except ValueError:
            pass

def size_s(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"

def fmt(xs, kind):
    if not xs:
        return None, f"failed ({reps} of {reps} runs)"
    m = statistics.median(xs)
    s = f"{m:,.0f} MiB/s" if kind == "bw" else f"{m:.2f} µs"
    if len(xs) < int(reps):
        s += f" ({int(reps) - len(xs)} of {reps} runs failed)"
    return m, s

print(f"| benchmark | size | drop-in: perftest on libibverbs.so.1 | Rust path: softrdma perf | drop-in / Rust |")
print("|---|---|---|---|---|")
for name in order:
    r = data[name]
    dm, ds = fmt(r["d"], r["kind"])
    sm, ss = fmt(r["s"], r["kind"])
    ratio = f"{dm / sm:.2f}" if dm and sm else "–"
    what = f"`{r['tool']}` / `softrdma perf {r['test']}`"
    print(f"| {what} | {size_s(r['size'])} | {ds} | {ss} | {ratio} |")
print()
print(f"Bandwidth: average MiB/s (higher is better; ratio > 1 means the drop-in is faster). "
      f"Latency: typical half round trip (lower is better; ratio > 1 means the drop-in is slower). "
      f"Median of the runs that finished, of {reps}; path MTU {mtu}; server on core 1, client on core 0, each process "
      f"with its own loopback device.")
EOF
echo
echo "Commands: \`tests-ext/ibverbs/bench.sh\` (REPS=$REPS); drop-in: \`softrdma run -- ib_write_bw -d $DEV -x 0 -F -m $MTU -s SIZE -n ITERS [127.0.0.1]\` and likewise; Rust: \`softrdma perf write-bw -m $MTU -s SIZE -n ITERS [127.0.0.1]\`; $(nproc) cores, $(uname -sr), $(date -u +%Y-%m-%d)."
echo "raw logs: $OUT" >&2
