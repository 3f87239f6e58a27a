# Guest side of paths-e2e (busybox sh), in /host. Env: NQN, PORT_A (the discovery
# part), POD_NQN, CSI_HOSTNQN, CONTROLLER (the CSI part). The engines are at 10.0.2.2;
# the host side carries out each fault the guest asks for and writes the ports the
# guest's paths must end on (/host/expected-ports).
T=10.0.2.2
DISCOVERY_NQN=nqn.2014-08.org.nvmexpress.discovery

# The controllers (nvmeN) of subsystem $1, in any state.
controllers_of() {
    for c in /sys/class/nvme/nvme*; do
        [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$1" ] && echo "${c##*/}"
    done
}
port_of_ctrl() { sed -n 's/.*trsvcid=\([0-9]*\).*/\1/p' "/sys/class/nvme/$1/address"; }
# The ports of the volume's controllers, sorted, in any state.
ports_now() { for c in $(controllers_of "$NQN"); do port_of_ctrl $c; done | sort | tr '\n' ' '; }
live_paths() {
    n=0
    for c in $(controllers_of "$NQN"); do [ "$(cat /sys/class/nvme/$c/state)" = live ] && n=$((n + 1)); done
    echo $n
}
optimized_paths() {
    n=0
    for c in $(controllers_of "$NQN"); do
        for p in /sys/class/nvme/$c/nvme*c*n1; do
            [ -e "$p/ana_state" ] && grep -q '^optimized' "$p/ana_state" && n=$((n + 1))
        done
    done
    echo $n
}
show() {
    for c in $(controllers_of "$NQN") $(controllers_of $DISCOVERY_NQN); do
        ana=$(cat /sys/class/nvme/$c/nvme*c*n1/ana_state 2>/dev/null | head -1)
        echo "  $c $(cat /sys/class/nvme/$c/subsysnqn | sed 's/.*://') port $(port_of_ctrl $c)" \
             "$(cat /sys/class/nvme/$c/state) ${ana:-}"
    done
}
# Exactly the expected paths, all live, one optimized.
settled() {
    [ "$(ports_now)" = "$(cat /host/expected-ports)" ] && [ "$(live_paths)" = 3 ] && [ "$(optimized_paths)" = 1 ]
}
uptime_ms() { awk '{printf "%d", $1 * 1000}' /proc/uptime; }
fault() {   # fault NAME WHAT: the host carries it out; then the paths must settle
    kill -0 $FIO 2>/dev/null || fail "fio finished before the fault $1: make its job longer"
    t0=$(uptime_ms)
    touch /host/req-$1
    wait_for 120 test -f /host/done-$1 || fail "the host did not carry out $1"
    echo "expected ports after $1: $(cat /host/expected-ports)"
    wait_for 60 settled || { show; cat /tmp/events.log; fail "after $2 the paths did not settle on $(cat /host/expected-ports)"; }
    echo "$2: 3 live paths again (1 optimized), the old one gone, $(( $(uptime_ms) - t0 )) ms after the fault"
    show
}

step "Discovery Log Page Change events run nvpool-path-sync (busybox uevent for udev's autoconnect rule)"
cat > /tmp/on-uevent <<'EOF'
[ "$SUBSYSTEM" = nvme ] && [ "$ACTION" = change ] && [ "$NVME_AEN" = 0x70f002 ] || exit 0
echo "$(date +%T) discovery log change through ${DEVPATH##*/}" >> /tmp/events.log
NVPOOL_PATH_SYNC_LOCK=/tmp/path-sync.lock sh /host/nvpool-path-sync "${DEVPATH##*/}" >> /tmp/events.log 2>&1
EOF
uevent sh /tmp/on-uevent &
UEVENT=$!

step "the discovery log lists the volume's three access points at the host-facing address"
nvme discover -t tcp -a $T -s $PORT_A | tee discover-a.txt
[ "$(grep -c "subnqn: *$NQN\$" discover-a.txt)" = 3 ] || fail "the log through a does not list three access points"
grep -q "traddr: *127.0.0.1" discover-a.txt && fail "the log gives an address engines are bound to"
for port in $(awk '/^trsvcid:/ {print $2}' discover-a.txt | sort -u); do
    [ "$port" = $PORT_A ] && continue
    nvme discover -t tcp -a $T -s $port > discover-$port.txt 2>&1 || fail "discover through $port"
    [ "$(grep -A8 "subtype: *nvme subsystem" discover-$port.txt | awk '/^trsvcid:/ {print $2}' | sort | tr '\n' ' ')" = \
      "$(grep -A8 "subtype: *nvme subsystem" discover-a.txt | awk '/^trsvcid:/ {print $2}' | sort | tr '\n' ' ')" ] ||
        { cat discover-$port.txt; fail "the engine at $port lists other access points than a"; }
done
nvme discover -t tcp -a $T -s $PORT_A --hostnqn=nqn.2024-01.io.nvpool:stranger > discover-stranger.txt 2>&1
grep -q "$NQN" discover-stranger.txt && { cat discover-stranger.txt; fail "a host not allowed sees the volume"; }

step "connect-all --persistent through engine a: three paths, one optimized"
nvme connect-all --persistent -t tcp -a $T -s $PORT_A || fail "nvme connect-all"
wait_for 30 sh -c "[ \$(ls /sys/class/nvme | wc -l) -ge 4 ]" || fail "connect-all did not connect"
DISC=$(for c in $(controllers_of $DISCOVERY_NQN); do [ "$(port_of_ctrl $c)" = $PORT_A ] && echo $c; done | head -1)
[ -n "$DISC" ] || fail "no persistent discovery controller on a"
NVPOOL_PATH_SYNC_LOCK=/tmp/path-sync.lock sh /host/nvpool-path-sync $DISC
for c in $(controllers_of "$NQN"); do port_of_ctrl $c; done | sort | tr '\n' ' ' > /host/expected-ports
wait_for 30 settled || { show; fail "no three live paths with one optimized"; }
[ "$(controllers_of $DISCOVERY_NQN | wc -l)" = 3 ] || { show; fail "not one discovery controller per access point"; }
show
HEAD=/dev/$(ls /sys/class/nvme/$(controllers_of "$NQN" | head -1) | grep -m1 '^nvme[0-9]*c[0-9]*n1$' | sed 's/c[0-9]*n1$/n1/')
wait_for 20 test -b $HEAD || fail "no multipath block device"

step "fio writes and verifies through $HEAD while access points are lost and moved"
JOB="--name=heal --filename=$HEAD --rw=randwrite --bs=4k --ioengine=io_uring --direct=1 --size=96m
    --verify=crc32c --verify_fatal=1 --randseed=11 --eta=never"
fio_across_path_faults $JOB --iodepth=8 --rate_iops=,300 --trigger-file=$FIO_STOP --output=fio-heal.txt &
FIO=$!
sleep 4

fault kill "SIGKILL of a non-owner access point's engine"
fault migrate "the volume migrated to the node that came back"
fault drain "its new node drained"

stop_and_verify() {   # stop_and_verify NAME JOB...: ends the fio job and checks its writes
    name=$1; shift
    touch $FIO_STOP
    wait $FIO
    frc=$?
    grep -E "err=|write:" fio-$name.txt | head -3
    [ $frc = 0 ] && grep -q "err= 0" fio-$name.txt || fail "fio reported errors (rc $frc)"
    verify_written fio-$name.txt verify-$name.txt "$@"
    rm -f $FIO_STOP
}
stop_and_verify heal $JOB
dmesg | grep -iE "I/O error|failing I/O|critical" && fail "the kernel logged I/O errors"
cp /tmp/events.log /host/events.log 2>/dev/null
kill $UEVENT 2>/dev/null
nvme disconnect -n "$NQN" >/dev/null
nvme disconnect-all >/dev/null 2>&1

step "the CSI node plugin publishes volume pod as host $CSI_HOSTNQN, which no discovery log lists"
NQN=$POD_NQN
/host/nvpool csi --endpoint unix:///tmp/csi.sock --controller $CONTROLLER --node-name paths-guest \
    --host-nqn $CSI_HOSTNQN --state-dir /tmp/csi-state > /host/csi-driver.log 2>&1 &
CSI=$!
wait_for 10 test -S /tmp/csi.sock || { cat /host/csi-driver.log; fail "the CSI driver did not start"; }
/host/csi-call unix:///tmp/csi.sock publish pod /tmp/pod/device || { cat /host/csi-driver.log; fail "csi-call publish"; }
touch /host/req-csi-start
wait_for 60 test -f /host/done-csi-start || fail "the host did not write the paths of pod"
wait_for 30 settled || { show; cat /host/csi-driver.log; fail "NodeStage did not connect three paths with one optimized"; }
show
test -b /tmp/pod/device || fail "NodePublish made no block device at /tmp/pod/device"

step "fio writes and verifies through the published device while access points are lost and moved"
JOB="--name=pod --filename=/tmp/pod/device --rw=randwrite --bs=4k --ioengine=io_uring --direct=1 --size=96m
    --verify=crc32c --verify_fatal=1 --randseed=12 --eta=never"
fio_across_path_faults $JOB --iodepth=8 --rate_iops=,300 --trigger-file=$FIO_STOP --output=fio-pod.txt &
FIO=$!
sleep 4

fault csi-kill "CSI: SIGKILL of a non-owner access point's engine"
fault csi-migrate "CSI: the volume migrated to the node that came back"
fault csi-drain "CSI: its new node drained"

stop_and_verify pod $JOB
dmesg | grep -iE "I/O error|failing I/O|critical" && fail "the kernel logged I/O errors"
grep -E "connected the path|disconnected" /host/csi-driver.log | sed 's/^.*nvpool_csi[^ ]* //'
/host/csi-call unix:///tmp/csi.sock unpublish pod /tmp/pod/device || fail "csi-call unpublish"
[ -z "$(controllers_of "$NQN")" ] || { show; fail "NodeUnstage left controllers of pod"; }
kill $CSI
echo "ALL STEPS PASSED"
