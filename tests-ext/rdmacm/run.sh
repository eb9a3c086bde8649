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
#             and what the two libraries return is the same.
#
# Prints PASS/FAIL per check and "N passed, M failed"; exits 1 on any failure. Logs in
# $OUT. For CI as root on Debian 12: installs librdmacm-dev, rdmacm-utils, libibverbs-dev,
# gcc and binutils with apt when missing.
#
# Env:
#   OUT           artifacts directory (default /tmp/softrdma-rdmacm)
#   SKIP_BUILD=1  use the libraries and softrdma already built in the target directory
#   SKIP_INSTALL=1  never run apt-get
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${OUT:-/tmp/softrdma-rdmacm}
T=60 # seconds for one program

pass=0 fail=0
failed_names=()
log() { printf '[rdmacm %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
result() { # name rc detail
  if [ "$2" = 0 ]; then
    echo "PASS: $1"; pass=$((pass + 1))
  else
    echo "FAIL: $1 ($3)"; fail=$((fail + 1)); failed_names+=("$1")
  fi
}
finish() {
  echo "artifacts: $OUT"
  if [ "$fail" != 0 ]; then
    echo "failed:"; printf '  %s\n' "${failed_names[@]}"
  fi
  echo "$pass passed, $fail failed"
  [ "$fail" = 0 ] && [ "$pass" -gt 0 ]
  exit $?
}
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
[ -f /usr/include/infiniband/verbs.h ] || need_pkgs+=(libibverbs-dev)
command -v gcc >/dev/null 2>&1 || need_pkgs+=(gcc)
command -v nm >/dev/null 2>&1 || need_pkgs+=(binutils)
if [ "${#need_pkgs[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && [ -z "${SKIP_INSTALL:-}" ] && command -v apt-get >/dev/null 2>&1; then
    log "installing ${need_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    { timeout 600 apt-get update && timeout 900 apt-get install -y --no-install-recommends "${need_pkgs[@]}"; } \
      > "$OUT/install.log" 2>&1
    result "install ${need_pkgs[*]}" $? "apt-get failed, see $OUT/install.log"
  else
    result "packages present" 1 "missing ${need_pkgs[*]}: apt-get install librdmacm-dev rdmacm-utils libibverbs-dev gcc binutils"
  fi
fi
DEB_RDMACM=$(ls /usr/lib/*-linux-gnu/librdmacm.so.1 2>/dev/null | head -n 1)

# --- build ---------------------------------------------------------------------------------
cd "$REPO" || exit 1
TARGET=$(timeout 120 cargo metadata --format-version 1 --no-deps 2>/dev/null |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null)
TARGET=${TARGET:-$REPO/target}
if [ -z "${SKIP_BUILD:-}" ]; then
  log "cargo build --release -p softrdma-ibverbs -p softrdma-cli"
  timeout 1800 cargo build --release -p softrdma-ibverbs -p softrdma-cli > "$OUT/build.log" 2>&1
  result "cargo build --release -p softrdma-ibverbs -p softrdma-cli" $? "see $OUT/build.log"
fi
SOFTRDMA=${SOFTRDMA_BIN:-$TARGET/release/softrdma}
if [ ! -x "$SOFTRDMA" ]; then
  result "softrdma binary" 1 "$SOFTRDMA not built"
  finish
fi
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
if [ ! -x "$RT" ]; then
  finish
fi
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
group deaddev SOFTRDMA_ADDR=192.0.2.1      # TEST-NET-1: not this host's, cannot bind
base="$OUT/rdmacm_test.softrdma"
ours -t softrdma > "$base.log" 2> "$base.stderr.log"
rc=$?
fold "rdmacm_test softrdma" "$base.log"
[ "$rc" = 0 ] && [ "$FOLDED" -gt 0 ]
result "rdmacm_test softrdma exits 0" $? "exit $rc; $(tail -n 2 "$base.stderr.log" | tr '\n' ' ')"

finish
