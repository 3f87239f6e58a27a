# Guest side of rdma-e2e (busybox sh), in /host. The engine runs here, from /host/bin,
# on a soft-RoCE device (rdma_rxe) over a dummy interface: this machine's kernel has
# no RDMA, and the guest's user-mode network carries no RDMA either.
# Env: NQN.
BIN=/host/bin
SOCK=/tmp/engine.sock
IP=$RDMA_IP
HOSTNQN=$(cat /etc/nvme/hostnqn)
cli() { timeout 120 $BIN/nvpool engine "$@" --socket $SOCK; }
errors_in() { grep -o 'err= *[0-9]*' "$1" | grep -v 'err= *0$'; }
checked() {   # checked FIO_OUTPUT JOBS: every job ended with no error
    [ "$(grep -c 'err= 0' $1)" = "$2" ] && ! errors_in $1 || { cat $1; fail "fio reported errors in $1"; }
}
# The namespace's block device once a controller of $NQN is live.
device() { for c in /sys/class/nvme/nvme*; do
    [ "$(cat $c/subsysnqn 2>/dev/null)" = "$NQN" ] || continue
    for d in /dev/nvme*n1; do [ -b "$d" ] && { echo $d; return 0; }; done
done; return 1; }
# The live controllers of $NQN and their transports, e.g. "nvme0:rdma nvme1:tcp".
controllers() { for c in /sys/class/nvme/nvme*; do
    [ "$(cat $c/subsysnqn 2>/dev/null)" = "$NQN" ] && [ "$(cat $c/state)" = live ] && printf '%s:%s ' "${c##*/}" "$(cat $c/transport)"
done; }
no_device() { ! device > /dev/null; }
paths() { controllers | wc -w; }
has_rdma_path() { controllers | grep -q rdma; }
no_rdma_path() { ! has_rdma_path; }
two_paths() { [ "$(paths)" = 2 ]; }
# Fails if the host timed a command out or reset a controller since the last call: a
# lost completion is recovered that way, and fio would not see it.
no_recovery() {   # no_recovery WHEN
    dmesg > /tmp/dmesg.now
    tail -n +$(( $(cat /tmp/dmesg.seen 2>/dev/null || echo 0) + 1 )) /tmp/dmesg.now \
        | grep -E 'nvme.*(timeout|resetting|Reconnecting|reconnect|I/O Cmd)' && fail "the host recovered from a lost command $1"
    wc -l < /tmp/dmesg.now > /tmp/dmesg.seen
    return 0
}
connect() {   # connect TRANSPORT PORT [nvme connect options]
    t=$1; p=$2; shift 2
    timeout 60 nvme connect -t $t -a $IP -s $p -n $NQN "$@" > /tmp/connect.txt 2>&1 || { cat /tmp/connect.txt; tail -20 /host/engine.log; fail "nvme connect -t $t"; }
}

step "soft-RoCE on dummy0 ($IP)"
soft_roce
rdma link show
uname -r

step "an engine listening on NVMe/TCP and NVMe over RDMA, one subsystem on a RAM disk"
# One RAM disk for the engine and, later, the kernel's target: the same device.
rdma_engine_config /tmp/engine.toml $NQN 0
start_engine /tmp/engine.toml /host/engine.log
cli listener list | tee /tmp/listeners.txt
grep -q 'rdma *192.168.77.1 *4420' /tmp/listeners.txt || fail "no RDMA listener in the list"

step "nvme discover -t rdma: both transports, RDMA with its address subtype"
timeout 60 nvme discover -t rdma -a $IP -s 4420 > /host/discover.txt 2>&1 || { cat /host/discover.txt; fail "discover"; }
cat /host/discover.txt
[ "$(grep -c 'subnqn: *'$NQN /host/discover.txt)" = 2 ] || fail "the subsystem is not listed once per transport"
grep -q 'trtype: *rdma' /host/discover.txt && grep -q 'trtype: *tcp' /host/discover.txt || fail "a transport is missing"
grep -q 'rdma_cms: *rdma-cm' /host/discover.txt && grep -q 'rdma_qptype: *connected' /host/discover.txt \
    || fail "the RDMA entry does not say how to reach it"

step "nvme connect -t rdma with 4 I/O queues (2 default, 2 write)"
connect rdma 4420 -i 2 -W 2
wait_for 10 device > /dev/null || fail "no namespace device"
DEV=$(device)
echo "controllers: $(controllers); device $DEV"
dmesg | grep -E 'nvme_rdma|nvme nvme[0-9]+: (mapped|creating)' | tail -3
dmesg | grep -qE 'mapped 2/0/0 default/read/poll|creating 4 I/O queues' || fail "the host did not make 4 I/O queues"
[ "$(controllers)" = "nvme0:rdma " ] || fail "not one RDMA controller: $(controllers)"

