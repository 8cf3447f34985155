#!/usr/bin/env bash
# Start `slipstream serve`, wait until it is healthy, run `slipstream bench serve` against it,
# save the server's final /metrics and log, then stop it with SIGTERM (it drains and exits).
#
# H200 (Llama-3-8B shape, random weights, 2,000 requests per rate):
#   bash benchmarks/serving/run_server_bench.sh
# CPU smoke check with any small model:
#   MODEL=path/to/folder SERVE_ARGS="--dtype float32" NUM=8 RATES=inf MAX_IN=64 MAX_OUT=16 \
#     LABEL=smoke OUT=/tmp/serve-smoke bash benchmarks/serving/run_server_bench.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
MODEL=${MODEL:-llama-3-8b}
# --max-queued-requests: room for every request of a burst (`inf`) at once; the
# default (1,024 beyond --max-num-seqs) answers 503 to the rest, by design.
SERVE_ARGS=${SERVE_ARGS:---load-format dummy --dtype bfloat16 --max-num-seqs 256 --max-queued-requests 4096}
PORT=${PORT:-8000}
NUM=${NUM:-2000}
RATES=${RATES:-16,inf}
MAX_IN=${MAX_IN:-1024}
MAX_OUT=${MAX_OUT:-512}
WARMUP=${WARMUP:-64}
SLO=${SLO:---slo-ttft-ms 1000 --slo-tpot-ms 100}
OUT=${OUT:-benchmarks/serving/results}
LABEL=${LABEL:-h200-llama-3-8b-dummy}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# shellcheck disable=SC2086
$PYTHON -m slipstream.cli serve --model "$MODEL" $SERVE_ARGS --host 127.0.0.1 --port "$PORT" \
    --log-level warning > "$OUT/$LABEL.server.log" 2>&1 &
SERVER=$!
stop_server() {
    if kill -0 "$SERVER" 2>/dev/null; then
        kill -TERM "$SERVER"
        wait "$SERVER" || echo "server exited with status $?"
    fi
}
trap stop_server EXIT

$PYTHON - "$PORT" "$SERVER" <<'PY'
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.time() + 600
while time.time() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the server exited before it was ready (see its log)")
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        sys.exit(0)
    except OSError:
        time.sleep(1)
sys.exit("the server did not become healthy in 600 s")
PY
echo "server ready: $(grep -m1 "^loaded" "$OUT/$LABEL.server.log")"

status=0
# shellcheck disable=SC2086
$PYTHON -m slipstream.cli bench serve --base-url "http://127.0.0.1:$PORT" --num-requests "$NUM" \
    --request-rate "$RATES" --max-input-len "$MAX_IN" --max-output-len "$MAX_OUT" --warmup "$WARMUP" $SLO \
    --out "$OUT" --label "$LABEL" || status=$?
$PYTHON -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" \
    > "$OUT/$LABEL.metrics.txt"
grep -E '^slipstream_(requests_total|kv_cache_free_blocks|kv_cache_blocks|engine_step_errors) ' \
    "$OUT/$LABEL.metrics.txt" || true
grep -E '^slipstream_requests_total' "$OUT/$LABEL.metrics.txt" || true
stop_server
trap - EXIT
cat "$OUT/$LABEL.md"
exit $status
