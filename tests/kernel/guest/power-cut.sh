# Guest side of power-cut (busybox sh), in /host. The engine runs here, on pools of
# virtio disks that the host's cache-disk serves; the kernel host connects to it on
# 127.0.0.1 and crashcheck writes through it until the host cuts the power.
# Env: RUN (1 for the first boot, then 2, 3, ...), LAST (1 on the boot that only checks),
# NQN, POOLS ("NAME:EXPECTED_BLOCK:OPTIONS ..."; the disks of pool NAME have serials
# NAMEa and NAMEb).
BIN=/host/bin
SOCK=/tmp/engine.sock
# A management call that hangs fails the step instead of the whole guest's time.
cli() { timeout 120 $BIN/nvpool engine "$@" --socket $SOCK; }
disk() {   # disk SERIAL: the virtio disk with that serial
    for b in /sys/block/vd*; do
        [ "$(cat $b/serial 2>/dev/null)" = "$1" ] && { echo /dev/${b##*/}; return 0; }
    done
    return 1
}
ns_dev() {   # ns_dev NSID: the block device of namespace NSID of controller $C (the
             # kernel numbers its devices in the order its scans finish, not by NSID)
    for b in /sys/block/${C}n*; do
        [ "$(cat $b/nsid 2>/dev/null)" = "$1" ] && { echo ${b##*/}; return 0; }
    done
    return 1
}
REGION_BYTES=$((8 << 20))   # each writer's span of its volume

step "run $RUN: start the engine on pools of cached disks"
cat > /tmp/engine.toml <<TOML
reactors = 1
management_socket = "$SOCK"
[[listener]]
address = "127.0.0.1:4420"
[[subsystem]]
nqn = "$NQN"
hosts = ["$(cat /etc/nvme/hostnqn)"]
TOML
$BIN/nvpool engine --config /tmp/engine.toml > /host/engine-$RUN.log 2>&1 &
wait_for 60 cli subsystem list >/dev/null 2>&1 || { cat /host/engine-$RUN.log; fail "the engine did not start"; }
nsid=0
for spec in $POOLS; do
    name=${spec%%:*}; rest=${spec#*:}; opts=${rest#*:}
    a=$(disk ${name}a) && b=$(disk ${name}b) || fail "no disks for pool $name"
    for d in $a $b; do
        echo "$name: $d logical $(cat /sys/block/${d##*/}/queue/logical_block_size)" \
             "physical $(cat /sys/block/${d##*/}/queue/physical_block_size)"
    done
    if [ "$RUN" = 1 ]; then
        cli pool create $name $a $b || fail "pool create $name"
        case $opts in *thick*) thin= ;; *) thin=--thin ;; esac
        cli volume create $name v 48MiB $thin || fail "volume create $name"
    else
        cli pool import $a $b || fail "pool import $name"
        cli pool check $name || fail "pool check $name after the cut"
        # What this run writes lies over a snapshot of what the runs before left: its
        # first writes to each granule (4 KiB, or a 512-byte block of one) take the
        # path that records the granule held, and the power is cut among them.
        cli volume snapshot $name v s$RUN || fail "snapshot $name"
    fi
    nsid=$((nsid + 1))
    case $opts in
        *torn*) cli namespace add $NQN volume:$name/v --nsid $nsid --block-size 4096 --allow-torn-writes ;;
        *) cli namespace add $NQN volume:$name/v --nsid $nsid --block-size 0 ;;
    esac || fail "namespace add $name"
done
cli subsystem list

step "run $RUN: connect the kernel host"
nvme connect -t tcp -a 127.0.0.1 -s 4420 -n $NQN || fail "nvme connect"
wait_for 30 ctrl_of $NQN >/dev/null || fail "no live controller for $NQN"
C=$(ctrl_of $NQN)
nsid=0
for spec in $POOLS; do
    nsid=$((nsid + 1))
    wait_for 30 ns_dev $nsid >/dev/null || fail "no block device for namespace $nsid"
done

if [ "$RUN" != 1 ]; then
    step "run $RUN: check every block against what runs 1 to $((RUN - 1)) were promised"
    logs=
    r=1
    while [ $r -lt $RUN ]; do logs="$logs --log /host/console-$r.log"; r=$((r + 1)); done
    nsid=0
    failed=
    for spec in $POOLS; do
        name=${spec%%:*}; rest=${spec#*:}; opts=${rest#*:}
        nsid=$((nsid + 1))
        dev=$(ns_dev $nsid)
        bs=$(cat /sys/block/$dev/queue/logical_block_size)
        expect=
        case $opts in *torn*) expect=--expect-torn ;; esac
        $BIN/crashcheck check /dev/$dev --tag $name --block-size $bs --blocks $((REGION_BYTES / bs)) \
            $logs $expect || failed="$failed $name"
    done
    [ -z "$failed" ] || fail "crashcheck failed for:$failed"
fi

if [ "$LAST" = 1 ]; then
    nvme disconnect -n $NQN
    for spec in $POOLS; do cli pool check ${spec%%:*} || fail "pool check ${spec%%:*}"; done
    echo "ALL STEPS PASSED"
    exit 0
fi

step "run $RUN: write through every namespace until the power is cut"
nsid=0
for spec in $POOLS; do
    name=${spec%%:*}; rest=${spec#*:}; expected=${rest%%:*}; opts=${rest#*:}
    nsid=$((nsid + 1))
    dev=$(ns_dev $nsid)
    bs=$(cat /sys/block/$dev/queue/logical_block_size)
    echo "$name: namespace $nsid ($dev) has $bs-byte blocks (expected $expected)"
    [ "$bs" = "$expected" ] || fail "$name: the engine chose $bs-byte blocks, not $expected"
    case $opts in
        *torn*) cadence="--flush-every 0 --fua-every 0" ;;   # the control: nothing durable
        # Few durability points: a FUA write to a virtio disk flushes its whole cache.
        *) cadence="--flush-every 150 --fua-every 41" ;;
    esac
    $BIN/crashcheck write /dev/$dev --tag $name --block-size $bs --blocks $((REGION_BYTES / bs)) \
        --seed $((RUN * 100 + nsid)) --first-generation $((RUN * 1000000000 + 1)) $cadence &
done
sleep 2
echo "POWER-CUT-READY"
# Snapshots and clones come and go among the writes, so that the cut may land in the
# middle of one: two snapshots of v a run (each stays in v's chain, hidden once
# deleted, and a chain holds 16), and clones of them made and deleted without end,
# every third one inflated first (its snapshot's data copied into it).
# Each step prints a line; one that fails prints SNAPSHOT-CHURN-FAILED for the host.
# Not on the control pool: each step's journal commit flushes its disks, and its
# writes must stay in their cache until the cut.
for spec in $POOLS; do
    name=${spec%%:*}
    case $spec in *torn*) continue ;; esac
    (
        churn() { echo "churn $name: $*"; cli "$@" > /dev/null || { echo "SNAPSHOT-CHURN-FAILED: $name: $*"; exit 1; }; }
        for base in b$RUN-1 b$RUN-2; do
            churn volume snapshot $name v $base
            k=1
            while [ $k -le 12 ]; do
                churn volume clone $name $base $base-c$k
                if [ $((k % 3)) = 0 ]; then churn volume inflate $name $base-c$k --wait; fi
                churn volume delete $name $base-c$k
                k=$((k + 1))
                sleep 0.2
            done
            churn volume delete $name $base
        done
    ) &
done
wait
fail "a writer stopped before the power was cut"
