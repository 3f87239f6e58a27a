# Guest side of upgrade-e2e (busybox sh). Runs in /host, the shared output directory.
# Env: NQN, PORT, VERSION_A, VERSION_B. The engine is at 10.0.2.2; namespace 1 is RAM,
# namespace 2 a thin volume.
T=10.0.2.2

step "connect; one controller, two namespaces"
nvme connect -t tcp -a $T -s $PORT -n $NQN -i 2 || fail "nvme connect"
wait_for 20 ctrl_of $NQN >/dev/null || fail "no live controller for $NQN"
C=$(ctrl_of $NQN)
MEM=/dev/${C}n1
VOL=/dev/${C}n2
wait_for 20 test -b $MEM || fail "no block device $MEM"
wait_for 20 test -b $VOL || fail "no block device $VOL"
CNTLID=$(cat /sys/class/nvme/$C/cntlid)
firmware() { nvme id-ctrl /dev/$C | sed -n 's/^fr *: *//p' | tr -d ' '; }
echo "controller $C, cntlid $CNTLID, firmware revision $(firmware)"
KMSG_BEFORE=$(dmesg | wc -l)

# Each round writes and verifies (crc32c) a region of its own on both namespaces, at
# depth 1 (4 KiB, in the command capsule) and 32 (4 KiB and 64 KiB: R2T and H2CData);
# the thin volume allocates new clusters in every round of the first pass.
round() {   # round N [fio options...]
    n=$1; shift
    off=$(( (n % 15) * 16 ))
    fio_across_path_faults --direct=1 --ioengine=io_uring --rw=randwrite --randseed=$n \
        --verify=crc32c --verify_fatal=1 "$@" \
        --name=mem-qd1 --filename=$MEM --iodepth=1 --bs=4k --offset=${off}M --size=4M \
        --name=mem-qd32 --filename=$MEM --iodepth=32 --bssplit=4k/50:64k/50 --offset=$((off + 4))M --size=12M \
        --name=vol-qd1 --filename=$VOL --iodepth=1 --bs=4k --offset=${off}M --size=4M \
        --name=vol-qd32 --filename=$VOL --iodepth=32 --bssplit=4k/50:64k/50 --offset=$((off + 4))M --size=12M \
        --output=fio-$n.txt
}
checked() {   # checked N: the round's four jobs ended with no error
    [ "$(grep -c 'err= 0' fio-$1.txt)" = 4 ] || { cat fio-$1.txt; fail "fio round $1 reported errors"; }
}

step "fio rounds while the engine is hot-upgraded again and again"
( while [ ! -f /host/done-upgrades ]; do firmware >> /tmp/firmware.log; sleep 0.5; done ) &
touch /host/req-upgrades
n=0
while :; do
    n=$((n + 1))
    round $n --do_verify=1 || fail "fio round $n"
    checked $n
    [ -f /host/done-upgrades ] && break
    [ $n -lt 300 ] || fail "the host did not finish its upgrades"
done
echo "$n rounds of write+verify, each with 4 jobs: no errors"
grep -h -E "^ *(write|read):" fio-*.txt | head -4

step "the last round's data reads back whole after the last upgrade"
round $n --verify_only=1 || fail "fio verify"
checked $n

step "no reconnect, the same controller, both versions seen"
[ "$(cat /sys/class/nvme/$C/state)" = live ] || fail "$C is $(cat /sys/class/nvme/$C/state)"
[ "$(cat /sys/class/nvme/$C/cntlid)" = "$CNTLID" ] || fail "cntlid $CNTLID became $(cat /sys/class/nvme/$C/cntlid)"
dmesg | tail -n +$((KMSG_BEFORE + 1)) > kmsg-during.txt
echo "kernel messages during the upgrades: $(wc -l < kmsg-during.txt)"
cat kmsg-during.txt
if grep -iE "reconnect|recovery|reset|timeout|error|failed" kmsg-during.txt; then
    fail "the kernel saw the upgrades"
fi
sort -u /tmp/firmware.log > firmware-seen.txt
echo "firmware revisions seen by Identify: $(tr '\n' ' ' < firmware-seen.txt)"
grep -qx "$VERSION_A" firmware-seen.txt || fail "version $VERSION_A never seen"
grep -qx "$VERSION_B" firmware-seen.txt || fail "version $VERSION_B never seen"
echo "cntlid $CNTLID throughout; controller $C live; no reconnect"
nvme disconnect -n $NQN
echo
echo "ALL STEPS PASSED"
