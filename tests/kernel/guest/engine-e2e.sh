# Guest side of engine-e2e (busybox sh). Runs in /host, the shared output directory.
# Env: NQN, LOCKED, PORT, DPORT. The engine is at 10.0.2.2.
T=10.0.2.2
connect() {   # connect EXTRA-ARGS...: connects $NQN, sets $C (controller) and $D (namespace 1)
    nvme connect -t tcp -a $T -s $PORT -n $NQN "$@" || fail "nvme connect $*"
    wait_for 20 ctrl_of $NQN >/dev/null || fail "no live controller for $NQN"
    C=$(ctrl_of $NQN)
    D=/dev/${C}n1
    wait_for 20 test -b $D || fail "no block device $D"
}
disconnect() { nvme disconnect -n $NQN || fail "nvme disconnect"; }

step "nvme discover"
nvme discover -t tcp -a $T -s $DPORT | tee discover.txt
grep -q "subnqn: *$NQN\$" discover.txt || fail "$NQN missing from the discovery log"
grep -q "$LOCKED" discover.txt && fail "$LOCKED is listed for a host it does not allow"

step "nvme connect (no digests), list, id-ctrl, id-ns, ns-descs"
connect
cat /sys/class/nvme/$C/queue_count > queues-plain.txt
nvme list | tee nvme-list.txt
nvme id-ctrl /dev/$C | tee id-ctrl.txt | grep -E "^(sn|mn|fr|cntlid|mdts|kas|ioccsz|subnqn|oncs|vwc) "
nvme id-ns $D | tee id-ns.txt | grep -E "^(nsze|ncap|nmic|lbaf  0|nguid)"
nvme ns-descs $D | tee ns-descs.txt
grep -q uuid ns-descs.txt || fail "no UUID descriptor"
disconnect

step "nvme connect --hdr-digest --data-digest -i 2, fio write then verify (crc32c)"
connect --hdr-digest --data-digest -i 2
q=$(cat /sys/class/nvme/$C/queue_count)
echo "queue_count (admin + I/O) = $q"
[ "$q" = 3 ] || fail "expected 2 I/O queues, got $((q - 1))"
dmesg | grep -E "nvme.*(creating|mapped)" | tail -2
fio --name=verify --filename=$D --direct=1 --ioengine=io_uring --rw=randwrite \
    --bssplit=4k/30:16k/20:64k/20:256k/15:1m/15 --iodepth=16 --size=64m \
    --verify=crc32c --do_verify=1 --verify_fatal=1 --verify_backlog=0 --output=fio-verify.txt \
    || fail "fio verify"
cat fio-verify.txt
grep -q "err= 0" fio-verify.txt || fail "fio reported errors"
grep -qi "verify.*fail\|crc32c.*bad" fio-verify.txt && fail "verification failure"
disconnect

step "nvme connect --disable-sqflow (reads complete with C2HData SUCCESS), fio verify"
connect --disable-sqflow
fio --name=sqflow --filename=$D --direct=1 --ioengine=io_uring --rw=randwrite --bs=4k --iodepth=16 \
    --size=16m --offset=256m --verify=crc32c --do_verify=1 --verify_fatal=1 --output=fio-sqflow.txt \
    || fail "fio verify without SQ flow control"
grep -E "err=|read:|write:" fio-sqflow.txt
grep -q "err= 0" fio-sqflow.txt || fail "fio reported errors"
disconnect

step "mkfs.ext4, files, checksums across disconnect and reconnect"
connect
mkfs.ext4 -q -F $D || fail mkfs
mkdir -p /mnt/v && mount $D /mnt/v || fail mount
for i in 1 2 3; do dd if=/dev/urandom of=/mnt/v/file$i bs=1M count=$((i * 3)) 2>/dev/null; done
echo "hello nvpool" > /mnt/v/small.txt
(cd /mnt/v && sha256sum file1 file2 file3 small.txt) | tee sums.txt
umount /mnt/v || fail umount
disconnect
connect
mount $D /mnt/v || fail "mount after reconnect"
(cd /mnt/v && sha256sum -c /host/sums.txt) | tee sums-check.txt || fail "checksums differ after reconnect"
umount /mnt/v

