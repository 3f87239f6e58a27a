# Guest side of csi-sanity (busybox sh). Runs in /host, the shared output directory,
# which holds the nvpool and csi-sanity binaries. The nvpool controller is at 10.0.2.2.
mkdir -p /etc/nvme && echo "$NVME_HOSTNQN" > /etc/nvme/hostnqn
/host/nvpool csi --endpoint unix:///tmp/csi.sock --controller 10.0.2.2:19400 --node-name csi-guest \
    --state-dir /tmp/csi-state > /host/csi-driver.log 2>&1 &
n=100; while [ $n -gt 0 ] && [ ! -S /tmp/csi.sock ]; do sleep 0.1; n=$((n - 1)); done
[ -S /tmp/csi.sock ] || { echo "FAIL: the CSI driver did not start"; cat /host/csi-driver.log; exit 1; }
/host/csi-sanity --csi.endpoint=unix:///tmp/csi.sock --csi.mountdir=/tmp/csi-mount \
    --csi.stagingdir=/tmp/csi-staging --csi.testvolumesize=67108864 --csi.testvolumeexpandsize=134217728 \
    --ginkgo.junit-report=/host/junit.xml --ginkgo.no-color
rc=$?
echo "csi-sanity exit code $rc"
[ $rc = 0 ] && echo "ALL STEPS PASSED"
exit $rc
