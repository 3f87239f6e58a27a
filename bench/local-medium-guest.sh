# Guest side of bench/local-medium (busybox sh), in /host: the same file on tmpfs and
# on ext4 on the virtio disk /dev/vda, each read raw and through the engine's ublk
# device. Env: ROUNDS. Appends "MEDIUM PATH DEPTH IOPS MEAN_US" lines
# to /host/raw.txt.
BIN=/host/bin
SOCK=/tmp/engine.sock
NQN=nqn.2024-01.io.nvpool:local-medium
modprobe ublk_drv || fail "no ublk_drv module"
echo "kernel $(uname -r)"
mkfs.ext4 -q -F /dev/vda || fail "mkfs.ext4 on /dev/vda"
mkdir -p /mnt/disk && mount /dev/vda /mnt/disk || fail "mount /dev/vda"
dd if=/dev/urandom of=/mnt/disk/vol.img bs=1M count=256 oflag=direct 2>/dev/null || fail "filling the disk's file"
dd if=/dev/urandom of=/tmp/vol.img bs=1M count=256 2>/dev/null || fail "filling the tmpfs file"
# ext4 on this disk writes 512 bytes atomically: the engine refuses 4 KiB blocks there
# unless told that torn writes are acceptable, which they are for a read benchmark.
cat > /tmp/engine.toml <<TOML
reactors = 2
busy_poll_us = 0
management_socket = "$SOCK"
[[listener]]
address = "127.0.0.1:4420"
[[subsystem]]
nqn = "$NQN"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "file:/tmp/vol.img"
block_size = 4096
[[subsystem.namespace]]
nsid = 2
backend = "file:/mnt/disk/vol.img"
block_size = 4096
allow_torn_writes = true
TOML
start_engine /tmp/engine.toml /host/engine.log
for nsid in 1 2; do
    timeout 60 $BIN/nvpool engine local add $NQN/$nsid --ublk --id $((nsid - 1)) --socket $SOCK \
        || fail "local add $nsid"
done
wait_for 10 test -b /dev/ublkb1 || fail "no /dev/ublkb1"
timeout 60 $BIN/nvpool engine local list --socket $SOCK | tee /tmp/local-list.txt
[ "$(grep -c 'zero copy' /tmp/local-list.txt)" = 2 ] && echo "data path: zero copy" || echo "data path: copy"
run() {   # run MEDIUM PATH FILE DEPTH
    fio --name=$1-$2 --filename=$3 --ioengine=io_uring --direct=1 --rw=randread --bs=4k --iodepth=$4 \
        --size=64M --runtime=4 --time_based --output-format=terse --terse-version=3 > /tmp/terse.txt 2>/dev/null \
        || fail "fio on $3"
    echo "$1 $2 $4 $(cut -d';' -f8 /tmp/terse.txt) $(cut -d';' -f40 /tmp/terse.txt)" | tee -a /host/raw.txt
}
for r in $(seq $ROUNDS); do
    # Each round starts with the other path, so drift falls on both.
    case $((r % 2)) in
        1) order="raw ublk" ;;
        0) order="ublk raw" ;;
    esac
    for qd in 1 32; do
        for p in $order; do
            case $p in
                raw) run tmpfs raw /tmp/vol.img $qd; run disk raw /mnt/disk/vol.img $qd ;;
                ublk) run tmpfs ublk /dev/ublkb0 $qd; run disk ublk /dev/ublkb1 $qd ;;
            esac
        done
    done
done
echo "ALL STEPS PASSED"
