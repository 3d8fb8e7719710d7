#!/usr/bin/env bash
# Sidecar benchmark on a real cgroup v1 memory controller (needs root).
#
#   bench/sidecar/run.sh [TRIALS] [IDLE_SECONDS]      (defaults: 20 trials, 30 s idle)
#
# Measures, at the default settings (--interval 100ms, events on):
#   1. reaction: a process inside a 256 MiB cgroup sits at 0.80 of the limit, then jumps to
#      0.90 in one allocation (usage crosses 0.85 about halfway through it). Reported: the
#      signal file's mtime minus the start of the jump ("written": an upper bound of the
#      reaction, as the crossing happens after the start), the time the allocating process
#      itself saw the new signal (it polls every 0.5 ms, but only after its allocation is
#      done), and the duration of the allocation.
#      Repeated with --events false (poll only) for comparison.
#   2. resident memory (VmRSS, VmHWM) and CPU (utime+stime) of the sidecar over IDLE_SECONDS.
#   3. release binary size.
# Uses target/sidecar/memguard-sidecar, the shipped build (built if missing:
# cargo build --profile sidecar -p memguard-sidecar).
set -euo pipefail

TRIALS=${1:-20}
IDLE=${2:-30}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${MEMGUARD_SIDECAR_BIN:-$ROOT/target/sidecar/memguard-sidecar}
V1=/sys/fs/cgroup/memory
LIMIT=$((256 * 1024 * 1024))

[ "$(id -u)" = 0 ] || { echo "needs root (creates a cgroup)"; exit 2; }
[ -e "$V1/memory.usage_in_bytes" ] || { echo "no cgroup v1 memory controller at $V1"; exit 2; }
[ -x "$BIN" ] || (cd "$ROOT" && cargo build --profile sidecar -p memguard-sidecar)

