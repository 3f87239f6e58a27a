# Guest side of cluster-e2e (busybox sh). Runs in /host, the shared output directory,
# where the host wrote attach.env: NQN, ADDR, SVC and UUID from `nvpool attach`.
ask() {   # ask ACTION: the host performs it and answers with done-ACTION
    touch /host/req-$1
    wait_for 60 test -f /host/done-$1 || fail "the host did not $1"
}
connect() {   # connect [NVME-CONNECT-ARGS...]
    . /host/attach.env
    nvme connect -t tcp -a $ADDR -s $SVC -n $NQN -i 2 "$@" || fail "nvme connect with what attach returned"
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

step "nvpool attach --dhchap: refused without the secrets, the data intact with them"
ask attach-dhchap
. /host/attach.env
[ -n "$SECRET" ] && [ -n "$CTRL_SECRET" ] || fail "attach --dhchap printed no secrets"
echo "secrets from attach: $(echo $SECRET | cut -c1-10)... and $(echo $CTRL_SECRET | cut -c1-10)..."
if nvme connect -t tcp -a $ADDR -s $SVC -n $NQN -i 1 2>connect-nokey.txt; then
    fail "a host without its secret could connect"
fi
cat connect-nokey.txt
echo "--- dhchap" > /dev/kmsg
connect --dhchap-secret=$SECRET --dhchap-ctrl-secret=$CTRL_SECRET
dmesg | sed -n '/--- dhchap$/,$p' | grep -E 'authenticated' || fail "the kernel did not authenticate"
eval fio $FIO --verify_only=1 --output=fio-verify-dhchap.txt || fail "fio verify"
grep -q "err= 0" fio-verify-dhchap.txt || fail "fio reported errors on verify"
echo "fio verify over the authenticated connection: no errors"
nvme disconnect -n $NQN
echo
echo "ALL STEPS PASSED"
