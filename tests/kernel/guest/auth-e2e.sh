# Guest side of auth-e2e (busybox sh), in /host. The engine runs here, from /host/bin,
# and the kernel's nvme-tcp host connects to it on 127.0.0.1:4420.
# Env: NQN.
BIN=/host/bin
SOCK=/tmp/engine.sock
HOSTNQN=$(cat /etc/nvme/hostnqn)
# A management call that hangs fails the step instead of the whole guest's time.
cli() { timeout 120 $BIN/nvpool engine "$@" --socket $SOCK; }
conn() { nvme connect -t tcp -a 127.0.0.1 -s 4420 -n $NQN "$@"; }
mark() { echo "--- $*" > /dev/kmsg; }
since() { dmesg | sed -n "/--- $1\$/,\$p" | grep -E 'nvme' | sed 's/^\[[ 0-9.]*\] //'; }
gone() { ! ctrl_of $NQN > /dev/null; }
disconnect() { nvme disconnect -n $NQN > /dev/null || fail "nvme disconnect"; wait_for 10 gone; }
verify() {   # verify NAME: fio write then verify on the connected namespace
    C=$(ctrl_of $NQN) || fail "no live controller"
    wait_for 20 test -b /dev/${C}n1 || fail "no /dev/${C}n1"
    fio_verify $1 /dev/${C}n1
    echo "fio write+verify over the authenticated connection: no errors"
}
refused() {   # refused STEP CONNECT-ARGS...: the connect must fail
    mark $1
    if conn "$@" > /tmp/connect.txt 2>&1; then disconnect; fail "$1: connected"; fi
    sed 's/^/nvme connect: /' /tmp/connect.txt
    since $1 | tee /host/kmsg-$1.txt
}

step "the engine, and secrets from nvme gen-dhchap-key"
cat > /tmp/engine.toml <<TOML
reactors = 2
busy_poll_us = 0
management_socket = "$SOCK"
[[listener]]
address = "127.0.0.1:4420"
[[subsystem]]
nqn = "$NQN"
[[subsystem.namespace]]
nsid = 1
backend = "memory:64MiB"
TOML
start_engine /tmp/engine.toml /host/engine.log
HKEY=$(nvme gen-dhchap-key --hmac=1 --nqn=$HOSTNQN)
CKEY=$(nvme gen-dhchap-key --hmac=2 --nqn=$NQN)
WRONG=$(nvme gen-dhchap-key --hmac=1 --nqn=$HOSTNQN)
NEW=$(nvme gen-dhchap-key --hmac=3 --nqn=$HOSTNQN)
PLAIN=$(nvme gen-dhchap-key)
echo "host secret $(echo $HKEY | cut -c1-12)..., controller secret $(echo $CKEY | cut -c1-12)..., and a wrong one"
# The known answer of the unit tests (nvpool-auth secret.rs): libnvme prints the key
# 00..1f transformed with SHA-256 for the NQN.
KAT=$(nvme gen-dhchap-key --secret=000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f --hmac=1 \
    --nqn=nqn.2024-01.io.nvpool:kat)
echo "nvme gen-dhchap-key of the unit tests' key: $KAT"
[ "$KAT" = "DHHC-1:01:GC19EF3ch6/G246Ie27kuqKhuc2QkG2d3DKS/UENsCpJAD0P:" ] || fail "nvme-cli's key differs from the unit tests'"

step "unidirectional: nvme connect --dhchap-secret, fio verify"
NVPOOL_DHCHAP_SECRET=$HKEY cli host add $NQN $HOSTNQN || fail "host add with a secret"
cli subsystem list --json > /tmp/subsystems.json
grep -q DHHC /tmp/subsystems.json && fail "the listing shows a secret"
grep -A5 authenticated_hosts /tmp/subsystems.json | head -8
mark uni
conn --dhchap-secret=$HKEY -i 2 || fail "connect with the right secret"
verify uni
since uni | tee /host/kmsg-uni.txt
grep -q 'qid 0: authenticated' /host/kmsg-uni.txt || fail "the kernel did not say 'authenticated'"
echo "I/O queues authenticated: $(grep -c 'qid [1-9]: authenticated' /host/kmsg-uni.txt)"
disconnect