own=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3}' /proc/self/cgroup)
parent="$V1${own}"
[ -e "$parent/cgroup.procs" ] || parent=$V1
CG="$parent/memguard-bench-$$"
WORK=$(mktemp -d)
SIDECAR_PID=
cleanup() {
  [ -n "$SIDECAR_PID" ] && kill "$SIDECAR_PID" 2>/dev/null || true
  if [ -d "$CG" ]; then
    for p in $(cat "$CG/cgroup.procs" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    for _ in $(seq 50); do [ -z "$(cat "$CG/cgroup.procs" 2>/dev/null)" ] && break; sleep 0.1; done
    rmdir "$CG" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
mkdir "$CG"
echo "$LIMIT" > "$CG/memory.limit_in_bytes"

cat > "$WORK/jump.py" <<'EOF'
import json, os, sys, time
sig, cg, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
def ws():
    usage = int(open(cg + "/memory.usage_in_bytes").read())
    inactive = 0
    for line in open(cg + "/memory.stat"):
        k, v = line.split()
        if k == "total_inactive_file":
            inactive = int(v)
    return usage - inactive
def seq():
    try:
        with open(sig) as f:
            s = json.load(f)
        return s["seq"], s["level"]
    except Exception:
        return -1, ""
held = [b"\x01" * max(0, int(0.80 * limit) - ws())]
time.sleep(1.0)                      # the sidecar settles at warn
s0, _ = seq()
need = int(0.90 * limit) - ws()
w0 = time.time_ns()
t0 = time.monotonic_ns()
held.append(b"\x01" * need)          # one jump past 0.85
t1 = time.monotonic_ns()
while True:
    s, level = seq()
    if s > s0 and level in ("downgrade", "critical"):
        break
    if time.monotonic_ns() - t0 > 5e9:
        print("TIMEOUT"); sys.exit(1)
    time.sleep(0.0005)
t2 = time.monotonic_ns()
written = os.stat(sig).st_mtime_ns   # when the sidecar wrote the new signal (same clock as w0)
print("%.3f %.3f %.3f" % ((written - w0) / 1e6, (t2 - t0) / 1e6, (t1 - t0) / 1e6))
EOF

trial() { # $1: extra sidecar flags; prints "written_ms seen_ms alloc_ms"
  rm -f "$WORK/signal.json"
  "$BIN" --cgroup "$CG" --signal-file "$WORK/signal.json" --termination-log "$WORK/term" \
    --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --log-format text \
    --batch-size 8 $1 2>"$WORK/sidecar.log" &
  SIDECAR_PID=$!
  for _ in $(seq 100); do [ -s "$WORK/signal.json" ] && break; sleep 0.05; done
  sh -c "echo \$\$ > $CG/cgroup.procs && exec python3 $WORK/jump.py $WORK/signal.json $CG $LIMIT"
  kill "$SIDECAR_PID" 2>/dev/null || true; wait "$SIDECAR_PID" 2>/dev/null || true; SIDECAR_PID=
}

stats() { # stdin: one number per line -> "median p95 max"
  sort -n | awk '{a[NR]=$1} END {
    m = (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2
    i = int(0.95 * NR + 0.999); if (i > NR) i = NR
    printf "median %.1f ms  p95 %.1f ms  max %.1f ms  (n=%d)\n", m, a[i], a[NR], NR }'
}

echo "== reaction, default settings (interval 100ms, events on), $TRIALS trials"
: > "$WORK/events.txt"
for i in $(seq "$TRIALS"); do
  trial "" >> "$WORK/events.txt" || { echo "trial failed:"; cat "$WORK/events.txt" "$WORK/sidecar.log"; exit 1; }
  tail -1 "$WORK/events.txt" | sed "s/^/  trial $i: written_ms seen_ms alloc_ms = /"
done
echo -n "  written (jump start -> signal on disk): "; awk '{print $1}' "$WORK/events.txt" | stats
echo -n "  seen by the allocating process:         "; awk '{print $2}' "$WORK/events.txt" | stats
echo -n "  the jump allocation itself:             "; awk '{print $3}' "$WORK/events.txt" | stats

echo "== reaction, poll only (--events false), $TRIALS trials"
: > "$WORK/poll.txt"
for i in $(seq "$TRIALS"); do trial "--events false" >> "$WORK/poll.txt" || { echo "trial failed:"; cat "$WORK/poll.txt" "$WORK/sidecar.log"; exit 1; }; done
echo -n "  written (jump start -> signal on disk): "; awk '{print $1}' "$WORK/poll.txt" | stats
echo -n "  the jump allocation itself:             "; awk '{print $3}' "$WORK/poll.txt" | stats

echo "== resident memory and CPU over ${IDLE}s at the default interval (an idle trainer in the cgroup)"
sh -c "echo \$\$ > $CG/cgroup.procs && exec python3 -c 'import time; b = b\"x\" * (64 << 20); time.sleep(3600)'" &
IDLE_PID=$!
"$BIN" --cgroup "$CG" --signal-file "$WORK/signal.json" --termination-log "$WORK/term" \
  --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 2>"$WORK/sidecar.log" &
SIDECAR_PID=$!
sleep 2
ticks() { awk '{print $14 + $15}' "/proc/$SIDECAR_PID/stat"; }
hz=$(getconf CLK_TCK)
c0=$(ticks); t0=$(date +%s.%N)
sleep "$IDLE"
c1=$(ticks); t1=$(date +%s.%N)
grep -E 'VmRSS|VmHWM' "/proc/$SIDECAR_PID/status" | sed 's/^/  /'
awk -v c0="$c0" -v c1="$c1" -v t0="$t0" -v t1="$t1" -v hz="$hz" \
  'BEGIN { printf "  CPU: %.3f %% of one core (%d ticks of 1/%d s in %.1f s)\n", 100 * (c1 - c0) / hz / (t1 - t0), c1 - c0, hz, t1 - t0 }'
kill "$SIDECAR_PID" 2>/dev/null || true; wait "$SIDECAR_PID" 2>/dev/null || true; SIDECAR_PID=
kill "$IDLE_PID" 2>/dev/null || true; wait "$IDLE_PID" 2>/dev/null || true

echo "== binary"
ls -l "$BIN" | awk '{printf "  %s: %d bytes (%.2f MiB)\n", $9, $5, $5 / 1048576}'
