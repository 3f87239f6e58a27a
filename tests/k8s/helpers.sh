# Sourced by tests/k8s/e2e and chart-pods: a free port on 127.0.0.1, and waiting for a
# condition (the logs in the current directory shown when it never comes). The caller
# defines say.
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_for() {   # wait_for WHAT SECONDS COMMAND...
    local what=$1 n=$(( $2 * 5 )); shift 2
    while [ $n -gt 0 ]; do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; n=$((n - 1)); done
    say "timed out waiting for $what"; for f in ./*.log; do echo "== $f"; tail -n 20 "$f"; done; exit 1
}
