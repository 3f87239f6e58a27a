# Guest side of bench/rdma (busy-box sh), in /host: 4 KiB random reads on one RAM disk
# through the engine over RDMA and over TCP, and through the kernel's nvmet-rdma, in
# alternating rounds. Env: ROUNDS. Appends "TARGET DEPTH IOPS MEAN_US" lines to
# /host/raw.txt.
BIN=/host/bin
SOCK=/tmp/engine.sock
IP=192.168.77.1
NQN=nqn.2024-01.io.nvpool:bench-rdma
modprobe crc32_generic 2>/dev/null
modprobe -a rdma_rxe ib_uverbs rdma_ucm nvme-rdma nvmet-rdma dummy || fail "RDMA modules"
[ -e /sys/class/net/dummy0 ] || ip link add dummy0 type dummy
ip addr add $IP/24 dev dummy0 && ip link set dummy0 up && rdma link add rxe0 type rxe netdev dummy0 || fail "soft-RoCE"
modprobe -r brd; modprobe brd rd_nr=1 rd_size=262144 || fail "brd"
dd if=/dev/urandom of=/dev/ram0 bs=1M count=64 2>/dev/null
cat > /tmp/engine.toml <<TOML
reactors = 2
busy_poll_us = ${BUSY_POLL_US:-0}
management_socket = "$SOCK"
[[listener]]
address = "$IP:4420"
transport = "rdma"
[[listener]]
address = "$IP:4420"
[[subsystem]]
nqn = "$NQN"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "file:/dev/ram0"
TOML
start_engine /tmp/engine.toml /host/engine.log
K=/sys/kernel/config/nvmet
S=$K/subsystems/$NQN.nvmet
mkdir $S && echo 1 > $S/attr_allow_any_host
mkdir $S/namespaces/1 && echo /dev/ram0 > $S/namespaces/1/device_path && echo 1 > $S/namespaces/1/enable
mkdir $K/ports/1 && echo rdma > $K/ports/1/addr_trtype && echo ipv4 > $K/ports/1/addr_adrfam \
    && echo $IP > $K/ports/1/addr_traddr && echo 4421 > $K/ports/1/addr_trsvcid || fail "nvmet-rdma port"
ln -s $S $K/ports/1/subsystems/
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
