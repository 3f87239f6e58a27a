# Guest side of vhost-e2e (busybox sh), in /host. The engine runs on the host and
# serves two vhost-user-blk disks; QEMU's own virtio-blk serves the same file as the
# first one, read-only. Env: NQN, PORT.
errors_in() { grep -o 'err= *[0-9]*' "$1" | grep -v 'err= *0$'; }
checked() {   # checked FIO_OUTPUT JOBS: every job ended with no error
    [ "$(grep -c 'err= 0' $1)" = "$2" ] && ! errors_in $1 || { cat $1; fail "fio reported errors in $1"; }
}
ask() {   # ask FAULT: the host does it; returns once it is done
    touch /host/req-$1
    wait_for 120 test -f /host/done-$1 || fail "the host did not do $1"
}
# The disks by serial: the engine's answer to GET_ID ends with the namespace ID.
VOL= RO= RAW=
for b in /sys/block/vd*; do
    s=$(cat $b/serial 2>/dev/null)
    case $s in
        qemu-virtio-blk) RAW=/dev/${b##*/} ;;
        */1) VOL=/dev/${b##*/} ;;
        */2) RO=/dev/${b##*/} ;;
    esac
    echo "${b##*/}: serial $s, $(cat $b/size) sectors, ro $(cat $b/ro)"
done

step "the vhost-user-blk disks describe their namespaces"
[ -n "$VOL" ] && [ -n "$RO" ] && [ -n "$RAW" ] || fail "the three disks are not all there"
V=/sys/block/${VOL#/dev/}
echo "block size $(cat $V/queue/logical_block_size), size $(( $(cat $V/size) * 512 )), queues $(ls $V/mq | wc -l)," \
     "discard max $(cat $V/queue/discard_max_bytes), write zeroes max $(cat $V/queue/write_zeroes_max_bytes)," \
     "cache $(cat $V/queue/write_cache), max request $(cat $V/queue/max_sectors_kb) KiB"
[ "$(cat $V/queue/logical_block_size)" = 4096 ] || fail "the disk does not have the namespace's 4 KiB blocks"
[ "$(cat $V/size)" = $((256 << 11)) ] || fail "the disk is not the namespace's size"
[ "$(ls $V/mq | wc -l)" = 2 ] || fail "the disk does not have two queues"

step "fio write then verify (crc32c), mixed block sizes, depth 1 and 16"
fio --direct=1 --ioengine=io_uring --rw=randwrite --verify=crc32c --verify_fatal=1 --randseed=7 \
    --name=qd1 --filename=$VOL --iodepth=1 --bssplit=4k/50:16k/25:64k/25 --offset=0 --size=16M \
    --name=qd16 --filename=$VOL --iodepth=16 --bssplit=4k/40:32k/20:128k/40 --offset=16M --size=48M \
    --output=/host/fio-verify.txt || { cat /host/fio-verify.txt; fail "fio"; }
checked /host/fio-verify.txt 2
grep -E "^ *(write|read):" /host/fio-verify.txt

step "discard reads back zeroes; write zeroes and flush pass"
dd if=/dev/urandom of=$VOL bs=1M count=4 seek=100 oflag=direct 2>/dev/null || fail "dd"
blkdiscard -o $((100 << 20)) -l $((4 << 20)) $VOL || fail "blkdiscard"
dd if=$VOL bs=1M count=4 skip=100 iflag=direct 2>/dev/null | cmp -n $((4 << 20)) - /dev/zero \
    || fail "discarded blocks do not read back as zeroes"
dd if=/dev/urandom of=$VOL bs=1M count=2 seek=110 oflag=direct 2>/dev/null || fail "dd"
fallocate -z -o $((110 << 20)) -l $((2 << 20)) $VOL 2>/dev/null && {
    dd if=$VOL bs=1M count=2 skip=110 iflag=direct 2>/dev/null | cmp -n $((2 << 20)) - /dev/zero \
        || fail "zeroed blocks do not read back as zeroes"
    echo "write zeroes: zeroes"
}
fio --ioengine=io_uring --direct=1 --rw=write --bs=4k --size=1M --offset=120M --fsync=1 --name=flush \
    --filename=$VOL --output=/host/fio-flush.txt || fail "fio with fsync"
checked /host/fio-flush.txt 1
echo "discard and flush: no errors"

step "a read-only disk takes reads and refuses writes"
[ "$(cat /sys/block/${RO#/dev/}/ro)" = 1 ] || fail "$RO is not read-only"
dd if=$RO of=/dev/null bs=64k count=16 iflag=direct 2>/dev/null || fail "reading the read-only disk"
if dd if=/dev/zero of=$RO bs=4k count=1 oflag=direct 2>/dev/null; then fail "a write to a read-only disk passed"; fi
echo "read-only: reads pass, writes are refused"

step "ext4 with files across an engine crash under writes: QEMU reconnects and nothing is lost"
mkfs.ext4 -q -F $VOL || fail "mkfs.ext4"
mkdir -p /mnt/vol && mount $VOL /mnt/vol || fail "mount"
for i in 1 2 3 4 5 6; do dd if=/dev/urandom of=/mnt/vol/file$i bs=256k count=$((i * 4)) 2>/dev/null; done
sync
(cd /mnt/vol && md5sum file*) > /tmp/sums.txt
fio --directory=/mnt/vol --ioengine=io_uring --direct=1 --rw=randwrite --bssplit=4k/50:64k/50 --iodepth=8 \
    --size=24M --verify=crc32c --verify_fatal=1 --name=during-crash --output=/host/fio-crash.txt &
FIO=$!
sleep 3
ask crash
echo "the engine was killed and started again"
wait $FIO || { cat /host/fio-crash.txt; fail "fio failed across the crash"; }
checked /host/fio-crash.txt 1
(cd /mnt/vol && md5sum -c /tmp/sums.txt) || fail "files changed across the crash"
echo "fio across the crash: no errors; files intact"

step "a hot upgrade under fio verify"
fio --directory=/mnt/vol --ioengine=io_uring --direct=1 --rw=randwrite --bssplit=4k/50:64k/50 --iodepth=8 \
    --size=24M --verify=crc32c --verify_fatal=1 --name=during-upgrade --output=/host/fio-upgrade.txt &
FIO=$!
sleep 3
ask upgrade
[ "$(cat /host/upgrade-result)" = ok ] || fail "the upgrade failed"
wait $FIO || { cat /host/fio-upgrade.txt; fail "fio failed across the upgrade"; }
checked /host/fio-upgrade.txt 1
(cd /mnt/vol && md5sum -c /tmp/sums.txt) || fail "files changed across the upgrade"
umount /mnt/vol
e2fsck -fn $VOL > /tmp/fsck.txt 2>&1 || { cat /tmp/fsck.txt; fail "the filesystem is damaged"; }
echo "fio across the upgrade: no errors; the filesystem is clean"

step "4 KiB random reads: vhost-user-blk, QEMU's virtio-blk on the same file, NVMe/TCP"
dd if=/dev/urandom of=$VOL bs=1M count=64 oflag=direct 2>/dev/null
nvme connect -t tcp -a 10.0.2.2 -s $PORT -n $NQN || fail "nvme connect"
wait_for 20 ctrl_of $NQN >/dev/null || fail "no controller"
C=$(ctrl_of $NQN)
TCP=
wait_for 20 sh -c "ls /sys/block | grep -q ${C}n" || fail "no NVMe/TCP namespaces"
for b in /sys/block/${C}n*; do [ "$(cat $b/nsid)" = 1 ] && TCP=/dev/${b##*/}; done
wait_for 20 test -b "$TCP" || fail "no NVMe/TCP block device"
: > /host/figures.txt
for qd in 1 32; do
    measure qemu-virtio-blk $RAW $qd
    measure vhost-user-blk $VOL $qd
    measure nvme-tcp $TCP $qd
done
nvme disconnect -n $NQN

echo
echo "ALL STEPS PASSED"
