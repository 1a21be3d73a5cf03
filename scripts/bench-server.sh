# Sourced by the benchmark scripts: start_bench_server AGENT MODEL PORT THREADS LOG starts
# `peregrine-agent serve` in the background as the bench scripts run it, sets $server to its pid and
# returns once /ready answers (or after 2 minutes).
start_bench_server() {
    "$1" serve --model "$2" --served-model-name smollm2 --host 127.0.0.1 --port "$3" \
        --threads "$4" --max-num-seqs 32 >"$5" 2>&1 &
    server=$!
    for _ in $(seq 1 600); do
        curl -fs "http://127.0.0.1:$3/ready" >/dev/null 2>&1 && return 0
        sleep 0.2
    done
}