step "fio write then verify (crc32c), mixed block sizes, depth 1 and 16"
fio --direct=1 --ioengine=io_uring --rw=randwrite --verify=crc32c --verify_fatal=1 --randseed=11 \
    --name=qd1 --filename=$DEV --iodepth=1 --bssplit=512/10:4k/40:16k/25:64k/25 --offset=0 --size=16M \
    --name=qd16 --filename=$DEV --iodepth=16 --bssplit=4k/40:32k/20:128k/30:512k/10 --offset=16M --size=48M \
    --output=/host/fio-verify.txt || { cat /host/fio-verify.txt; fail "fio"; }
checked /host/fio-verify.txt 2
grep -E "^ *(write|read):" /host/fio-verify.txt
no_recovery "during fio"

step "ext4 across a reconnect"
mkfs.ext4 -q -F $DEV || fail "mkfs.ext4"
mkdir -p /mnt/v && mount $DEV /mnt/v || fail "mount"
for i in 1 2 3 4 5 6 7 8; do head -c $((i * 300000)) /dev/urandom > /mnt/v/file$i; done
(cd /mnt/v && sha256sum file*) > /tmp/sums.txt
umount /mnt/v
nvme disconnect -n $NQN > /dev/null || fail "disconnect"
wait_for 10 no_device || fail "the device stayed after disconnect"
connect rdma 4420
wait_for 10 device > /dev/null || fail "no namespace device after reconnecting"
DEV=$(device)
mount $DEV /mnt/v || fail "mount after reconnecting"
(cd /mnt/v && sha256sum -c /tmp/sums.txt) || fail "files changed across the reconnect"
umount /mnt/v
no_recovery "during the ext4 round trip"
echo "8 files read back intact after the reconnect"

step "the same subsystem over NVMe/TCP and RDMA: two paths of one device"
connect tcp 4420
wait_for 10 two_paths || fail "the TCP path did not join: $(controllers)"
echo "controllers: $(controllers)"
[ "$(ls /dev/nvme*n1 | wc -l)" = 1 ] || fail "two devices instead of one multipath device: $(ls /dev/nvme*n*)"
DEV=$(device)
grep -H . /sys/block/nvme*c*n1/ana_state || fail "no ANA state for the paths"
no_recovery "joining the TCP path"
# A cap on the writes' rate keeps them going across the listener's removal and return;
# they stop once the host is back on RDMA, and every write that completed is read back.
PATHS_JOB="--name=paths --filename=$DEV --rw=randwrite --bs=4k --ioengine=io_uring --direct=1 --size=48M
    --verify=crc32c --verify_fatal=1 --randseed=5 --eta=never"
fio_across_path_faults $PATHS_JOB --iodepth=8 --rate_iops=,400 --trigger-file=$FIO_STOP --output=/host/fio-paths.txt &
FIO=$!
sleep 4
cli listener remove rdma:$IP:4420 || fail "remove the RDMA listener"
echo "RDMA listener removed under fio: I/O goes on over TCP"
wait_for 20 no_rdma_path || fail "the RDMA path stayed live"
kill -0 $FIO 2>/dev/null || fail "fio finished before the RDMA path came back: make its job longer"
sleep 3
cli listener add rdma:$IP:4420 || fail "add the RDMA listener back"
wait_for 60 has_rdma_path || fail "the host did not reconnect over RDMA"
echo "the host is back on RDMA: $(controllers)"
kill -0 $FIO 2>/dev/null || fail "fio finished before the RDMA path came back: make its job longer"
sleep 2
touch $FIO_STOP
wait $FIO || { cat /host/fio-paths.txt; fail "fio across the path changes"; }
checked /host/fio-paths.txt 1
grep -E "^ *write:" /host/fio-paths.txt
verify_written /host/fio-paths.txt /host/fio-paths-verify.txt $PATHS_JOB
# The RDMA controller reconnects here, as it must; no command may time out.
dmesg > /tmp/dmesg.now
tail -n +$(( $(cat /tmp/dmesg.seen) + 1 )) /tmp/dmesg.now | grep -E 'nvme.*timeout' && fail "a command timed out while the paths changed"
wc -l < /tmp/dmesg.now > /tmp/dmesg.seen
nvme disconnect -n $NQN > /dev/null

