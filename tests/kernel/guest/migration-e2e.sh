# Guest side of migration-e2e (busybox sh), in /host. Env: NQN, PORT_A, PORT_B,
# CONTROLLER (the nvpool controller, for the CSI node plugin).
# The engines are at 10.0.2.2; the host side moves the volume when asked.
T=10.0.2.2
# The controller (nvmeN) connected to PORT.
ctrl_on() {
    for c in /sys/class/nvme/nvme*; do
        case $(cat "$c/address") in *trsvcid=$1,*|*trsvcid=$1) echo "${c##*/}"; return 0 ;; esac
    done
    return 1
}
# The hidden per-path block device (nvmeXcYnZ) of the controller connected to PORT.
path_of() {
    c=$(ctrl_on $1) || return 1
    for d in /sys/class/nvme/$c/nvme*c*n1; do [ -e "$d" ] && { basename "$d"; return 0; }; done
    return 1
}
state_of() { cat /sys/class/nvme/$(ctrl_on $1)/state 2>/dev/null || echo gone; }
ana_of() { cat /sys/block/$(path_of $1)/ana_state 2>/dev/null || echo none; }
move() {   # move NAME [PORT]: the host moves the volume; the CSI node plugin connects PORT's new path
    touch /host/req-$1
    if [ -n "$2" ]; then
        # The old path is gone since the last move (its subsystem vanished); nvpool's
        # CSI node plugin connects the target's, which the controller lists as a path.
        wait_for 120 ctrl_on $2 >/dev/null || { cat /host/csi-node.log; fail "no new path through $2"; }
        echo "the CSI node plugin connected the new path through $2: $(state_of $2)"
    fi
    wait_for 600 test -f /host/done-$1 || fail "the host did not finish $1"
    for f in /host/fail-*; do [ -e "$f" ] && fail "$(cat "$f")"; done
    return 0
}
# Only the path through PORT is live and optimized; the other one is not live.
only_live() {   # only_live PORT OTHER_PORT
    wait_for 30 sh -c "grep -q '^optimized' /sys/block/$(path_of $1)/ana_state" || fail "the path through $1 is not optimized"
    [ "$(state_of $1)" = live ] || fail "the path through $1 is $(state_of $1)"
    wait_for 30 sh -c "[ \"\$(cat /sys/class/nvme/$(ctrl_on $2)/state 2>/dev/null)\" != live ]" ||
        fail "the path through $2 is still live"
    nvme list-subsys $HEAD
    echo "path through $1: $(state_of $1), $(ana_of $1); path through $2: $(state_of $2)"
}

step "connect both paths; native multipath makes one block device"
for port in $PORT_A $PORT_B; do
    nvme connect -t tcp -a $T -s $port -n $NQN --reconnect-delay=1 || fail "nvme connect to $port"
    wait_for 20 path_of $port >/dev/null || fail "no path through $port"
done
HEAD=/dev/$(path_of $PORT_A | sed 's/c[0-9]*n/n/')
wait_for 20 test -b $HEAD || fail "no multipath block device"
wait_for 20 sh -c "grep -q '^optimized' /sys/block/$(path_of $PORT_A)/ana_state" || fail "A is not optimized"
nvme list-subsys $HEAD
[ "$(ls /sys/block | grep -c '^nvme[0-9]*n[0-9]*$')" = 1 ] || fail "more than one NVMe block device"

step "fio writes and verifies through $HEAD while the volume moves from A to B"
# The writes' rate keeps them going across the move; they stop a few seconds after it
# (the old path gone, writes landing on B), and every write that completed is then
# read back from B and verified.
# Every write's latency is logged (ms since fio started, latency in ns), so the
# latencies around the move can be told from the rest.
MIG_JOB="--name=mig --filename=$HEAD --rw=randwrite --bs=4k --ioengine=io_uring --direct=1 --size=96m
    --verify=crc32c --verify_fatal=1 --randseed=11 --eta=never"
