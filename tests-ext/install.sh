#!/bin/sh
# Installs the external validators used by crates/wire/tests/external.rs:
# tshark (Wireshark's dissector) and scapy (scapy.contrib.roce).
# Idempotent and non-interactive; for Debian 12 as root.
set -eu
export DEBIAN_FRONTEND=noninteractive
if ! command -v tshark >/dev/null 2>&1 || ! command -v python3 >/dev/null 2>&1; then
    echo "wireshark-common wireshark-common/install-setuid boolean false" | debconf-set-selections
    apt-get update
    apt-get install -y --no-install-recommends tshark python3 python3-pip
fi
if ! python3 -c 'import scapy.contrib.roce' >/dev/null 2>&1; then
    if ! python3 -m pip --version >/dev/null 2>&1; then
        apt-get update
        apt-get install -y --no-install-recommends python3-pip
    fi
    # scapy from pip (tested with 2.8.0, whose scapy.contrib.roce computes IPv4 and IPv6 ICRCs); Debian 12 marks
    # the system python as externally managed (PEP 668).
    python3 -m pip install "scapy==2.8.0" || python3 -m pip install --break-system-packages "scapy==2.8.0"
fi
tshark --version | head -n 1
python3 -c 'import scapy; print("scapy", scapy.__version__)'
# Optional, for the fuzz target in fuzz/ (not needed by the tests):
#   cargo install cargo-fuzz --locked
#   cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run parse_packet -- -max_total_time=30
#   cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run engine -- -max_total_time=300
