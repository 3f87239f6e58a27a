# Guest side of replica-e2e (busybox sh). Runs in /host, the shared output directory.
# attach.env names each volume's NQN and its paths' ports (the optimized first); the
# engines are at 10.0.2.2.
T=10.0.2.2
. /host/attach.env
head_of() {   # head_of NQN: the multipath block device of the subsystem
    for s in /sys/class/nvme-subsystem/nvme-subsys*; do
        [ "$(cat $s/subsysnqn 2>/dev/null)" = "$1" ] || continue
        ls $s | grep -m1 '^nvme[0-9]*n1$' && return 0
    done
    return 1
}
connect_paths() {   # connect_paths NQN PORTS...: every path, one block device
    nqn=$1; shift
    for port in "$@"; do
        nvme connect -t tcp -a $T -s $port -n $nqn --reconnect-delay=1 > /dev/null || fail "nvme connect $nqn at $port"
    done
    wait_for 20 head_of $nqn > /dev/null || fail "no block device for $nqn"
    dev=/dev/$(head_of $nqn)
    wait_for 20 test -b $dev || fail "no block device $dev"
}
fault() {   # fault NAME SECONDS: the host carries it out
    touch /host/req-$1
    wait_for $2 test -f /host/done-$1 || fail "the host did not carry out $1"
}
during_fio() {   # during_fio NAME SECONDS: a fault while both volumes' writers run
    kill -0 $F2 2>/dev/null && kill -0 $F3 2>/dev/null || fail "fio finished before $1: make its job longer"
    echo "$(cut -d' ' -f1 /proc/uptime) $1" >> faults.txt
    fault "$@"
}
# Writes of every size with crc32c in each block, on each volume.
# Paced (a job ends when the faults are over: --trigger-file), so that it outlasts them.
JOB="--direct=1 --ioengine=io_uring --rw=randwrite --bssplit=4k/30:16k/20:64k/20:128k/30 \
     --verify=crc32c --verify_fatal=1 --size=192m --iodepth=8 --rate=,2m"
JOB2="--name=r2 --filename=\$D2 --randseed=22 $JOB"
JOB3="--name=r3 --filename=\$D3 --randseed=33 $JOB"
cd /tmp
rm -f $FIO_STOP-*

step "r2 (2 replicas) and r3 (3 replicas): every path of each"
connect_paths $NQN_R2 $PORTS_R2
D2=$dev
connect_paths $NQN_R3 $PORTS_R3
D3=$dev
nvme list-subsys $D2
nvme list-subsys $D3

step "fio writes both; a replica's engine is killed, comes back and is rebuilt; the serving node is lost"
eval fio_across_path_faults $JOB2 --trigger-file=$FIO_STOP-r2 --output=written-r2.txt &
F2=$!
eval fio_across_path_faults $JOB3 --trigger-file=$FIO_STOP-r3 --output=written-r3.txt &
F3=$!
# A 4 KiB write at a time, apart from the verified ones: the longest it waits is what
# a fault costs an application (the host's default settings).
fio_across_path_faults --name=probe --filename=$D2 --offset=200m --size=8m --rw=write --bs=4k --direct=1 \
    --ioengine=psync --rate_iops=50 --time_based --runtime=3600 --trigger-file=$FIO_STOP-probe \
    --write_lat_log=probe --log_avg_msec=0 --per_job_logs=0 --output=probe.txt &
PROBE=$!
sleep 4
during_fio kill-replica 120
sleep 4
during_fio back 400
sleep 2
during_fio kill-serving 120
sleep 4
# fio removes its trigger file when it stops: one each.
touch $FIO_STOP-r2 $FIO_STOP-r3 $FIO_STOP-probe
for job in $F2:r2 $F3:r3; do
    wait ${job%%:*} || { cat written-${job#*:}.txt; fail "fio write on ${job#*:}"; }
    grep -E "err=|write:" written-${job#*:}.txt | head -2
    grep -q "err= 0" written-${job#*:}.txt || { cat written-${job#*:}.txt; fail "fio saw an error on ${job#*:}"; }
done
wait $PROBE
grep -q "err= 0" probe.txt || { cat probe.txt; fail "the probe saw an error"; }
cat faults.txt
# The longest waits of the probe's writes (ms), with when they completed (ms after it started).
sort -t, -k2 -n -r probe_clat.log | head -3 | awk -F, '{printf "probe write waited %.0f ms (done at %d ms)\n", $2 / 1e6, $1}' | tee /host/probe-waits.txt
no_oops "during the faults"

step "every write verifies, on both volumes"
eval verify_written written-r2.txt verified-r2.txt $JOB2
eval verify_written written-r3.txt verified-r3.txt $JOB3
rm -f $FIO_STOP-*

step "node a comes back: its replicas are rebuilt in full"
fault return 400
fio_verify in-sync-r2 $D2
fio_verify in-sync-r3 $D3

step "each volume's replicas read back identical"
for d in $D2 $D3; do nvme flush $d -n 1 || fail "nvme flush $d"; done
# A subsystem the host let go of lingers a moment; one connected again meanwhile
# gets no block device.
gone() { ! ls /sys/class/nvme-subsystem/ 2>/dev/null | grep -q .; }
nvme disconnect -n $NQN_R2 > /dev/null || fail "disconnect r2"
nvme disconnect -n $NQN_R3 > /dev/null || fail "disconnect r3"
wait_for 30 gone || fail "the host keeps the volumes' subsystems"
fault freeze 60
# One export at a time: the replicas carry one identity, which the host refuses to
# see twice at once ("globally duplicate IDs").
while read volume nqn port node; do
    nvme connect -t tcp -a $T -s $port -n $nqn > /dev/null || fail "connect the replica of $volume on $node"
    wait_for 20 ctrl_of $nqn > /dev/null || fail "no live controller for $nqn"
    wait_for 20 head_of $nqn > /dev/null || { nvme list-subsys; ls -R /sys/class/nvme-subsystem/; fail "no block device for $nqn"; }
    dev=/dev/$(head_of $nqn)
    wait_for 20 test -b $dev || fail "no block device $dev"
    echo "$volume $(md5sum < $dev | cut -d' ' -f1) $node" | tee -a sums.txt
    nvme disconnect -n $nqn > /dev/null || fail "disconnect $nqn"
    wait_for 30 gone || fail "the host keeps $nqn"
done < /host/replicas.env
for volume in r2 r3; do
    n=$(grep "^$volume " sums.txt | cut -d' ' -f2 | sort -u | wc -l)
    [ "$n" = 1 ] || fail "the replicas of $volume differ"
done
no_oops "at the end"
echo
echo "ALL STEPS PASSED"
