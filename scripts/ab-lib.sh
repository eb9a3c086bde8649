# shellcheck shell=bash
# scripts/ab-lib.sh: what scripts/bench-ab and scripts/perf-ab share. Source it after
# setting AB (the script's name, for messages).

# Parse NAME=PATH arguments into BIN[NAME] (an absolute path) and NAMES (in order); exits 2
# on fewer than two, a malformed or repeated name, or a path that is not an executable.
declare -A BIN
NAMES=()
ab_builds() {
  local a n p
  if [ $# -lt 2 ]; then
    echo "usage: scripts/$AB NAME=PATH NAME=PATH [...]  (at least two builds)" >&2
    exit 2
  fi
  for a in "$@"; do
    n=${a%%=*} p=${a#*=}
    if [ "$n" = "$a" ] || [ -z "$n" ] || ! [[ "$n" =~ ^[A-Za-z0-9_.-]+$ ]]; then
      echo "$AB: '$a' is not NAME=PATH (NAME of letters, digits, . _ -)" >&2
      exit 2
    fi
    if [ ! -x "$p" ]; then
      echo "$AB: $p (build $n) is not an executable" >&2
      exit 2
    fi
    if [ -n "${BIN[$n]:-}" ]; then
      echo "$AB: build name $n given twice" >&2
      exit 2
    fi
    BIN[$n]=$(cd "$(dirname "$p")" && pwd)/$(basename "$p")
    NAMES+=("$n")
  done
}

# The builds' order in round $1 (into ORDER): as given in odd rounds, reversed in even ones.
ab_order() {
  local i
  ORDER=("${NAMES[@]}")
  if [ $(($1 % 2)) = 0 ]; then
    ORDER=()
    for ((i = ${#NAMES[@]} - 1; i >= 0; i--)); do ORDER+=("${NAMES[$i]}"); done
  fi
}

# The median of the numeric words given ("-" when there is none); an even count gives
# the mean of the middle two.
median() {
  printf '%s\n' "$@" | grep -E '^[0-9.]+$' | sort -g | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2); else print "-" }'
}
