#!/usr/bin/env python3
"""Composes BENCHMARKS.md from the anchors' results.tsv and softrdma's figures.

Usage: bench_report.py ANCHORS_TSV RUNS_DIR MACHINE_TXT COMMAND
ANCHORS_TSV has rows: section, metric, unit, value. RUNS_DIR holds one `softrdma perf
--json` client output per run, named `TEST,SIZE,KIND,REP.json`. Repeated figures are
reduced to their median.
"""
import datetime
import json
import os
import re
import statistics
import sys
from collections import defaultdict


def load(path):
    rows = defaultdict(list)
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 4:
                continue
            try:
                rows[(parts[0], parts[1], parts[2])].append(float(parts[3]))
            except ValueError:
                pass
    return {k: (statistics.median(v), len(v)) for k, v in rows.items()}


def load_runs(path):
    """Median per (test, size, unit) over the runs; a failed run counts as missing."""
    rows = defaultdict(list)
    for name in sorted(os.listdir(path)):
        parts = name[: -len(".json")].split(",")
        if not name.endswith(".json") or len(parts) != 4:
            continue
        test, size, kind, _rep = parts
        with open(os.path.join(path, name)) as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                for row in json.loads(line).get("results", []):
                    if kind == "bw":
                        rows[(test, size, "GB/s")].append(row["bw_avg_mb_per_sec"] / 1000.0)
                    else:
                        rows[(test, size, "us")].append(row["t_typical_usec"])
    return {k: (statistics.median(v), len(v)) for k, v in rows.items()}


def load_udp_pp(path):
    """Median half round trip (µs) per datagrams-per-turn over the udp_pp runs."""
    rows = defaultdict(list)
    for name in sorted(os.listdir(path)):
        if not (name.startswith("udp_pp,") and name.endswith(".txt")):
            continue
        with open(os.path.join(path, name)) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2:
                    try:
                        rows[int(parts[0])].append(float(parts[1]))
                    except ValueError:
                        pass
    return {k: statistics.median(v) for k, v in rows.items()}


CMTIME_STEPS = ("create id", "resolve addr", "resolve route", "create qp", "connect")


def load_cmtime(path):
    """Median connections per second over the cmtime runs: for the connect step alone
    (REQ to ESTABLISHED, 100 at once) and for the whole set-up (create id to
    ESTABLISHED, the sum of its steps' wall times)."""
    connect, setup = [], []
    for name in sorted(os.listdir(path)):
        if not (name.startswith("cmtime,") and name.endswith(".txt")):
            continue
        total, conns = {}, None
        with open(os.path.join(path, name)) as f:
            for line in f:
                m = re.match(r"^(\S.*?)\s*:\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)$", line)
                if m:
                    total[m.group(1)] = float(m.group(2))
                    # us/conn = total ms * 1000 / connections
                    if float(m.group(5)) > 0:
                        conns = round(float(m.group(2)) * 1000 / float(m.group(5)))
        if conns and all(s in total for s in CMTIME_STEPS) and total["connect"] > 0:
            connect.append(conns / (total["connect"] / 1000))
            setup.append(conns / (sum(total[s] for s in CMTIME_STEPS) / 1000))
    med = lambda v: statistics.median(v) if v else None
    return med(connect), med(setup), len(connect)


def load_ucx(path):
    """Median ucx_perftest figures per (transport, test): GB/s for ucp_put_bw and tag_bw,
    the p50 latency (µs) for tag_lat, from the client's "Final:" row (iterations, p50,
    average, overall latency, average and overall bandwidth, message rates)."""
    rows = defaultdict(list)
    for name in sorted(os.listdir(path)):
        parts = name[: -len(".txt")].split(",")
        if not (name.startswith("ucx,") and name.endswith(".txt") and len(parts) == 4):
            continue
        _, tl, test, _rep = parts
        with open(os.path.join(path, name)) as f:
            for line in f:
                w = line.split()
                if len(w) >= 9 and w[0] == "Final:":
                    v = float(w[5]) / 1000.0 if test in ("ucp_put_bw", "tag_bw") else float(w[2])
                    rows[(tl, test)].append(v)
    return {k: statistics.median(v) for k, v in rows.items()}


