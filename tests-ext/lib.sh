# tests-ext/lib.sh: what the drop-in test scripts (ibverbs, rdmacm, middleware, rdmacore)
# share: PASS/FAIL bookkeeping, installing Debian packages, building the drop-ins.
# Source it after setting REPO, OUT and LOG_TAG. (tests-ext/rxe has its own lib.sh.)

pass=0 fail=0
failed_names=()
log() { printf '[%s %(%H:%M:%S)T] %s\n' "$LOG_TAG" -1 "$*" >&2; }
result() { # name rc detail
  if [ "$2" = 0 ]; then
    echo "PASS: $1"; pass=$((pass + 1))
  else
    echo "FAIL: $1 ($3)"; fail=$((fail + 1)); failed_names+=("$1")
  fi
}
# Print the summary and exit: 0 when something passed and nothing failed.
finish() {
  echo "artifacts: $OUT"
  if [ "$fail" != 0 ]; then
    echo "failed:"; printf '  %s\n' "${failed_names[@]}"
  fi
  echo "$pass passed, $fail failed"
  [ "$fail" = 0 ] && [ "$pass" -gt 0 ]
  exit $?
}
want() { [ -z "${ONLY:-}" ] || [[ "$1" =~ $ONLY ]]; }
skip() { echo "SKIP: $1 ($2)"; } # name reason
# A check's name as a file name (a script may number them with its own).
slug() { printf '%s' "$1" | tr -c 'A-Za-z0-9_.-' '_' | cut -c1-80; }
# Whether an rdma_cm listener on PORT is recorded in the registry directory REG (any port
# space). A record counts only while its owner holds its lock: a server killed on that port
# before (a run again) leaves its record until the next bind sweeps it, and a client let go
# on that record would connect before the new server listens.
cm_listening() { # REG PORT
  local f
  for f in "$1"/*-"$2"-*.bind; do
    grep -qs '^listening 1$' "$f" && ! flock -n -s "$f" true 2>/dev/null && return 0
  done
  return 1
}

# apt-get install the packages named in the array need_pkgs (as root, unless
# SKIP_INSTALL); the outcome is a result. Returns non-zero when they are still missing.
install_needed() {
  [ "${#need_pkgs[@]}" -gt 0 ] || return 0
  if [ "$(id -u)" = 0 ] && [ -z "${SKIP_INSTALL:-}" ] && command -v apt-get >/dev/null 2>&1; then
    log "installing ${need_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    { timeout 600 apt-get update && timeout 900 apt-get install -y --no-install-recommends "${need_pkgs[@]}"; } \
      > "$OUT/install.log" 2>&1
    local rc=$?
    result "install ${need_pkgs[*]}" $rc "apt-get failed, see $OUT/install.log"
    return $rc
  fi
  result "packages present" 1 "missing ${need_pkgs[*]}: apt-get install ${need_pkgs[*]}"
  return 1
}

# cargo's target directory for REPO.
cargo_target_dir() {
  local t
  t=$(timeout 120 cargo metadata --format-version 1 --no-deps --manifest-path "$REPO/Cargo.toml" 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null)
  echo "${t:-$REPO/target}"
}

# The packages `softrdma run` needs: the drop-in and the provider stand-ins (every
# workspace package under crates/ibverbs*) and the softrdma command, as cargo -p options.
dropin_pkgs() {
  local p
  p=$(timeout 120 cargo metadata --format-version 1 --no-deps --manifest-path "$REPO/Cargo.toml" 2>/dev/null |
    python3 -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    if "/crates/ibverbs" in p["manifest_path"] or p["name"] == "softrdma-cli":
        print("-p", p["name"])' 2>/dev/null | tr '\n' ' ')
  echo "${p:--p softrdma-ibverbs -p softrdma-stub-mlx5 -p softrdma-stub-efa -p softrdma-stub-mlx4 -p softrdma-stub-mana -p softrdma-cli}"
}

# Build them (release) unless SKIP_BUILD=1, recording the build as a result, and set
# TARGET and SOFTRDMA (the softrdma command: $SOFTRDMA_BIN, else the one just built).
# Returns non-zero, after a FAIL, when there is no softrdma to run.
build_dropins() {
  local pkgs
  TARGET=$(cargo_target_dir)
  if [ -z "${SKIP_BUILD:-}" ]; then
    pkgs=$(dropin_pkgs)
    log "cargo build --release $pkgs"
    # shellcheck disable=SC2086
    (cd "$REPO" && timeout 1800 cargo build --release $pkgs) > "$OUT/build.log" 2>&1
    result "cargo build --release $pkgs" $? "see $OUT/build.log"
  fi
  SOFTRDMA=${SOFTRDMA_BIN:-$TARGET/release/softrdma}
  if [ ! -x "$SOFTRDMA" ]; then
    result "softrdma binary" 1 "$SOFTRDMA not built"
    return 1
  fi
}