step "through the controller: the node registers its RDMA address, and attach gives the host an RDMA path"
truncate -s 256M /tmp/pool.img
cli pool create g /tmp/pool.img || fail "pool create"
$BIN/nvpool controller --store redb:/tmp/controller.redb > /host/controller.log 2>&1 &
CONTROLLER=$!
# Hosts use RDMA; no peer address given: the agent gives other engines the engine's TCP
# listener.
$BIN/nvpool agent --name g1 --engine-socket $SOCK --nvme-address rdma:$IP:4420 > /host/agent.log 2>&1 &
AGENT=$!
wait_for 60 sh -c "$BIN/nvpool node list --json 2>/dev/null | grep -q '\"healthy\": true'" \
    || { cat /host/agent.log; fail "the node did not register"; }
$BIN/nvpool node list --json > /tmp/nodes.json
grep -q "\"rdma:$IP:4420\"" /tmp/nodes.json || { cat /tmp/nodes.json; fail "the node's host address is not RDMA"; }
$BIN/nvpool volume create rv 64MiB || fail "volume create"
$BIN/nvpool attach rv $HOSTNQN > /tmp/attach.txt || { cat /tmp/attach.txt; fail "attach"; }
cat /tmp/attach.txt
grep "nvme connect -t rdma -a $IP -s 4420" /tmp/attach.txt | sed 's/#.*//' > /tmp/connect.sh
[ -s /tmp/connect.sh ] || fail "attach gave no RDMA path"
VNQN=$(grep -o 'nqn[^ ]*' /tmp/connect.sh | head -1)
sh /tmp/connect.sh > /dev/null || fail "connect as attach says"
volume_device() { for c in /sys/class/nvme/nvme*; do
    [ "$(cat $c/subsysnqn 2>/dev/null)" = "$VNQN" ] && [ "$(cat $c/transport)" = rdma ] && ls /dev/${c##*/}n* 2>/dev/null | head -1 && return 0
done; return 1; }
wait_for 10 volume_device > /dev/null || fail "no device for the volume"
VDEV=$(volume_device)
fio --filename=$VDEV --ioengine=io_uring --direct=1 --rw=randwrite --bssplit=4k/50:64k/50 --iodepth=8 --size=32M \
    --verify=crc32c --verify_fatal=1 --name=through-controller --output=/host/fio-controller.txt || fail "fio on $VDEV"
checked /host/fio-controller.txt 1
nvme disconnect -n $VNQN > /dev/null
$BIN/nvpool detach rv $HOSTNQN && $BIN/nvpool volume delete rv || fail "detach and delete"
kill $AGENT $CONTROLLER; wait $AGENT $CONTROLLER 2>/dev/null
no_recovery "through the controller"
echo "the volume's path was RDMA, fio verified through it"

step "4 KiB random reads: the engine over RDMA and over TCP, the kernel's nvmet-rdma, the RAM disk itself"
rm -f /host/figures.txt
connect rdma 4420
wait_for 10 device > /dev/null || fail "no device"
measure engine-rdma $(device) 1
measure engine-rdma $(device) 32
nvme disconnect -n $NQN > /dev/null
connect tcp 4420
wait_for 10 device > /dev/null || fail "no device"
measure engine-tcp $(device) 1
measure engine-tcp $(device) 32
nvme disconnect -n $NQN > /dev/null
kill $ENGINE; wait $ENGINE
# The reactors above sleep when idle and the completion channel wakes them; polling
# after the last completion (busy_poll_us) is the other way to take completions.
sed -i 's/^busy_poll_us = 0/busy_poll_us = 50/' /tmp/engine.toml
start_engine /tmp/engine.toml /host/engine-polling.log
connect rdma 4420
wait_for 10 device > /dev/null || fail "no device"
measure engine-rdma-poll $(device) 1
measure engine-rdma-poll $(device) 32
nvme disconnect -n $NQN > /dev/null
kill $ENGINE; wait $ENGINE
nvmet_rdma $NQN.nvmet 4421
timeout 60 nvme connect -t rdma -a $IP -s 4421 -n $NQN.nvmet > /dev/null || fail "connect to nvmet-rdma"
wait_for 10 sh -c 'ls /dev/nvme*n1 > /dev/null 2>&1' || fail "no nvmet device"
NVMET=$(ls /dev/nvme*n1 | head -1)
measure nvmet-rdma $NVMET 1
measure nvmet-rdma $NVMET 32
nvme disconnect -n $NQN.nvmet > /dev/null
measure ram-disk /dev/ram0 1
measure ram-disk /dev/ram0 32
no_oops "during the scenarios"
echo
echo "ALL STEPS PASSED"
