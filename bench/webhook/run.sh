#!/usr/bin/env bash
# Load benchmark of memguard-webhook: the release binary over TLS on loopback, keep-alive,
# a realistic AdmissionReview (bench/webhook/admission-review.json: the single-GPU LoRA fixture
# as the API server sends it, defaults and service-account volume included).
#
#   1. throughput: as fast as possible for $DURATION with $CONNS keep-alive connections;
#   2. latency: a fixed 1,000 requests/s for $DURATION (oha -q, with latency correction, so
#      coordinated omission does not hide queueing).
#
# Needs `oha` (cargo install oha --locked) and openssl. BUILD=0 skips the release build.
# PIN=1 runs the webhook on CPU 1 and the generator on CPU 0 (taskset), so the generator does not
# steal the webhook's time slices: what a webhook with its own CPU sees in a cluster.
# `-w` waits for the requests in flight at the deadline, so none is counted as aborted. Results: $OUT_DIR/*.json and a summary.
set -euo pipefail
cd "$(dirname "$0")/../.."

OHA=${OHA:-oha}
DURATION=${DURATION:-30s}
CONNS=${CONNS:-16}
RATE=${RATE:-1000}
PORT=${PORT:-18443}
METRICS_PORT=${METRICS_PORT:-19090}
OUT_DIR=${OUT_DIR:-target/bench-webhook}
BODY=bench/webhook/admission-review.json

command -v "$OHA" >/dev/null || { echo "oha not found: cargo install oha --locked" >&2; exit 1; }
[ "${BUILD:-1}" = 0 ] || cargo build --release -p memguard-webhook >&2
mkdir -p "$OUT_DIR"
tmp=$(mktemp -d)
# A CA and a serving certificate signed by it (webpki refuses a CA certificate as the leaf).
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 \
  -subj "/CN=memguard bench CA" -keyout "$tmp/ca.key" -out "$tmp/ca.crt" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -subj /CN=localhost -keyout "$tmp/tls.key" -out "$tmp/tls.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n' >"$tmp/ext"
openssl x509 -req -in "$tmp/tls.csr" -CA "$tmp/ca.crt" -CAkey "$tmp/ca.key" -CAcreateserial \
  -days 1 -extfile "$tmp/ext" -out "$tmp/tls.crt" 2>/dev/null

if [ "${PIN:-0}" = 1 ]; then
  server_cpu=(taskset -c 1)
  client_cpu=(taskset -c 0)
else
  server_cpu=()
  client_cpu=()
fi

RUST_LOG=${RUST_LOG:-info} "${server_cpu[@]}" target/release/memguard-webhook --no-kube \
  --listen "127.0.0.1:$PORT" --metrics-listen "127.0.0.1:$METRICS_PORT" \
  --tls-cert-file "$tmp/tls.crt" --tls-key-file "$tmp/tls.key" >"$tmp/webhook.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$tmp"' EXIT
for _ in $(seq 100); do
  curl -sf --cacert "$tmp/ca.crt" "https://localhost:$PORT/healthz" >/dev/null && break
  sleep 0.1
done

common=(--no-tui --output-format json -w -m POST -T application/json -D "$BODY"
        --cacert "$tmp/ca.crt" "https://localhost:$PORT/mutate")

echo "== throughput: $CONNS connections, $DURATION" >&2
"${client_cpu[@]}" "$OHA" -z "$DURATION" -c "$CONNS" "${common[@]}" >"$OUT_DIR/throughput.json"
echo "== latency: fixed $RATE req/s, $DURATION" >&2
"${client_cpu[@]}" "$OHA" -z "$DURATION" -q "$RATE" --latency-correction -c 8 "${common[@]}" >"$OUT_DIR/fixed-rate.json"
curl -sf "http://127.0.0.1:$METRICS_PORT/metrics" >"$OUT_DIR/metrics.txt"

python3 - "$OUT_DIR" <<'PY'
import json, sys
out = sys.argv[1]
for name in ["throughput", "fixed-rate"]:
    r = json.load(open(f"{out}/{name}.json"))
    s, p = r["summary"], r.get("latencyPercentiles", {})
    codes = r.get("statusCodeDistribution", {})
    errors = r.get("errorDistribution", {})
    ok = codes.get("200", 0)
    bad = sum(v for k, v in codes.items() if k != "200") + sum(errors.values())
    ms = lambda x: f"{x * 1000:.3f} ms" if x is not None else "n/a"
    print(f"{name:11} {s['requestsPerSec']:9.0f} req/s  ok={ok} errors={bad}  "
          f"p50={ms(p.get('p50'))} p99={ms(p.get('p99'))} p99.9={ms(p.get('p99.9'))} "
          f"max={ms(s.get('slowest'))}")
for line in open(f"{out}/metrics.txt"):
    if line.startswith("memguard_webhook_admission_requests_total"):
        print(line.strip())
PY