uptime_ms() { awk '{printf "%d", $1 * 1000}' /proc/uptime; }
T0=$(uptime_ms)
fio_across_path_faults $MIG_JOB --iodepth=8 --rate_iops=,500 --trigger-file=$FIO_STOP \
    --write_lat_log=lat --log_avg_msec=0 --output=fio.txt &
FIO=$!
sleep 8
kill -0 $FIO 2>/dev/null || fail "fio ended before the move"
MOVE_FROM=$(( $(uptime_ms) - T0 ))
move migrate
MOVE_TO=$(( $(uptime_ms) - T0 ))
kill -0 $FIO 2>/dev/null || fail "fio's writes ended before the move did: make its job longer"
only_live $PORT_B $PORT_A
sleep 3
touch $FIO_STOP
wait $FIO
frc=$?
grep -E "err=|write:|lat \(|clat \(" fio.txt | head -6
[ $frc = 0 ] && grep -q "err= 0" fio.txt || fail "fio reported errors (rc $frc)"
# Writes (direction 1) in the clat log: the slowest during the move (from the request
# to the end of the old owner's retirement) against the slowest before and after.
awk -F', *' -v from=$MOVE_FROM -v to=$MOVE_TO '$3 == 1 {
        if ($1 >= from && $1 <= to) { n++; if ($2 > during) { during = $2; at = $1 } }
        else if ($2 > outside) outside = $2 }
    END { printf "writes during the move (%d of them, %.1f s): slowest %.1f ms at %.1f s; slowest before or after: %.1f ms\n",
                 n, (to - from) / 1000, during / 1e6, at / 1000, outside / 1e6 }' lat_clat.1.log

step "a re-read from B verifies every write, and the whole device reads"
verify_written fio.txt reread.txt $MIG_JOB
dd if=$HEAD of=/dev/null bs=1M 2>dd.txt || fail "reading the whole device failed: $(cat dd.txt)"
tail -1 dd.txt

step "ext4: files checksummed, then moved back to A while more are written"
# The CSI node plugin, with the volume recorded as staged on this device (as NodeStage
# records it), follows the volume's paths.
mkdir -p /tmp/csi-state && printf '%s\n%s\n' "$NQN" "$HEAD" > /tmp/csi-state/mig.staged
/host/nvpool csi --mode node --endpoint unix:///tmp/csi.sock --controller $CONTROLLER --node-name guest \
    --host-nqn $NVME_HOSTNQN --state-dir /tmp/csi-state > /host/csi-node.log 2>&1 &
mkfs.ext4 -q -F $HEAD || fail "mkfs.ext4"
mkdir -p /mnt && mount $HEAD /mnt || fail "mount"
i=0
while [ $i -lt 16 ]; do dd if=/dev/urandom of=/mnt/before-$i bs=1M count=4 2>/dev/null; i=$((i + 1)); done
sync
md5sum /mnt/before-* > sums.txt
( i=0; while [ $i -lt 40 ]; do
      dd if=/dev/urandom of=/mnt/during-$i bs=256k count=8 conv=fsync 2>/dev/null || exit 1
      md5sum /mnt/during-$i >> sums.txt
      i=$((i + 1)); sleep 0.3
  done ) &
WRITER=$!
sleep 2
move migrate-back $PORT_A
wait $WRITER || fail "writing files during the move failed"
only_live $PORT_A $PORT_B
sync
umount /mnt
e2fsck -fn $HEAD > fsck.txt 2>&1 || { cat fsck.txt; fail "the filesystem does not check clean"; }
tail -1 fsck.txt
echo 3 > /proc/sys/vm/drop_caches
mount $HEAD /mnt || fail "mount after the move"
md5sum -c sums.txt > md5.txt 2>&1 || { grep -v ': OK' md5.txt; fail "checksums differ after the move"; }
echo "$(grep -c ': OK' md5.txt) files match their checksums"
umount /mnt

dmesg | grep -iE "I/O error|failing I/O|critical" && fail "the kernel logged I/O errors"
nvme disconnect -n $NQN >/dev/null
echo "ALL STEPS PASSED"
