# Guest side of csi-sanity (busybox sh). Runs in /host, the shared output directory,
# which holds the nvpool and csi-sanity binaries. The nvpool controller is at 10.0.2.2.
mkdir -p /etc/nvme && echo "$NVME_HOSTNQN" > /etc/nvme/hostnqn
/host/nvpool csi --endpoint unix:///tmp/csi.sock --controller 10.0.2.2:19400 --node-name csi-guest \
    --state-dir /tmp/csi-state --kube-api "$KUBE_API" --kube-token-file /host/kube/kube-token \
    --kube-ca-file /host/kube/certs/apiserver.crt --secret-namespace nvpool > /host/csi-driver.log 2>&1 &
n=100; while [ $n -gt 0 ] && [ ! -S /tmp/csi.sock ]; do sleep 0.1; n=$((n - 1)); done
[ -S /tmp/csi.sock ] || { echo "FAIL: the CSI driver did not start"; cat /host/csi-driver.log; exit 1; }
/host/csi-sanity --csi.endpoint=unix:///tmp/csi.sock --csi.mountdir=/tmp/csi-mount \
    --csi.stagingdir=/tmp/csi-staging --csi.testvolumesize=67108864 --csi.testvolumeexpandsize=134217728 \
    --ginkgo.junit-report=/host/junit.xml --ginkgo.no-color
rc=$?
echo "csi-sanity exit code $rc"
[ $rc = 0 ] || exit $rc

# The node tests again, on volumes of a class with dhchap: "true": ControllerPublish
# puts the host's secrets in a Secret, NodeStage reads it and connects every path with
# them, and the engines authenticate the kernel.
echo 'dhchap: "true"' > /tmp/dhchap.yaml
echo "--- dhchap pass" > /dev/kmsg
/host/csi-sanity --csi.endpoint=unix:///tmp/csi.sock --csi.mountdir=/tmp/csi-mount \
    --csi.stagingdir=/tmp/csi-staging --csi.testvolumesize=67108864 --csi.testvolumeparameters=/tmp/dhchap.yaml \
    --ginkgo.focus='Node Service should' --ginkgo.junit-report=/host/junit-dhchap.xml --ginkgo.no-color
rc=$?
echo "csi-sanity (dhchap) exit code $rc"
dmesg | sed -n '/--- dhchap pass/,$p' | grep -E 'nvme' > /host/kmsg-dhchap.txt
authenticated=$(grep -c 'qid 0: .*authenticated' /host/kmsg-dhchap.txt)
echo "the kernel authenticated $authenticated admin queues during the dhchap pass"
grep 'qid 0: .*authenticated' /host/kmsg-dhchap.txt | head -3
[ "$authenticated" -gt 0 ] || { echo "FAIL: no queue authenticated in the dhchap pass"; rc=1; }
grep -q DHHC /host/csi-driver.log && { echo "FAIL: a secret is in the driver's log"; rc=1; }
[ $rc = 0 ] && echo "ALL STEPS PASSED"
exit $rc