def load_mpi(path):
    """Median scripts/mpi_pp figures per (kind, figure): "lat8" (µs, the 8-byte half round
    trip) and "bw1m" (GB/s, 1 MiB messages streamed)."""
    rows = defaultdict(list)
    for name in sorted(os.listdir(path)):
        parts = name[: -len(".txt")].split(",")
        if not (name.startswith("mpi,") and name.endswith(".txt") and len(parts) == 3):
            continue
        with open(os.path.join(path, name)) as f:
            for line in f:
                w = line.split()
                if len(w) == 3 and w[0] == "RESULT":
                    try:
                        rows[(parts[1], w[1])].append(float(w[2]))
                    except ValueError:
                        pass
    return {k: statistics.median(v) for k, v in rows.items()}


def load_write_lat(path):
    """Median t_typical (µs) of perftest's ib_write_lat 8-byte rows over the runs."""
    v = []
    for name in sorted(os.listdir(path)):
        if name.startswith("ib_write_lat,") and name.endswith(".txt"):
            with open(os.path.join(path, name)) as f:
                for line in f:
                    w = line.split()
                    if len(w) >= 5 and w[0] == "8":
                        try:
                            v.append(float(w[4]))
                        except ValueError:
                            pass
    return statistics.median(v) if v else None


def load_tcp_conn(path):
    """Median TCP connections per second over every round of every tcp_conn run."""
    v = []
    for name in sorted(os.listdir(path)):
        if name.startswith("tcp_conn,") and name.endswith(".txt"):
            with open(os.path.join(path, name)) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 2 and parts[0] == "conns_per_s":
                        v.append(float(parts[1]))
    return statistics.median(v) if v else None


def anchor(anchors, pattern, unit):
    """The median of the first anchor metric matching `pattern`."""
    for (sec, metric, u), (v, n) in anchors.items():
        if u == unit and re.search(pattern, metric):
            return v, metric
    return None, None


def fmt(v, digits=2):
    return "n/a" if v is None else f"{v:.{digits}f}"


def ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def main():
    anchors = load(sys.argv[1])
    ours = load_runs(sys.argv[2])
    machine = open(sys.argv[3]).read().strip() if len(sys.argv) > 3 else ""
    command = sys.argv[4] if len(sys.argv) > 4 else "scripts/bench"

    def mine(test, size, unit):
        got = ours.get((test, str(size), unit))
        return got[0] if got else None

    udp4k, udp4k_name = anchor(anchors, r"^UDP.*sendmmsg.*4096B goodput|^udp 4096B goodput|UDP.*4096B goodput", "GB/s")
    gso4k, _ = anchor(anchors, r"UDP GSO send 4096B goodput", "GB/s")
    gsogro4k, _ = anchor(anchors, r"UDP GSO\+GRO 4096B goodput", "GB/s")
    ucx_tag_1m, _ = anchor(anchors, r"ucx tcp tag_bw 1MiB bandwidth", "GB/s")
    udp_rtt_busy, _ = anchor(anchors, r"UDP ping-pong 64B RTT median \(busy-poll\)", "us")
    udp_rtt_block, _ = anchor(anchors, r"UDP ping-pong 64B RTT median \(blocking\)", "us")
    ucx_put_1m, _ = anchor(anchors, r"ucx tcp ucp_put_bw 1MiB bandwidth", "GB/s")
    ucx_put_lat, _ = anchor(anchors, r"ucx tcp ucp_put_lat 8B one-way p50", "us")
    ucx_tag_lat, _ = anchor(anchors, r"ucx tcp tag_lat 8B one-way p50", "us")
    udp_half_busy = None if udp_rtt_busy is None else udp_rtt_busy / 2
    udp_half_block = None if udp_rtt_block is None else udp_rtt_block / 2

    out = []
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out.append("# softrdma benchmarks\n")
    out.append("Written by `scripts/bench`; every figure below comes from one run of it, the\n"
               "anchors (`../shared/anchors`) and softrdma side by side. Absolute numbers on a\n"
               "shared 2-core machine are noise; the ratios are the result.\n")
    out.append(f"- date: {now}")
    out.append(f"- command: `{command}`")
    for line in machine.splitlines():
        out.append(f"- {line.strip()}")
    out.append("")
    out.append("## Bandwidth (`softrdma perf`, RC, path MTU 4096, two processes, one per core, "
               "through the same-host rings, the default)\n")
    out.append("| test | 64 B | 4 KiB | 64 KiB | 1 MiB |")
    out.append("|---|---|---|---|---|")
    for test in ("write-bw", "read-bw", "send-bw"):
        cells = [fmt(mine(test, s, "GB/s")) for s in (64, 4096, 65536, 1048576)]
        out.append(f"| {test} (GB/s) | " + " | ".join(cells) + " |")
    out.append("")
    out.append("## Latency, 8 bytes, half round trip (`t_typical`, µs)\n")
    out.append("| test | adaptive wait | busy poll |")
    out.append("|---|---|---|")
    for test in ("send-lat", "write-lat"):
        out.append(f"| {test} | {fmt(mine(test + ' (adaptive)', 8, 'us'))} | "
                   f"{fmt(mine(test + ' (busy)', 8, 'us'))} |")
    out.append("")
    out.append("## Anchors measured in the same run\n")
    out.append("| reference | figure |")
    out.append("|---|---|")
    out.append(f"| raw UDP sendmmsg/recvmmsg goodput, 4096-byte datagrams | {fmt(udp4k)} GB/s |")
    out.append(f"| UDP GSO goodput, 4096-byte segments | {fmt(gso4k)} GB/s |")
    out.append(f"| UDP GSO+GRO goodput, 4096-byte segments | {fmt(gsogro4k)} GB/s |")
    out.append(f"| UDP 64 B half round trip, busy-poll / blocking | {fmt(udp_half_busy)} / {fmt(udp_half_block)} µs |")
    pp = load_udp_pp(sys.argv[2])
    out.append(f"| UDP busy-polled half round trip, 1 / 2 datagrams per turn in one sendmmsg "
               f"(`scripts/udp_pp.c`) | {fmt(pp.get(1))} / {fmt(pp.get(2))} µs |")
    out.append(f"| UCX tcp ucp_put_bw / tag_bw 1 MiB | {fmt(ucx_put_1m)} / {fmt(ucx_tag_1m)} GB/s |")
    out.append(f"| UCX tcp ucp_put_lat / tag_lat 8 B one way (p50) | {fmt(ucx_put_lat)} / {fmt(ucx_tag_lat)} µs |")
    out.append("")
    out.append("## Through the rdma_cm (path MTU 4096, the CM's on loopback)\n")
    out.append("The same `softrdma perf` data path, its QPs connected by the TCP exchange and by "
               "the rdma_cm (`--cm`), and connection set-up through the drop-in `librdmacm.so.1` "
               "(Debian's `cmtime -c 100`: 100 connections at once, median of the runs) beside "
               "TCP's on loopback (`scripts/tcp_conn.c`: 100 connects at once, each done when the "
               "server program's first byte arrives).\n")
    out.append("| figure | TCP exchange | rdma_cm | rdma_cm / TCP exchange |")
    out.append("|---|---|---|---|")
    for label, test, size, unit in (("write-bw 64 KiB (GB/s)", "write-bw", 65536, "GB/s"),
                                    ("send-lat 8 B busy poll (µs)", "send-lat", 8, "us")):
        plain = mine(f"{test} cmmtu", size, unit)
        cm = mine(f"{test} cmmtu cm", size, unit)
        out.append(f"| {label} | {fmt(plain)} | {fmt(cm)} | {fmt(ratio(cm, plain))} |")
    cm_connect, cm_setup, cm_runs = load_cmtime(sys.argv[2])
    tcp_rate = load_tcp_conn(sys.argv[2])
    out.append("")
    out.append("| connection set-up, 100 at once | connections/s | / TCP connect |")
    out.append("|---|---|---|")
    out.append(f"| cmtime `connect` step (REQ to ESTABLISHED), {cm_runs} runs | {fmt(cm_connect, 0)} | "
               f"{fmt(ratio(cm_connect, tcp_rate), 3)} |")
    out.append(f"| cmtime whole set-up (create id to ESTABLISHED) | {fmt(cm_setup, 0)} | "
               f"{fmt(ratio(cm_setup, tcp_rate), 3)} |")
    out.append(f"| TCP connect + accept + first byte (`scripts/tcp_conn.c`) | {fmt(tcp_rate, 0)} | 1 |")
    out.append("")
    ucx = load_ucx(sys.argv[2])
    out.append("## UCX over softrdma and over tcp (`ucx_perftest`, two processes, one per core)\n")
    out.append("softrdma: `UCX_TLS=rc_verbs,ud_verbs UCX_NET_DEVICES=softrdma0:1` through `softrdma "
               "run`; tcp: `UCX_TLS=tcp UCX_NET_DEVICES=lo`. Same run, medians.\n")
    out.append("| test | softrdma (rc_verbs) | UCX tcp | softrdma / tcp |")
    out.append("|---|---|---|---|")
    for label, test in (("ucp_put_bw 1 MiB (GB/s)", "ucp_put_bw"), ("tag_bw 1 MiB (GB/s)", "tag_bw"),
                        ("tag_lat 8 B, p50 (µs)", "tag_lat")):
        a, b = ucx.get(("softrdma", test)), ucx.get(("tcp", test))
        out.append(f"| {label} | {fmt(a)} | {fmt(b)} | {fmt(ratio(a, b))} |")
    out.append("")
    mpi = load_mpi(sys.argv[2])
    out.append("## Open MPI over softrdma and over its own shared memory (`scripts/mpi_pp.c`, two ranks, one per core)\n")
    out.append("softrdma: `mpirun -np 2 --mca pml ucx` with `UCX_TLS=rc_verbs,ud_verbs "
               "UCX_NET_DEVICES=softrdma0:1` through `softrdma run`; shared memory: `--mca pml ob1 "
               "--mca btl self,vader`. The 8-byte figure is the median half round trip of "
               "MPI_Send/MPI_Recv turns; the 1 MiB one streams 16 MPI_Isend at a time.\n")
    out.append("| figure | softrdma (pml ucx, rc_verbs) | Open MPI shared memory (vader) | softrdma / vader |")
    out.append("|---|---|---|---|")
    for label, key in (("ping-pong 8 B, half round trip (µs)", "lat8"), ("stream 1 MiB (GB/s)", "bw1m")):
        a, b = mpi.get(("softrdma", key)), mpi.get(("shm", key))
        out.append(f"| {label} | {fmt(a)} | {fmt(b)} | {fmt(ratio(a, b))} |")
    out.append("")
    # The same-host path against UDP alone and the host's own limits.
    cma = lambda size: anchor(anchors, rf"^process_vm_writev {size}$", "GB/s")[0]
    shm_pp, _ = anchor(anchors, r"^shm spin ping-pong one-way median$", "ns")
    shm_pp_us = None if shm_pp is None else shm_pp / 1000.0
    ucx_shm_lat, _ = anchor(anchors, r"^ucx cma,posix,self tag_lat 8B one-way p50$", "us")
    ucx_shm_bw, _ = anchor(anchors, r"^ucx cma,posix,self tag_bw 1MiB bandwidth$", "GB/s")
    wlat = load_write_lat(sys.argv[2])
    out.append("## Same-host path (rings) against UDP alone (`SOFTRDMA_SHM=0`)\n")
    out.append("Two processes, one per core, path MTU 4096; the reference is the host's own "
               "figure in the same run (`process_vm_writev`, the shared-memory spin ping-pong "
               "one way, UCX over its own shared memory `cma,posix`).\n")
    out.append("| figure | rings | UDP | rings / UDP | reference | rings / reference | target |")
    out.append("|---|---|---|---|---|---|---|")
    rows = [
        ("send-lat 8 B busy poll (µs)", "send-lat (busy)", 8, "us", ucx_shm_lat, "≤ 1 × UCX cma,posix tag_lat"),
        ("write-lat 8 B busy poll (µs)", "write-lat (busy)", 8, "us", ucx_shm_lat, "≤ 1 × UCX cma,posix tag_lat"),
        ("send-lat 8 B adaptive (µs)", "send-lat (adaptive)", 8, "us", None, "≤ 2 µs"),
        ("write-lat 8 B adaptive (µs)", "write-lat (adaptive)", 8, "us", None, "≤ 2 µs"),
        ("write-bw 1 MiB (GB/s)", "write-bw", 1048576, "GB/s", cma("1MiB"), "≥ 0.9 × process_vm_writev 1 MiB"),
        ("read-bw 1 MiB (GB/s)", "read-bw", 1048576, "GB/s", cma("1MiB"), "≥ 0.9 × process_vm_writev 1 MiB"),
        ("write-bw 64 KiB (GB/s)", "write-bw", 65536, "GB/s", cma("64KiB"), "≥ 0.8 × process_vm_writev 64 KiB"),
    ]
    for label, test, size, unit, ref, target in rows:
        a, b = mine(f"{test} shm1", size, unit), mine(f"{test} shm0", size, unit)
        out.append(f"| {label} | {fmt(a)} | {fmt(b)} | {fmt(ratio(a, b))} | {fmt(ref)} | "
                   f"{fmt(ratio(a, ref))} | {target} |")
    rate = lambda gbs: None if gbs is None else gbs * 1000.0 / 8  # GB/s of 8-byte messages -> Mmsg/s
    r1, r0 = rate(mine("write-bw shm1", 8, "GB/s")), rate(mine("write-bw shm0", 8, "GB/s"))
    out.append(f"| write message rate, 8 B (M/s) | {fmt(r1)} | {fmt(r0)} | {fmt(ratio(r1, r0))} | – | – | ≥ 5 M/s |")
    out.append(f"| perftest ib_write_lat 8 B through the drop-in, t_typical (µs) | {fmt(wlat)} | – | – | – | – | ≤ 1.5 µs |")
    out.append(f"| (reference) shared-memory spin ping-pong one way (µs) | – | – | – | {fmt(shm_pp_us, 3)} | – | busy send-lat ≤ 4 × |")
    out.append(f"| (reference) UCX cma,posix tag_bw 1 MiB (GB/s) | – | – | – | {fmt(ucx_shm_bw)} | – | write-bw 1 MiB ≥ 1 × |")
    out.append("")
    w1m = mine("write-bw", 1048576, "GB/s")
    lat = mine("send-lat (busy)", 8, "us")
    out.append("## Targets (ratios within this run)\n")
    out.append("| target | ratio | met |")
    out.append("|---|---|---|")
    checks = [
        ("RC WRITE 1 MiB ≥ UCX tcp ucp_put_bw 1 MiB", ratio(w1m, ucx_put_1m), lambda r: r >= 1.0),
        ("RC WRITE 1 MiB ≥ 80% of raw sendmmsg goodput (4096 B)", ratio(w1m, udp4k), lambda r: r >= 0.8),
        ("(context) RC WRITE 1 MiB / UDP GSO+GRO goodput (4096 B)", ratio(w1m, gsogro4k), lambda r: True),
        ("(context) 8 B RC SEND latency (busy poll) / UDP half round trip of 2 datagrams per turn",
         ratio(lat, pp.get(2)), lambda r: True),
        ("8 B RC SEND latency (busy poll) ≤ 1.5 × busy-polled UDP half round trip", ratio(lat, udp_half_busy), lambda r: r <= 1.5),
        ("UDP alone: 8 B RC SEND latency (busy poll) ≤ 1.3 × the UDP half round trip of 2 datagrams per turn",
         ratio(mine("send-lat (busy) shm0", 8, "us"), pp.get(2)), lambda r: r <= 1.3),
        ("same-host: 8 B SEND latency (busy poll) ≤ 4 × the shared-memory spin ping-pong one way",
         ratio(mine("send-lat (busy) shm1", 8, "us"), shm_pp_us), lambda r: r <= 4.0),
        ("UCX over softrdma tag_lat 8 B ≤ 2 × UCX over cma,posix", ratio(ucx.get(("softrdma", "tag_lat")), ucx_shm_lat),
         lambda r: r <= 2.0),
        ("UCX over softrdma tag_bw 1 MiB ≥ 0.5 × UCX over cma,posix", ratio(ucx.get(("softrdma", "tag_bw")), ucx_shm_bw),
         lambda r: r >= 0.5),
        ("Open MPI (pml ucx) over softrdma, 8 B ping-pong ≤ 2 × over vader", ratio(mpi.get(("softrdma", "lat8")), mpi.get(("shm", "lat8"))),
         lambda r: r <= 2.0),
        ("Open MPI (pml ucx) over softrdma, 1 MiB stream ≥ 0.5 × over vader", ratio(mpi.get(("softrdma", "bw1m")), mpi.get(("shm", "bw1m"))),
         lambda r: r >= 0.5),
    ]
    for name, r, ok in checks:
        met = "n/a" if r is None else ("yes" if ok(r) else "no")
        if name.startswith("(context)"):
            met = "–"
        out.append(f"| {name} | {fmt(r)} | {met} |")
    out.append("")
    print("\n".join(out))


if __name__ == "__main__":
    main()
