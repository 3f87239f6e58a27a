# Helpers for the guest scripts; run-guest puts them in front of every script.
step() { echo; echo "=== [$(date +%T)] $*"; }
fail() { echo "FAIL: $*"; dmesg | tail -30; exit 1; }
wait_for() {   # wait_for SECONDS TEST...
    n=$(( $1 * 10 )); shift
    while [ $n -gt 0 ]; do "$@" && return 0; sleep 0.1; n=$((n - 1)); done
    return 1
}
# Fails if the kernel oopsed: a driver bug our timing can trigger must not pass unseen.
no_oops() {   # no_oops WHEN
    dmesg | grep -qE 'BUG:|Oops' && { dmesg | grep -A12 -E 'BUG:|Oops' | head -40; fail "the kernel oopsed $1"; }
    return 0
}
# The live controller device (nvmeN) connected to subsystem $1.
ctrl_of() {
    for c in /sys/class/nvme/nvme*; do
        [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$1" ] && [ "$(cat "$c/state")" = live ] && { basename "$c"; return 0; }
    done
    return 1
}
# fio for runs during which a path breaks. The kernel's nvme-tcp host sends a command
# straight from the submitting task when it can, without MSG_NOSIGNAL, so a send that
# meets a connection the host is tearing down raises SIGPIPE in fio itself (seen as
# "fio: pid=N, got signal=13" and a lost job). The I/O is failed over and completes;
# only the signal is wrong. Databases ignore SIGPIPE, and so does fio here.
fio_across_path_faults() { ( trap '' PIPE; exec fio "$@" ); }
# Writes that must span a series of faults last as long as the faults, no longer: the
# job runs with --trigger-file=$FIO_STOP, and the script creates that file once the
# faults are over. fio then stops and saves which writes completed (its verify state,
# in the working directory), and a --verify_only run of the same job with
# --verify_state_load=1 reads back exactly those (verify_written). A job sized to
# outlast the faults went on writing long after them, and its verify pass read all of
# that back: under emulation, the larger part of the scenario.
FIO_STOP=/tmp/fio-stop
rm -f "$FIO_STOP"   # a file left by an earlier script would stop the job at its start
# Reads back and verifies every write that the stopped job JOB... issued, at depth 8.
# A verify-only run replays the job's offsets in order; stopped when its state says,
# reads in flight past the last completed write met blocks never written (seen: 7
# blocks of zeros at depth 16), which is why the pass once ran at depth 1 (a quarter
# of the multipath scenarios' time). fio reaps every write it issued before it exits,
# so --number_ios with the write job's issued count (its report, WRITTEN) bounds the
# pass to writes that all completed, at any depth. It must read all but the last few
# of them (those in flight when the job stopped, which its state may leave out):
# a pass that read less proves less.
verify_written() {   # verify_written WRITTEN OUTPUT JOB...
    written=$1 out=$2; shift 2
    issued=$(sed -n 's/.*issued rwts: total=[0-9]*,\([0-9]*\),.*/\1/p' $written)
    [ -n "$issued" ] || { cat $written; fail "no count of issued writes in $written"; }
    fio_across_path_faults "$@" --iodepth=8 --number_ios=$issued --verify_only --verify_state_load=1 --output=$out
    vrc=$?
    grep -E "err=|read:" $out | head -2
    [ $vrc = 0 ] && grep -q "err= 0" $out || { cat $out; fail "the writes did not verify (rc $vrc)"; }
    read_back=$(sed -n 's/.*issued rwts: total=\([0-9]*\),.*/\1/p' $out)
    [ "${read_back:-0}" -ge $((issued - 8)) ] || { cat $out; fail "the verify pass read $read_back of $issued writes"; }
    echo "verified $read_back of the $issued writes issued"
}
# The verify pass must catch what it exists to catch: writes that a device lost. A
# job on a scratch file stops, its writes verify; then the file is emptied (every
# block reads as zeros) and the same pass must fail.
verify_written_catches_lost_writes() {
    scratch=/tmp/verify-check
    job="--name=check --filename=$scratch/file --rw=randwrite --bs=4k --ioengine=io_uring --size=8m
        --verify=crc32c --verify_fatal=1 --randseed=3 --eta=never"
    rm -rf $scratch && mkdir -p $scratch && cd $scratch
    truncate -s 8M file
    fio $job --iodepth=8 --rate_iops=,400 --trigger-file=$scratch/stop --output=written.txt &
    # Stopped once it has written (a trigger that fio meets before its first write
    # ends the job with no report).
    written_yet() { ! cmp -s -n 8388608 file /dev/zero; }
    wait_for 60 written_yet || fail "the scratch write job wrote nothing"
    sleep 1   # a few hundred writes
    touch $scratch/stop; wait $! || fail "the scratch write job"
    # A verify pass saves its own state over the write job's: the second pass loads a copy.
    cp local-check-0-verify.state written.state
    ( verify_written written.txt verified.txt $job ) > pass.txt || { cat pass.txt; fail "the scratch writes did not verify"; }
    tail -1 pass.txt
    truncate -s 0 file && truncate -s 8M file
    cp written.state local-check-0-verify.state
    if ( verify_written written.txt lost.txt $job ) > /dev/null 2>&1; then
        fail "the verify pass passed on a file whose writes were lost"
    fi
    cd - > /dev/null && rm -rf $scratch
    echo "the verify pass fails on lost writes, as it must"
}
# 4 KiB random reads for 1 s at one depth on a file or device; appends a line of
# figures (IOPS, mean completion latency) to /host/figures.txt. One second is hundreds
# of reads at depth 1 under emulation and thousands at depth 32: enough for a mean, and
# these figures compare paths side by side, they assert nothing.
measure() {   # measure NAME FILE DEPTH
    fio --name=$1 --filename=$2 --ioengine=io_uring --direct=1 --rw=randread --bs=4k --iodepth=$3 \
        --size=64M --runtime=1 --time_based --output-format=terse --terse-version=3 > /tmp/terse.txt 2>/dev/null \
        || fail "fio on $2"
    # terse v3: field 8 read IOPS, 40 read mean completion latency (us)
    iops=$(cut -d';' -f8 /tmp/terse.txt); lat=$(cut -d';' -f40 /tmp/terse.txt)
    printf '%-15s QD%-3s %8s IOPS  %10s us mean\n' $1 $3 $iops $lat | tee -a /host/figures.txt
}
# Starts the engine of CONFIG (whose management socket is $SOCK) from $BIN, logging
# to LOG, and waits until it answers; ENGINE is its process ID.
start_engine() {   # start_engine CONFIG LOG
    $BIN/nvpool engine --config $1 > $2 2>&1 &
    ENGINE=$!
    wait_for 60 timeout 120 $BIN/nvpool engine subsystem list --socket $SOCK > /dev/null 2>&1 \
        || { cat $2; fail "the engine did not start"; }
}
# fio writes 16 MiB (4 KiB and 64 KiB blocks, depth 8) to a device and verifies it
# (crc32c); fails on any I/O error. Its report goes to /host/fio-NAME.txt.
fio_verify() {   # fio_verify NAME DEVICE
    fio --name=$1 --filename=$2 --ioengine=io_uring --direct=1 --rw=randwrite --bssplit=4k/50:64k/50 \
        --iodepth=8 --size=16M --verify=crc32c --verify_fatal=1 --output=/host/fio-$1.txt \
        || { cat /host/fio-$1.txt; fail "fio $1"; }
    grep -q 'err= 0' /host/fio-$1.txt && ! grep -o 'err= *[0-9]*' /host/fio-$1.txt | grep -qv 'err= *0$' \
        || { cat /host/fio-$1.txt; fail "fio $1 reported errors"; }
}
# NVMe over RDMA inside the guest: soft-RoCE (rdma_rxe) on dummy0 at $RDMA_IP, the
# modules of the kernel's RDMA host and target, and a 256 MiB RAM disk (/dev/ram0) for
# the engine and the kernel's target to serve alike.
RDMA_IP=192.168.77.1
soft_roce() {
    modprobe crc32_generic 2>/dev/null   # Linux 6.12's rdma_rxe needs it; later kernels build it in
    modprobe -a rdma_rxe ib_uverbs rdma_ucm nvme-rdma nvmet-rdma dummy || fail "RDMA modules"
    # Loading dummy makes dummy0.
    [ -e /sys/class/net/dummy0 ] || ip link add dummy0 type dummy
    ip addr add $RDMA_IP/24 dev dummy0 && ip link set dummy0 up || fail "dummy0"
    rdma link add rxe0 type rxe netdev dummy0 || fail "rdma link add"
    modprobe -r brd; modprobe brd rd_nr=1 rd_size=262144 || fail "brd"
}
# Writes an engine configuration that serves subsystem NQN on /dev/ram0 over NVMe/RDMA
# and NVMe/TCP on port 4420 of $RDMA_IP, with two reactors that poll BUSY_POLL_US after
# their last completion; its management socket is $SOCK.
rdma_engine_config() {   # rdma_engine_config FILE NQN BUSY_POLL_US
    cat > $1 <<TOML
reactors = 2
busy_poll_us = $3
management_socket = "$SOCK"
[[listener]]
address = "$RDMA_IP:4420"
transport = "rdma"
[[listener]]
address = "$RDMA_IP:4420"
[[subsystem]]
nqn = "$2"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "file:/dev/ram0"
TOML
}
# Serves /dev/ram0 as subsystem NQN through the kernel's nvmet-rdma on PORT.
nvmet_rdma() {   # nvmet_rdma NQN PORT
    K=/sys/kernel/config/nvmet
    mkdir $K/subsystems/$1 && echo 1 > $K/subsystems/$1/attr_allow_any_host || fail "nvmet subsystem"
    mkdir $K/subsystems/$1/namespaces/1 && echo /dev/ram0 > $K/subsystems/$1/namespaces/1/device_path \
        && echo 1 > $K/subsystems/$1/namespaces/1/enable || fail "nvmet namespace"
    mkdir $K/ports/1 && echo rdma > $K/ports/1/addr_trtype && echo ipv4 > $K/ports/1/addr_adrfam \
        && echo $RDMA_IP > $K/ports/1/addr_traddr && echo $2 > $K/ports/1/addr_trsvcid || fail "nvmet-rdma port"
    ln -s $K/subsystems/$1 $K/ports/1/subsystems/ || fail "nvmet port link"
}