step "nvme flush, write-zeroes, dsm --ad"
dd if=/dev/urandom of=$D bs=512 seek=1000 count=16 oflag=direct 2>/dev/null
dd if=/dev/urandom of=$D bs=512 seek=3000 count=16 oflag=direct 2>/dev/null
nvme flush $D -n 1 || fail "nvme flush"
nvme write-zeroes $D -n 1 -s 1000 -c 15 || fail "nvme write-zeroes"
nvme read $D -n 1 -s 1000 -c 15 -z 8192 -d /tmp/wz >/dev/null || fail "nvme read"
cmp -n 8192 /tmp/wz /dev/zero || fail "write-zeroes left data behind"
nvme dsm $D -n 1 --ad -s 3000 -b 16 || fail "nvme dsm --ad"
nvme read $D -n 1 -s 3000 -c 15 -z 8192 -d /tmp/dsm >/dev/null || fail "nvme read"
cmp -n 8192 /tmp/dsm /dev/zero || fail "deallocated blocks do not read as zeroes"
echo "flush, write-zeroes and deallocate OK"

step "reservations with the kernel's passthrough: nvme resv-register, resv-acquire, resv-report, resv-release"
nvme id-ns $D | grep -E "^rescap" | tee rescap.txt
nvme resv-register $D -n 1 --nrkey=1234567 --rrega=0 || fail "nvme resv-register"
nvme resv-acquire $D -n 1 --crkey=1234567 --rtype=1 --racqa=0 || fail "nvme resv-acquire (Write Exclusive)"
nvme resv-report $D -n 1 --eds -o json | tee resv-report.json
tr -d ' \n' < resv-report.json | grep -q '"rtype":1,' || fail "the report does not show Write Exclusive held"
grep -q 1234567 resv-report.json || fail "the report does not list the key"
dd if=/dev/urandom of=$D bs=512 seek=5000 count=8 oflag=direct 2>/dev/null || fail "the holder's write"
nvme resv-acquire $D -n 1 --crkey=7654321 --rtype=1 --racqa=0 2>resv-wrong-key.txt && fail "acquired with a wrong key"
cat resv-wrong-key.txt
nvme resv-release $D -n 1 --crkey=1234567 --rtype=1 --rrela=0 || fail "nvme resv-release"
nvme resv-register $D -n 1 --crkey=1234567 --rrega=1 || fail "nvme resv-register (unregister)"
nvme resv-report $D -n 1 --eds -o json | tee resv-report-after.json
tr -d ' \n' < resv-report-after.json | grep -q '"regctl":0' || fail "a registration is left"
echo "reservations OK"

step "a namespace added while connected appears (AEN)"
touch /host/req-add-ns
wait_for 60 test -b /dev/${C}n2 || fail "namespace 2 did not appear"
nvme list | tee nvme-list-after-add.txt
nvme id-ns /dev/${C}n2 | grep -E "^nsze"

step "a host not on the allow-list is refused"
if nvme connect -t tcp -a $T -s $PORT -n $LOCKED > locked.txt 2>&1; then fail "connected to $LOCKED"; fi
cat locked.txt
dmesg | grep -i "nvme" | tail -3

step "engine restart: the data is still there"
dd if=/dev/urandom of=/tmp/marker bs=1M count=2 2>/dev/null
dd if=/tmp/marker of=$D bs=1M seek=100 oflag=direct 2>/dev/null || fail "marker write"
nvme flush $D -n 1 || fail "flush before restart"
disconnect
touch /host/req-restart
wait_for 60 test -f /host/done-restart || fail "the host did not restart the engine"
connect
dd if=$D of=/tmp/back bs=1M skip=100 count=2 iflag=direct 2>/dev/null || fail "read after restart"
cmp /tmp/marker /tmp/back || fail "data lost across the engine restart"
echo "marker intact after restart"
disconnect
echo
echo "ALL STEPS PASSED"
