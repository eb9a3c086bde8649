#!/usr/bin/env python3
"""Decode RoCEv2 frames with scapy.contrib.roce for crates/wire/tests/external.rs.

stdin: one IPv4/IPv6 frame per line, hex. stdout: one line per frame,
space-separated key=value pairs (values are decimal integers or hex strings).
scapy computes the ICRC itself (BTH.compute_icrc); the stored one is reported too.
"""
import sys
import logging

logging.getLogger("scapy").setLevel(logging.ERROR)
from scapy.layers.inet import IP, UDP  # noqa: E402
from scapy.layers.inet6 import IPv6  # noqa: E402
from scapy.compat import raw  # noqa: E402
from scapy.contrib.roce import BTH, AETH  # noqa: E402


def main():
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        b = bytes.fromhex(line)
        pkt = IP(b) if b[0] >> 4 == 4 else IPv6(b)
        out = []
        if BTH not in pkt:
            print("error=no_bth")
            continue
        bth = pkt[BTH]
        for f in ("opcode", "solicited", "migreq", "padcount", "version", "pkey",
                  "fecn", "becn", "dqpn", "ackreq", "psn"):
            out.append("%s=%d" % (f, int(getattr(bth, f))))
        udp = pkt[UDP]
        out.append("sport=%d dport=%d" % (udp.sport, udp.dport))
        if AETH in pkt:
            out.append("aeth_syndrome=%d aeth_msn=%d" % (pkt[AETH].syndrome, pkt[AETH].msn))
        out.append("rest=%s" % (raw(bth.payload).hex() or "-"))
        out.append("icrc_stored=%s" % b[-4:].hex())
        out.append("icrc_scapy=%s" % bth.compute_icrc(None).hex())
        print(" ".join(out))


if __name__ == "__main__":
    main()
