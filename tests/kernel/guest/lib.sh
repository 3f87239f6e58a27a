# Helpers for the guest scripts; run-guest puts them in front of every script.
step() { echo; echo "=== $*"; }
fail() { echo "FAIL: $*"; dmesg | tail -30; exit 1; }
wait_for() {   # wait_for SECONDS TEST...
    n=$(( $1 * 10 )); shift
    while [ $n -gt 0 ]; do "$@" && return 0; sleep 0.1; n=$((n - 1)); done
    return 1
}
# The live controller device (nvmeN) connected to subsystem $1.
ctrl_of() {
    for c in /sys/class/nvme/nvme*; do
        [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$1" ] && [ "$(cat "$c/state")" = live ] && { basename "$c"; return 0; }
    done
    return 1
}
