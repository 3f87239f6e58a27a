# Guest side of multipath-e2e (busybox sh), in /host. Env: NQN, PORT_A, PORT_B, PORT_O,
# A_FLIPPED (the state A's path takes in the flip).
# The engines are at 10.0.2.2; the host side carries out each fault the guest asks for.
T=10.0.2.2
# The hidden per-path block device (nvmeXcYnZ) of the controller connected to PORT.
path_of() {
    for c in /sys/class/nvme/nvme*; do
        case $(cat "$c/address") in *trsvcid=$1,*|*trsvcid=$1)
            for d in "$c"/nvme*c*n1; do [ -e "$d" ] && { basename "$d"; return 0; }; done ;;
        esac
    done
    return 1
}
# The controller (nvmeN) connected to PORT.
ctrl_on() {
    for c in /sys/class/nvme/nvme*; do
        case $(cat "$c/address") in *trsvcid=$1,*|*trsvcid=$1) echo "${c##*/}"; return 0 ;; esac
    done
    return 1
}
ios() { awk '{print $5}' "/sys/block/$1/stat"; }   # writes completed on a path
show() {
    echo "$1: A $PA ($(cat /sys/block/$PA/ana_state 2>/dev/null || echo gone)) $(ios $PA 2>/dev/null) writes," \
         "B $PB ($(cat /sys/block/$PB/ana_state)) $(ios $PB) writes, O $PO ($(cat /sys/block/$PO/ana_state)) $(ios $PO) writes"
}
others() { echo $(( $(ios $PB) + $(ios $PO) )); }   # writes on the non-optimized paths
grows() {   # grows WHERE COUNTER...: the writes COUNTER counts go up within 2 s
    where=$1; shift
    before=$("$@"); sleep 2; after=$("$@")
    [ "$after" -gt "$before" ] || fail "no writes $where"
}
fault() {   # fault NAME: the host carries it out
    kill -0 $FIO 2>/dev/null || fail "fio finished before the fault $1: make its job longer"
    touch /host/req-$1
    wait_for 30 test -f /host/done-$1 || fail "the host did not carry out $1"
    sleep 4
}

step "connect three paths; native multipath makes one block device"
for port in $PORT_A $PORT_B $PORT_O; do
    nvme connect -t tcp -a $T -s $port -n $NQN --reconnect-delay=1 || fail "nvme connect to $port"
    wait_for 20 path_of $port >/dev/null || fail "no path through $port"
done
PA=$(path_of $PORT_A); PB=$(path_of $PORT_B); PO=$(path_of $PORT_O)
HEAD=/dev/${PA%%c*}n1
wait_for 20 test -b $HEAD || fail "no multipath block device"
wait_for 20 sh -c "grep -q '^optimized' /sys/block/$PA/ana_state" || fail "A is not optimized"
nvme list-subsys $HEAD | tee list-subsys-before.txt
grep -q "trsvcid=$PORT_A.* optimized" list-subsys-before.txt || fail "A is not listed optimized"
grep -q "trsvcid=$PORT_B.* non-optimized" list-subsys-before.txt || fail "B is not listed non-optimized"
grep -q "trsvcid=$PORT_O.* non-optimized" list-subsys-before.txt || fail "O is not listed non-optimized"
n=$(ls /sys/block | grep -c '^nvme[0-9]*n[0-9]*$')
[ "$n" = 1 ] || fail "$n NVMe block devices: expected one for both paths"
echo "paths of $HEAD: $PA -> $PORT_A (proxy A), $PB -> $PORT_B (proxy B), $PO -> $PORT_O (owner)"
for c in /sys/class/nvme/nvme*; do echo "${c##*/}: cntlid $(cat $c/cntlid) $(cat $c/address)"; done
for port in $PORT_A $PORT_B $PORT_O; do
    echo "ANA log through $port: $(nvme ana-log /dev/$(ctrl_on $port) | grep -E "grpid|state|nsid" | tr -d '\t' | paste -sd ' ')"
done

step "the verify pass that follows the faults fails on lost writes"
verify_written_catches_lost_writes

step "fio writes and verifies through $HEAD while the paths change"
# A cap on the writes' rate keeps them going across all the faults; they stop after the
# last one, and every write that completed is read back and verified.
MPATH_JOB="--name=mpath --filename=$HEAD --rw=randwrite --bs=4k --ioengine=io_uring --direct=1 --size=160m
    --verify=crc32c --verify_fatal=1 --randseed=7 --eta=never"
fio_across_path_faults $MPATH_JOB --iodepth=8 --rate_iops=,600 --trigger-file=$FIO_STOP --output=fio.txt &
FIO=$!
sleep 6
show "before the faults"

fault flip
show "after A $A_FLIPPED, B optimized"
grep -q "^$A_FLIPPED" /sys/block/$PA/ana_state || fail "A's path is not $A_FLIPPED"
grep -q '^optimized' /sys/block/$PB/ana_state || fail "B's path is not optimized"
grows "on B after the flip" ios $PB

fault flip-back
show "after the flip back"
grows "on A after the flip back" ios $PA

fault kill
show "after SIGKILL of A"
grows "on B or O after A was killed" others

fault restart
wait_for 30 sh -c "grep -q live /sys/class/nvme/$(ctrl_on $PORT_A)/state" || fail "the host did not reconnect to A"
wait_for 30 sh -c "grep -q '^optimized' /sys/block/$PA/ana_state" || fail "A is not optimized again"
sleep 2
show "after A came back"
grows "on A after it came back" ios $PA

fault unlisten
show "after A's listener was removed"
grows "on B or O after A's listener was removed" others

touch $FIO_STOP
wait $FIO
frc=$?
grep -E "err=|write:" fio.txt | head -3
[ $frc = 0 ] && grep -q "err= 0" fio.txt || fail "fio reported errors (rc $frc)"
verify_written fio.txt verify.txt $MPATH_JOB
dmesg | grep -iE "I/O error|failing I/O|critical" && fail "the kernel logged I/O errors"
nvme list-subsys $HEAD | tee list-subsys-after.txt
nvme disconnect -n $NQN >/dev/null
echo "ALL STEPS PASSED"
