# The shared guest (busybox sh): runs the scenarios run-guest hands it, one after
# another, each as if it had the guest to itself, until the host asks it to stop.
# A scenario is /testbed/jobs/N: script.sh, env, hostdir (its directory under the
# share), then ready; the guest writes output and, at the end, rc.
mkdir -p /share
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=none share /share || { echo "no share"; exit 1; }
# What the guest looks like before any scenario: the state each one ends with again.
cut -d' ' -f2 /proc/mounts > /run/session-mounts
KEEP_PIDS=" 1 $$ "

# Whether /proc/PID is a live process a scenario may have left: not this loop or init,
# not a kernel thread (no command line), not a zombie. Builtins only: under emulation
# a process per check would take seconds.
user_process() {
    case $KEEP_PIDS in *" ${1#/proc/} "*) return 1 ;; esac
    _cmd=
    read -r _cmd < $1/cmdline 2>/dev/null
    [ -n "$_cmd" ] || return 1
    while read -r _key _state _; do
        [ "$_key" = State: ] && { [ "$_state" != Z ]; return; }
    done < $1/status
    return 1
}

# Puts the guest back as it booted.
reset_guest() {
    # Every process the scenario left, until they are gone: an engine's sockets close
    # only once its rings are torn down.
    for _proc in /proc/[0-9]*; do
        user_process $_proc && kill -9 ${_proc#/proc/} 2>/dev/null
    done
    _waited=0
    while [ $_waited -lt 100 ]; do
        _left=
        for _proc in /proc/[0-9]*; do user_process $_proc && _left=1; done
        [ -z "$_left" ] && break
        sleep 0.1
        _waited=$((_waited + 1))
    done
    nvme disconnect-all > /dev/null 2>&1
    # Mounts it made, deepest first; then what they left on /tmp.
    cut -d' ' -f2 /proc/mounts | sort -r | while read -r _mount; do
        grep -qx "$_mount" /run/session-mounts || umount -l "$_mount" 2>/dev/null
    done
    rm -rf /tmp/* /tmp/.[!.]* 2>/dev/null
    # The kernel's target, loop devices, soft-RoCE and its interface, keys.
    K=/sys/kernel/config/nvmet
    if [ -d $K ]; then
        for _link in $K/ports/*/subsystems/* $K/subsystems/*/allowed_hosts/*; do [ -L "$_link" ] && rm "$_link"; done
        for _ns in $K/subsystems/*/namespaces/*; do [ -d "$_ns" ] && { echo 0 > $_ns/enable; rmdir $_ns; }; done
        for _dir in $K/ports/* $K/subsystems/* $K/hosts/*; do [ -d "$_dir" ] && rmdir "$_dir"; done
    fi
    for _dev in /dev/loop[0-9]*; do [ -b "$_dev" ] && losetup -d "$_dev" 2>/dev/null; done
    command -v rdma > /dev/null && rdma link show 2>/dev/null | grep -q rxe0 && rdma link delete rxe0
    [ -e /sys/class/net/dummy0 ] && ip link del dummy0
    keyctl clear %keyring:.nvme 2>/dev/null
    rm -f /etc/tlshd.conf
    dmesg -c > /dev/null
}

n=1
while :; do
    while [ ! -f /testbed/jobs/$n/ready ] && [ ! -f /testbed/stop ]; do sleep 0.2; done
    [ -f /testbed/jobs/$n/ready ] || break
    J=/testbed/jobs/$n
    echo "session: scenario $n starts at uptime $(cut -d' ' -f1 /proc/uptime)s" > /dev/kmsg
    if mount -o bind "/share/$(cat $J/hostdir)" /host; then
        (
            . $J/env
            uuid=$(cat /proc/sys/kernel/random/uuid)
            echo "${NVME_HOSTNQN:-nqn.2014-08.org.nvmexpress:uuid:$uuid}" > /etc/nvme/hostnqn
            echo "${NVME_HOSTID:-$uuid}" > /etc/nvme/hostid
            cd /host && exec sh $J/script.sh
        ) > $J/output 2>&1 < /dev/null
        rc=$?
    else
        echo "session: cannot mount /share/$(cat $J/hostdir) on /host" > $J/output
        rc=125
    fi
    # Anything the kernel said during the scenario goes with its files.
    dmesg > /host/guest-kernel.log 2>/dev/null
    sync
    # A kernel that oopsed is not one to run the next scenario on: this guest stops,
    # and the next scenario boots a new one.
    oopsed=
    dmesg | grep -qE 'BUG:|Oops' && oopsed=1
    reset_guest
    echo $rc > $J/rc
    [ -n "$oopsed" ] && { echo "session: the kernel oopsed during scenario $n; stopping"; break; }
    n=$((n + 1))
done
