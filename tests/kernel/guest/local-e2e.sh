# Guest side of local-e2e (busybox sh), in /host. The engine runs here, from /host/bin.
# Env: NQN.
BIN=/host/bin
SOCK=/tmp/engine.sock
# A management call that hangs fails the step instead of the whole guest's time.
cli() { timeout 120 $BIN/nvpool engine "$@" --socket $SOCK; }
RUN=0
next_engine() {   # next_engine CONFIG: starts the engine again, with a log of its own
    RUN=$((RUN + 1))
    start_engine $1 /host/engine-$RUN.log
}
errors_in() { grep -o 'err= *[0-9]*' "$1" | grep -v 'err= *0$'; }
checked() {   # checked FIO_OUTPUT JOBS: every job ended with no error
    [ "$(grep -c 'err= 0' $1)" = "$2" ] && ! errors_in $1 || { cat $1; fail "fio reported errors in $1"; }
}

step "the ublk driver and an engine serving a file namespace as /dev/ublkb0"
modprobe ublk_drv || fail "no ublk_drv module"
uname -r
truncate -s 256M /tmp/vol.img
truncate -s 16M /tmp/ro.img
cat > /tmp/engine.toml <<TOML
reactors = 2
busy_poll_us = 0
management_socket = "$SOCK"
[[listener]]
address = "127.0.0.1:4420"
[[subsystem]]
nqn = "$NQN"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "file:/tmp/vol.img"
block_size = 4096
[[subsystem.namespace]]
nsid = 2
backend = "file:/tmp/ro.img"
TOML
next_engine /tmp/engine.toml
cli local add $NQN/1 --ublk --id 0 || fail "local add"
wait_for 10 test -b /dev/ublkb0 || fail "no /dev/ublkb0"
cli local list | tee /tmp/local-list.txt
# Linux 6.16 and later register each request's pages in the engine's ring: the file
# namespace must then be served with zero copy.
KV=$(uname -r); KMAJOR=${KV%%.*}; KMINOR=${KV#*.}; KMINOR=${KMINOR%%.*}
if [ "$KMAJOR" -gt 6 ] || { [ "$KMAJOR" = 6 ] && [ "$KMINOR" -ge 16 ]; }; then
    grep -q 'zero copy' /tmp/local-list.txt || fail "Linux $KV offers zero copy and the engine does not use it"
    echo "data path: zero copy"
else
    echo "data path: copy (Linux $KV has no automatic buffer registration)"
fi
echo "block size $(cat /sys/block/ublkb0/queue/logical_block_size)," \
     "size $(( $(cat /sys/block/ublkb0/size) * 512 )), discard max $(cat /sys/block/ublkb0/queue/discard_max_bytes)," \
     "write zeroes max $(cat /sys/block/ublkb0/queue/write_zeroes_max_bytes), cache $(cat /sys/block/ublkb0/queue/write_cache)," \
     "fua $(cat /sys/block/ublkb0/queue/fua)"
[ "$(cat /sys/block/ublkb0/queue/logical_block_size)" = 4096 ] || fail "the device does not have the namespace's 4 KiB blocks"
[ "$(cat /sys/block/ublkb0/size)" = $((256 << 11)) ] || fail "the device is not the namespace's size"

step "fio write then verify (crc32c), mixed block sizes, depth 1 and 16"
fio --direct=1 --ioengine=io_uring --rw=randwrite --verify=crc32c --verify_fatal=1 --randseed=7 \
    --name=qd1 --filename=/dev/ublkb0 --iodepth=1 --bssplit=4k/50:16k/25:64k/25 --offset=0 --size=16M \
    --name=qd16 --filename=/dev/ublkb0 --iodepth=16 --bssplit=4k/40:32k/20:128k/40 --offset=16M --size=48M \
    --output=/host/fio-verify.txt || { cat /host/fio-verify.txt; fail "fio"; }
checked /host/fio-verify.txt 2
grep -E "^ *(write|read):" /host/fio-verify.txt

step "discard reads back zeroes; flush and FUA writes pass"
dd if=/dev/urandom of=/dev/ublkb0 bs=1M count=4 seek=100 oflag=direct 2>/dev/null || fail "dd"
blkdiscard -o $((100 << 20)) -l $((4 << 20)) /dev/ublkb0 || fail "blkdiscard"
dd if=/dev/ublkb0 bs=1M count=4 skip=100 iflag=direct 2>/dev/null | cmp -n $((4 << 20)) - /dev/zero \
    || fail "discarded blocks do not read back as zeroes"
fio --ioengine=io_uring --direct=1 --rw=write --bs=4k --size=1M --offset=120M --fsync=1 --name=flush \
    --filename=/dev/ublkb0 --output=/host/fio-flush.txt || fail "fio with fsync"
checked /host/fio-flush.txt 1
fio --ioengine=psync --direct=1 --sync=1 --rw=write --bs=4k --size=1M --offset=121M --name=fua \
    --filename=/dev/ublkb0 --output=/host/fio-fua.txt || fail "fio with O_SYNC (FUA)"
checked /host/fio-fua.txt 1
echo "discard, flush and FUA writes: no errors"

step "a read-only device takes reads and refuses writes"
cli local add $NQN/2 --ublk --id 1 --read-only || fail "local add --read-only"
wait_for 10 test -b /dev/ublkb1 || fail "no /dev/ublkb1"
[ "$(cat /sys/block/ublkb1/ro)" = 1 ] || fail "/dev/ublkb1 is not read-only"
dd if=/dev/ublkb1 of=/dev/null bs=64k count=16 iflag=direct 2>/dev/null || fail "reading the read-only device"
if dd if=/dev/zero of=/dev/ublkb1 bs=4k count=1 oflag=direct 2>/dev/null; then fail "a write to a read-only device passed"; fi
cli local remove 1 || fail "local remove 1"
wait_for 10 sh -c '! test -b /dev/ublkb1' || fail "/dev/ublkb1 is still there after its removal"
if cli namespace remove $NQN 1 2>/tmp/refused.txt; then fail "a namespace behind a local device was removed"; fi
cat /tmp/refused.txt

step "ext4 with files across an engine crash under writes: the device is taken back"
mkfs.ext4 -q -F /dev/ublkb0 || fail "mkfs.ext4"
mkdir -p /mnt/vol && mount /dev/ublkb0 /mnt/vol || fail "mount"
for i in 1 2 3 4 5 6; do dd if=/dev/urandom of=/mnt/vol/file$i bs=256k count=$((i * 4)) 2>/dev/null; done
sync
(cd /mnt/vol && md5sum file*) > /tmp/sums.txt
# The restarted engine takes /dev/ublkb0 back from its configuration.
cp /tmp/engine.toml /tmp/engine-local.toml
cat >> /tmp/engine-local.toml <<TOML
[[local]]
target = "$NQN/1"
ublk_id = 0
TOML
fio --directory=/mnt/vol --ioengine=io_uring --direct=1 --rw=randwrite --bssplit=4k/50:64k/50 --iodepth=8 \
    --size=24M --verify=crc32c --verify_fatal=1 --name=during-crash --output=/host/fio-crash.txt &
FIO=$!
sleep 3
kill -9 $ENGINE
echo "engine killed; fio goes on waiting"
sleep 2
next_engine /tmp/engine-local.toml
cli local list | tee /tmp/after-crash.txt
wait $FIO || { cat /host/fio-crash.txt; fail "fio failed across the crash"; }
checked /host/fio-crash.txt 1
(cd /mnt/vol && md5sum -c /tmp/sums.txt) || fail "files changed across the crash"
grep -q ublkb0 /tmp/after-crash.txt || fail "the restarted engine does not serve /dev/ublkb0"
no_oops "while the restarted engine took the device back"
echo "fio across the crash: no errors; files intact"

step "a hot upgrade under fio verify"
fio --filename=/dev/ublkb0 --ioengine=io_uring --direct=1 --rw=randwrite --bssplit=4k/50:64k/50 --iodepth=16 \
    --offset=200M --size=32M --verify=crc32c --verify_fatal=1 --name=during-upgrade \
    --output=/host/fio-upgrade.txt &
FIO=$!
sleep 2
umount /mnt/vol
cli upgrade --json > /host/upgrade.json || { cat /host/upgrade.json; fail "upgrade"; }
cat /host/upgrade.json
wait_for 30 sh -c "$BIN/nvpool engine local list --socket $SOCK | grep -q ublkb0" || fail "the new engine did not take /dev/ublkb0 back"
wait $FIO || { cat /host/fio-upgrade.txt; fail "fio failed across the upgrade"; }
checked /host/fio-upgrade.txt 1
cli local list
no_oops "while the new engine took the device back"
echo "fio across the upgrade: no errors"
e2fsck -fn /dev/ublkb0 > /tmp/fsck.txt 2>&1 || { cat /tmp/fsck.txt; fail "the filesystem is damaged"; }

step "4 KiB random reads: ublk, NVMe/TCP on the loopback, the raw file"
dd if=/dev/urandom of=/dev/ublkb0 bs=1M count=64 oflag=direct 2>/dev/null
nvme connect -t tcp -a 127.0.0.1 -s 4420 -n $NQN || fail "nvme connect"
wait_for 20 ctrl_of $NQN >/dev/null || fail "no controller"
C=$(ctrl_of $NQN)
TCP=
for b in /sys/block/${C}n*; do [ "$(cat $b/nsid)" = 1 ] && TCP=/dev/${b##*/}; done
wait_for 20 test -b "$TCP" || fail "no NVMe/TCP block device"
: > /host/figures.txt
# The kernel's own loop device on the same file: what a block device in front of this
# file costs without the engine.
modprobe loop 2>/dev/null
LOOP=$(losetup -f 2>/dev/null) && losetup $LOOP /tmp/vol.img || LOOP=
for qd in 1 32; do
    measure raw-file /tmp/vol.img $qd
    [ -n "$LOOP" ] && measure loop $LOOP $qd
    measure ublk /dev/ublkb0 $qd
    measure nvme-tcp $TCP $qd
done
[ -n "$LOOP" ] && losetup -d $LOOP
nvme disconnect -n $NQN

step "through the controller: a host on the volume's own node gets a local device"
truncate -s 256M /tmp/pool.img
cli pool create g /tmp/pool.img || fail "pool create"
$BIN/nvpool controller --store redb:/tmp/controller.redb > /host/controller.log 2>&1 &
CONTROLLER=$!
NODE_HOSTNQN=nqn.2024-01.io.nvpool:local-e2e-node
$BIN/nvpool agent --name g1 --engine-socket $SOCK --nvme-address 127.0.0.1:4420 --local-host-nqn $NODE_HOSTNQN \
    > /host/agent.log 2>&1 &
AGENT=$!
wait_for 60 sh -c "$BIN/nvpool node list --json 2>/dev/null | grep -q '\"healthy\": true'" || fail "the node did not register"
$BIN/nvpool volume create lv 64MiB --thin || fail "volume create"   # thin: first writes wait for allocation (handed to another thread and back)
HOSTNQN=nqn.2024-01.io.nvpool:local-pod
$BIN/nvpool attach lv $HOSTNQN --local g1 --json > /tmp/attach.json || { cat /tmp/attach.json; fail "attach --local"; }
cat /tmp/attach.json
DEV=$(grep -o '"device": *"[^"]*"' /tmp/attach.json | grep -o '/dev/[a-z0-9]*')
[ -n "$DEV" ] || fail "attach --local gave no device"
wait_for 10 test -b $DEV || fail "no $DEV"
$BIN/nvpool volume get lv | tee /tmp/volume.txt
grep -q "local ublk" /tmp/volume.txt || fail "volume get does not show the local device"
fio --filename=$DEV --ioengine=io_uring --direct=1 --rw=randwrite --bssplit=4k/50:64k/50 --iodepth=8 --size=32M \
    --verify=crc32c --verify_fatal=1 --name=through-controller --output=/host/fio-controller.txt || fail "fio on $DEV"
checked /host/fio-controller.txt 1
$BIN/nvpool detach lv $HOSTNQN || fail "detach"
wait_for 10 sh -c "! test -b $DEV" || fail "$DEV is still there after the detach"
$BIN/nvpool volume delete lv || fail "volume delete"
echo "attach --local made $DEV, fio verified through it, detach removed it"

step "CSI on the volumes' own node: csi-sanity (node tests included) stages every volume on a local device"
$BIN/nvpool csi --endpoint unix:///tmp/csi.sock --controller 127.0.0.1:9400 --node-name g1 \
    --host-nqn $NODE_HOSTNQN --state-dir /tmp/csi-state > /host/csi-driver.log 2>&1 &
CSI=$!
wait_for 10 test -S /tmp/csi.sock || { cat /host/csi-driver.log; fail "the CSI driver did not start"; }
printf 'thin: "true"\n' > /tmp/csi-params.yaml
$BIN/csi-sanity --csi.endpoint=unix:///tmp/csi.sock --csi.mountdir=/tmp/csi-mount \
    --csi.stagingdir=/tmp/csi-staging --csi.testvolumesize=16777216 --csi.testvolumeexpandsize=33554432 \
    --csi.testvolumeparameters=/tmp/csi-params.yaml --ginkgo.no-color > /host/csi-sanity.txt 2>&1 \
    || { tail -60 /host/csi-sanity.txt; fail "csi-sanity"; }
grep -E '^(SUCCESS|FAIL)!' /host/csi-sanity.txt
local_stagings=$(grep -c 'staged the local device' /host/csi-driver.log)
tcp_stagings=$(grep -c 'connected paths' /host/csi-driver.log)
echo "NodeStage: $local_stagings stagings on a local device, $tcp_stagings over NVMe/TCP"
[ "$local_stagings" -gt 0 ] && [ "$tcp_stagings" = 0 ] || fail "a volume on this node was staged over NVMe/TCP"
kill $CSI $AGENT $CONTROLLER

step "removal and engine stop leave no ublk device"
cli local remove 0 || fail "local remove 0"
wait_for 10 sh -c '! test -b /dev/ublkb0' || fail "/dev/ublkb0 is still there after its removal"
cli local add $NQN/1 --ublk --id 0 || fail "local add again"
wait_for 10 test -b /dev/ublkb0 || fail "no /dev/ublkb0 the second time"
PID=$(cli info --json | grep -o '"pid": *[0-9]*' | grep -o '[0-9]*$')
kill -TERM $PID
wait_for 20 sh -c "! kill -0 $PID 2>/dev/null" || fail "the engine did not stop"
ls /dev/ublk* 2>/dev/null | grep -v ublk-control && fail "a ublk device outlived the engine"
echo "no ublk device left"
no_oops "at the end"
echo
echo "ALL STEPS PASSED"
