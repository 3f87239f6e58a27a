# Guest side of volume-e2e (busybox sh). Runs in /host, the shared output directory.
# Env: NQN, PORT. The engine is at 10.0.2.2.
T=10.0.2.2
connect() {
    nvme connect -t tcp -a $T -s $PORT -n $NQN -i 2 || fail "nvme connect"
    wait_for 20 ctrl_of $NQN >/dev/null || fail "no live controller for $NQN"
    C=$(ctrl_of $NQN)
    D=/dev/${C}n1
    wait_for 20 test -b $D || fail "no block device $D"
}
usage() {   # usage NAME: the host records the volume's allocation as usage-NAME.json
    echo "$1" > /host/req-usage
    wait_for 30 test ! -f /host/req-usage || fail "the host did not record usage"
    cat /host/usage-$1.json; echo
}
# The same fio job writes, and later verifies only, the same blocks (fixed seed): 48
# MiB, enough to allocate 48 of the thin volume's clusters with writes of every size.
FIO="--name=vol --filename=\$D --direct=1 --ioengine=io_uring --rw=randwrite \
     --bssplit=4k/30:16k/20:64k/20:128k/30 --iodepth=16 --size=48m --offset=64m \
     --randseed=4242 --verify=crc32c --verify_fatal=1"

step "connect to the thin volume; unwritten space reads as zeroes"
connect
nvme id-ns $D | grep -E "^(nsze|nuse|nmic)"
nvme ns-descs $D | tee ns-descs-before.txt
dd if=$D of=/tmp/z bs=1M count=4 skip=512 iflag=direct 2>/dev/null || fail "read"
cmp -n 4194304 /tmp/z /dev/zero || fail "unwritten space is not zeroes"
usage before-write

step "fio randwrite 4k-128k with crc32c verify through the volume"
eval fio $FIO --do_verify=1 --output=fio-write.txt || fail "fio write+verify"
grep -E "err=|write:|read:" fio-write.txt
grep -q "err= 0" fio-write.txt || fail "fio reported errors"
dd if=/dev/urandom of=/tmp/marker bs=1M count=3 2>/dev/null
dd if=/tmp/marker of=$D bs=1M seek=900 oflag=direct 2>/dev/null || fail "marker write"
nvme flush $D -n 1 || fail "nvme flush"
usage after-write

step "the engine is killed (SIGKILL) and restarted from its disks"
nvme disconnect -n $NQN || fail "disconnect"
touch /host/req-crash
wait_for 120 test -f /host/done-crash || fail "the host did not restart the engine"
connect
nvme ns-descs $D | tee ns-descs-after.txt
cmp ns-descs-before.txt ns-descs-after.txt || fail "the volume's identity changed across the restart"

step "fio verifies the data written before the crash"
eval fio $FIO --verify_only=1 --output=fio-verify-after.txt || fail "fio verify after restart"
grep -E "err=|read:|verify" fio-verify-after.txt | head -5
grep -q "err= 0" fio-verify-after.txt || fail "fio reported errors after restart"
dd if=$D of=/tmp/back bs=1M skip=900 count=3 iflag=direct 2>/dev/null || fail "read marker"
cmp /tmp/marker /tmp/back || fail "marker lost across the crash"
echo "fio data and marker intact after SIGKILL and restart"

step "deallocate the marker's clusters: they read as zeroes and are freed"
nvme dsm $D -n 1 --ad -s $((900 * 2048)) -b $((3 * 2048)) || fail "nvme dsm --ad"
dd if=$D of=/tmp/back bs=1M skip=900 count=3 iflag=direct 2>/dev/null || fail "read after dsm"
cmp -n 3145728 /tmp/back /dev/zero || fail "deallocated range is not zeroes"
usage after-trim
nvme disconnect -n $NQN
echo
echo "ALL STEPS PASSED"
