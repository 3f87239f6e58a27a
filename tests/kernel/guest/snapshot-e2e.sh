# Guest side of snapshot-e2e (busybox sh). Runs in /host, the shared output directory.
# Env: NQN, PORT. The engine is at 10.0.2.2; the host takes the snapshot and makes the
# clone when asked (req-snapshot), and deletes the origin and the snapshot (req-delete-origin).
T=10.0.2.2
ask() {   # ask NAME: the host does NAME; fails if it could not
    touch /host/req-$1
    wait_for 120 test -f /host/done-$1 -o -f /host/failed-$1 || fail "the host did not answer $1"
    [ -f /host/done-$1 ] || { tail -20 /host/host-actions.log; fail "the host could not do $1"; }
}
fio_ok() {   # fio_ok OUTPUT WHAT: the job's report says no error
    grep -E "err=|write:|read:" $1
    grep -q "err= 0" $1 || { cat $1; fail "fio reported errors $2"; }
}
# Rate-limited so that the writes are under way for seconds under emulation: the
# snapshot is taken in their middle, and the verify pass then reads what crossed it.
LOAD="--ioengine=io_uring --direct=1 --rw=randwrite --bs=16k --iodepth=8 --rate_iops=400 --eta=never \
      --verify=crc32c --do_verify=1 --verify_fatal=1"

step "connect; ext4 with metadata checksums and checksummed files on the origin"
nvme connect -t tcp -a $T -s $PORT -n $NQN -i 2 || fail "nvme connect"
wait_for 20 ctrl_of $NQN >/dev/null || fail "no live controller for $NQN"
C=$(ctrl_of $NQN)
ORIGIN=/dev/${C}n1
CLONE=/dev/${C}n2
wait_for 20 test -b $ORIGIN || fail "no block device $ORIGIN"
mkfs.ext4 -q -F -O metadata_csum $ORIGIN || fail "mkfs.ext4"
mkdir -p /mnt/origin /mnt/clone
mount $ORIGIN /mnt/origin || fail "mount the origin"
mkdir /mnt/origin/files
i=0
while [ $i -lt 24 ]; do
    dd if=/dev/urandom of=/mnt/origin/files/f$i bs=256k count=$((1 + i % 8)) 2>/dev/null || fail "write f$i"
    i=$((i + 1))
done
(cd /mnt/origin/files && sha256sum f*) > /tmp/at-snapshot.sums
sync
echo "$(wc -l < /tmp/at-snapshot.sums) files, checksummed and synced"

step "fio writes through ext4 (crc32c verify) while the engine snapshots the volume"
fio --name=load --filename=/mnt/origin/load.dat --size=48m $LOAD --output=/tmp/fio-load.txt &
FIO=$!
sleep 3
kill -0 $FIO 2>/dev/null || { cat /tmp/fio-load.txt; fail "fio ended before the snapshot"; }
ask snapshot
kill -0 $FIO 2>/dev/null || { cat /tmp/fio-load.txt; fail "fio ended before the snapshot was done: it did not span it"; }
grep -i "held\|pause" /host/snapshot.txt || cat /host/snapshot.txt
wait $FIO || fail "fio (rc $?)"
fio_ok /tmp/fio-load.txt "across the snapshot"

step "the clone appears as namespace 2, mounts and holds the files as of the snapshot while the origin changes"
wait_for 30 test -b $CLONE || { nvme ns-rescan /dev/$C; wait_for 30 test -b $CLONE; } || fail "no block device $CLONE"
# The origin keeps changing meanwhile: another fio job, and half the files rewritten.
fio --name=more --filename=/mnt/origin/more.dat --size=16m $LOAD --output=/tmp/fio-more.txt &
FIO=$!
i=0
while [ $i -lt 12 ]; do
    dd if=/dev/urandom of=/mnt/origin/files/f$i bs=64k count=3 2>/dev/null || fail "rewrite f$i"
    i=$((i + 1))
done
sync
# The snapshot was taken under writes, never frozen: the clone's journal is replayed.
mount $CLONE /mnt/clone || fail "mount the clone"
(cd /mnt/clone/files && sha256sum -c /tmp/at-snapshot.sums) > /tmp/clone-check.txt ||
    { cat /tmp/clone-check.txt; fail "the clone's files are not those of the snapshot"; }
echo "the clone's $(grep -c ': OK' /tmp/clone-check.txt) files are as they were at the snapshot"
changed=$( (cd /mnt/origin/files && sha256sum -c /tmp/at-snapshot.sums 2>/dev/null) | grep -vc ': OK')
[ "$changed" = 12 ] || fail "the origin shows $changed changed files, not the 12 rewritten"
echo "the origin meanwhile: 12 of its files differ from the snapshot's"
umount /mnt/clone || fail "umount the clone"
e2fsck -fn $CLONE > /tmp/fsck-clone.txt 2>&1 || { cat /tmp/fsck-clone.txt; fail "e2fsck: the clone's file system is not clean"; }
tail -1 /tmp/fsck-clone.txt
wait $FIO || fail "fio (rc $?)"
fio_ok /tmp/fio-more.txt "on the origin beside the clone"

step "write to the clone; delete the origin and the snapshot; the clone stays intact"
mount $CLONE /mnt/clone || fail "mount the clone again"
mkdir /mnt/clone/own
i=0
while [ $i -lt 8 ]; do
    dd if=/dev/urandom of=/mnt/clone/own/g$i bs=128k count=$((1 + i)) 2>/dev/null || fail "write g$i"
    i=$((i + 1))
done
(cd /mnt/clone/own && sha256sum g*) > /tmp/clone-own.sums
umount /mnt/clone || fail "umount the clone"
umount /mnt/origin || fail "umount the origin"
ask delete-origin
wait_for 30 test ! -b $ORIGIN || fail "$ORIGIN is still there after its namespace was removed"
echo 3 > /proc/sys/vm/drop_caches
e2fsck -fn $CLONE > /tmp/fsck-clone.txt 2>&1 || { cat /tmp/fsck-clone.txt; fail "e2fsck: the clone is not clean without its origin"; }
tail -1 /tmp/fsck-clone.txt
mount $CLONE /mnt/clone || fail "mount the clone without its origin"
(cd /mnt/clone/files && sha256sum -c /tmp/at-snapshot.sums) > /tmp/clone-check.txt ||
    { cat /tmp/clone-check.txt; fail "the clone lost the snapshot's files with its origin"; }
(cd /mnt/clone/own && sha256sum -c /tmp/clone-own.sums) > /tmp/clone-own-check.txt ||
    { cat /tmp/clone-own-check.txt; fail "the clone lost its own files with its origin"; }
echo "the clone holds the snapshot's $(grep -c ': OK' /tmp/clone-check.txt) files and its own $(grep -c ': OK' /tmp/clone-own-check.txt)"
umount /mnt/clone
dmesg | grep -iE "I/O error|EXT4-fs error" && fail "the kernel logged I/O or ext4 errors"
no_oops "during the snapshot scenario"
nvme disconnect -n $NQN
echo
echo "ALL STEPS PASSED"
