# Guest side of bench/rdma (busy-box sh), in /host: 4 KiB random reads on one RAM disk
# through the engine over RDMA and over TCP, and through the kernel's nvmet-rdma, in
# alternating rounds. Env: ROUNDS. Appends "TARGET DEPTH IOPS MEAN_US" lines to
# /host/raw.txt.
BIN=/host/bin
SOCK=/tmp/engine.sock
IP=$RDMA_IP
NQN=nqn.2024-01.io.nvpool:bench-rdma
soft_roce
dd if=/dev/urandom of=/dev/ram0 bs=1M count=64 2>/dev/null
rdma_engine_config /tmp/engine.toml $NQN ${BUSY_POLL_US:-0}
start_engine /tmp/engine.toml /host/engine.log
nvmet_rdma $NQN.nvmet 4421
run() {   # run NAME TRANSPORT PORT SUBSYSTEM
    timeout 60 nvme connect -t $2 -a $IP -s $3 -n $4 > /dev/null || fail "connect $1"
    wait_for 10 sh -c 'ls /dev/nvme*n1 > /dev/null 2>&1' || fail "no device for $1"
    dev=$(ls /dev/nvme*n1 | head -1)
    for qd in 1 32; do
        fio --name=$1 --filename=$dev --ioengine=io_uring --direct=1 --rw=randread --bs=4k --iodepth=$qd \
            --size=64M --runtime=4 --time_based --output-format=terse --terse-version=3 > /tmp/terse.txt 2>/dev/null \
            || fail "fio on $1"
        echo "$1 $qd $(cut -d';' -f8 /tmp/terse.txt) $(cut -d';' -f40 /tmp/terse.txt)" | tee -a /host/raw.txt
    done
    nvme disconnect -n $4 > /dev/null
    wait_for 10 sh -c '! ls /dev/nvme*n1 > /dev/null 2>&1'
}
for r in $(seq $ROUNDS); do
    # Each round starts with another target, so drift falls on all three.
    case $((r % 3)) in
        1) order="engine-rdma engine-tcp nvmet-rdma" ;;
        2) order="engine-tcp nvmet-rdma engine-rdma" ;;
        0) order="nvmet-rdma engine-rdma engine-tcp" ;;
    esac
    for t in $order; do
        case $t in
            engine-rdma) run $t rdma 4420 $NQN ;;
            engine-tcp) run $t tcp 4420 $NQN ;;
            nvmet-rdma) run $t rdma 4421 $NQN.nvmet ;;
        esac
    done
done
echo "ALL STEPS PASSED"
