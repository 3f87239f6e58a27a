# Guest side of replica-e2e (busybox sh). Runs in /host, the shared output directory.
# Env: NQN (the volume, served by A), PORT_A, PORT_B, REPLICA_A and REPLICA_B (each
# engine's replica, exported for the comparison). The engines are at 10.0.2.2.
T=10.0.2.2
connect() {   # connect NQN PORT: sets $dev to the namespace's block device
    nvme connect -t tcp -a $T -s $2 -n $1 -i 2 >&2 || fail "nvme connect $1"
    wait_for 20 ctrl_of $1 > /dev/null || fail "no live controller for $1"
    dev=/dev/$(ctrl_of $1)n1
    wait_for 20 test -b $dev || fail "no block device $dev"
}
# Writes of every size with crc32c in each block (each run adds where and how much).
JOB="--name=replicas --filename=\$D --direct=1 --ioengine=io_uring --rw=randwrite \
     --bssplit=4k/30:16k/20:64k/20:128k/30 --verify=crc32c --verify_fatal=1"
FIRST="--size=96m --randseed=4545"
SECOND="--offset=128m --size=64m --randseed=777"

step "the volume: 2 replicas, served by A"
connect $NQN $PORT_A
D=$dev
nvme id-ns $D | grep -E "^(nsze|nmic)"
cd /tmp

step "fio writes; B's engine is SIGKILLed while it runs, and A serves the volume alone"
eval fio_across_path_faults $JOB $FIRST --iodepth=16 --trigger-file=$FIO_STOP --output=written.txt &
FIO=$!
sleep 3
touch /host/req-kill
wait_for 120 test -f /host/done-kill || fail "the host did not serve the volume without B"
sleep 3   # writes go on with one replica
touch $FIO_STOP
wait $FIO || { cat written.txt; fail "fio write"; }
grep -E "err=|write:" written.txt | head -2
grep -q "err= 0" written.txt || { cat written.txt; fail "fio saw an error while a replica was lost"; }
no_oops "when a replica was lost"

step "every write verifies"
eval verify_written written.txt verified.txt $JOB $FIRST
rm -f $FIO_STOP

step "B comes back; A copies to it what changed while it was away, while fio writes"
eval fio_across_path_faults $JOB $SECOND --iodepth=8 --trigger-file=$FIO_STOP --output=written-2.txt &
FIO=$!
sleep 2
touch /host/req-back
wait_for 300 test -f /host/done-back -o -f /host/failed-back || fail "the rebuild did not end"
[ -f /host/done-back ] || fail "the rebuild failed: $(cat /host/rebuild.json)"
cat /host/rebuild.json; echo
touch $FIO_STOP
wait $FIO || { cat written-2.txt; fail "fio write during the rebuild"; }
grep -q "err= 0" written-2.txt || { cat written-2.txt; fail "fio saw an error during the rebuild"; }
eval verify_written written-2.txt verified-2.txt $JOB $SECOND
rm -f $FIO_STOP

step "both replicas in sync: fio writes and verifies through both, then they compare equal"
fio_verify in-sync $D
nvme flush $D -n 1 || fail "nvme flush"
nvme disconnect -n $NQN > /dev/null || fail "disconnect $NQN"
# The two exports carry one identity, which the host refuses to see twice at once
# ("globally duplicate IDs"): each replica is read on its own.
sum_of() {   # sum_of NQN PORT: the md5 of the whole replica
    connect $1 $2
    md5sum < $dev | cut -d' ' -f1 > /tmp/sum-$1 || fail "read $1"
    nvme disconnect -n $1 > /dev/null || fail "disconnect $1"
    cat /tmp/sum-$1
}
SUM_A=$(sum_of $REPLICA_A $PORT_A)
SUM_B=$(sum_of $REPLICA_B $PORT_B)
echo "A's replica: $SUM_A, B's replica: $SUM_B"
[ -n "$SUM_A" ] && [ "$SUM_A" = "$SUM_B" ] || fail "the replicas differ"
no_oops "at the end"
echo
echo "ALL STEPS PASSED"