step "a wrong secret, and no secret, are refused"
refused wrong --dhchap-secret=$WRONG
grep -qE 'authentication failed|error' /host/kmsg-wrong.txt || fail "no authentication failure in the kernel log"
refused none
grep -c 'authentication failed' /host/engine.log
grep 'authentication failed\|without authenticating' /host/engine.log | head -4

step "bidirectional: --dhchap-ctrl-secret, fio verify; a wrong controller secret is refused by the host"
NVPOOL_DHCHAP_SECRET=$HKEY NVPOOL_DHCHAP_CTRL_SECRET=$CKEY cli host add $NQN $HOSTNQN || fail "host add bidirectional"
mark bidi
conn --dhchap-secret=$HKEY --dhchap-ctrl-secret=$CKEY || fail "bidirectional connect"
verify bidi
since bidi | tee /host/kmsg-bidi.txt
grep -q 'controller authenticated\|authenticated' /host/kmsg-bidi.txt || fail "no authentication in the kernel log"
disconnect
refused bidi-wrong --dhchap-secret=$HKEY --dhchap-ctrl-secret=$WRONG
grep -qE 'controller authentication failed|authentication failed' /host/kmsg-bidi-wrong.txt \
    || fail "the kernel did not refuse the controller"

step "the hashes and groups the engine chooses, with an untransformed secret"
# Under emulation the kernel's ffdhe6144 and 8192 exchanges take seconds per step, more
# than the default 5 s Keep Alive Timeout the engine holds the host to meanwhile. Every
# queue runs its own exchange: one I/O queue (besides the admin queue) is enough to see
# each choice authenticate both kinds, and the step costs a third less.
for choice in sha384:null sha512:ffdhe3072 sha256:ffdhe4096 sha384:ffdhe6144 sha512:ffdhe8192; do
    NVPOOL_DHCHAP_SECRET=$PLAIN NVPOOL_DHCHAP_CTRL_SECRET=$CKEY cli host add $NQN $HOSTNQN \
        --dhchap-hash ${choice%%:*} --dhchap-dhgroup ${choice#*:} > /dev/null || fail "host add $choice"
    mark $choice
    conn --dhchap-secret=$PLAIN --dhchap-ctrl-secret=$CKEY --keep-alive-tmo=60 -i 1 > /dev/null \
        || { since $choice; fail "connect with $choice"; }
    since $choice | grep -m1 'qid 0: .*authenticated' || fail "$choice: not authenticated"
    disconnect
done

step "re-authentication: a new secret for a connected host"
NVPOOL_DHCHAP_SECRET=$HKEY cli host add $NQN $HOSTNQN || fail "host add"
conn --dhchap-secret=$HKEY || fail "connect"
C=$(ctrl_of $NQN)
NVPOOL_DHCHAP_SECRET=$NEW cli host add $NQN $HOSTNQN || fail "host add with the new secret"
mark reauth
echo "$NEW" > /sys/class/nvme/$C/dhchap_secret || fail "setting the host's new secret"
reauthed() { since reauth | grep -q 'qid 0: .*authenticated'; }
wait_for 30 reauthed || { since reauth; fail "no re-authentication"; }
since reauth | tee /host/kmsg-reauth.txt
verify reauth
disconnect

step "the engine's log names hosts and addresses, and never a secret"
grep -E 'authentication failed|without authenticating' /host/engine.log | sed 's/.*WARN//' | sort | uniq -c | head -6
grep -q "$HOSTNQN" /host/engine.log && grep -q '127.0.0.1' /host/engine.log || fail "no host NQN or address in the log"
grep -q 'DHHC' /host/engine.log && fail "a secret is in the engine's log"
no_oops "during the scenarios"
echo
echo "ALL STEPS PASSED"
