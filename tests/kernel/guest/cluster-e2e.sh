# Guest side of cluster-e2e (busybox sh). Runs in /host, the shared output directory,
# where the host wrote attach.env: NQN, ADDR, SVC and UUID from `nvpool attach`.
ask() {   # ask ACTION: the host performs it and answers with done-ACTION
    touch /host/req-$1
    wait_for 60 test -f /host/done-$1 || fail "the host did not $1"
}
connect() {
    . /host/attach.env
    nvme connect -t tcp -a $ADDR -s $SVC -n $NQN -i 2 || fail "nvme connect with what attach returned"
    wait_for 20 ctrl_of $NQN >/dev/null || fail "no live controller for $NQN"
    D=/dev/$(ctrl_of $NQN)n1
    wait_for 20 test -b $D || fail "no block device $D"
}
FIO="--name=vol --filename=\$D --direct=1 --ioengine=io_uring --rw=randwrite \
     --bssplit=4k/40:64k/30:128k/30 --iodepth=16 --size=64m --randseed=77 --verify=crc32c --verify_fatal=1"

step "connect with the paths from nvpool attach; the namespace is the volume"
cat /host/attach.env
connect
nvme ns-descs $D | tee ns-descs.txt
grep -qi "uuid.*$UUID" ns-descs.txt || fail "the namespace UUID is not the volume's ($UUID)"
nvme id-ns $D | grep -E "^(nsze|flbas)"

step "fio randwrite with crc32c verify"
eval fio $FIO --do_verify=1 --output=fio-write.txt || fail "fio write+verify"
grep -E "err=|write:|read:" fio-write.txt
grep -q "err= 0" fio-write.txt || fail "fio reported errors"
nvme disconnect -n $NQN || fail "disconnect"

step "nvpool detach: the host is refused"
ask detach
if nvme connect -t tcp -a $ADDR -s $SVC -n $NQN -i 1 2>connect-refused.txt; then
    fail "a detached host could connect"
fi
cat connect-refused.txt
echo "refused, as it should be"

step "nvpool attach again: the data is intact"
ask attach
connect
eval fio $FIO --verify_only=1 --output=fio-verify.txt || fail "fio verify"
grep -E "err=|read:" fio-verify.txt | head -3
grep -q "err= 0" fio-verify.txt || fail "fio reported errors on verify"
nvme disconnect -n $NQN
echo
echo "ALL STEPS PASSED"
