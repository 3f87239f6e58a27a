# Sourced: starts a real Kubernetes API server (and the etcd it keeps its state in) in
# the current directory, from the binaries tests/k8s/build-tools made.
#   start_kube_api [ADVERTISE_IP]   (default 127.0.0.1; its certificate names that address)
#   stop_all                        (every process in PIDS: for the caller's EXIT trap)
# Needs TOOLS, PIDS (appended to), port and wait_for from the caller. Sets API (the
# port), writes kubeconfig (exported as KUBECONFIG), kube-token (the admin's bearer
# token) and certs/apiserver.crt (the server's certificate and the CA it chains to).
# The API server, told to stop as its etcd goes too, waits for it for ever (three were
# found still running hours later): what has not stopped after 5 s is killed.
stop_all() {
    kill "${PIDS[@]}" 2>/dev/null || true
    for _ in $(seq 25); do kill -0 "${PIDS[@]}" 2>/dev/null || break; sleep 0.2; done
    kill -9 "${PIDS[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
}

start_kube_api() {
    local advertise=${1:-127.0.0.1} etcd_port peer_port
    etcd_port=$(port); peer_port=$(port); API=$(port)
    etcd --name k8s --data-dir etcd-data --listen-client-urls http://127.0.0.1:$etcd_port \
        --advertise-client-urls http://127.0.0.1:$etcd_port --listen-peer-urls http://127.0.0.1:$peer_port \
        --initial-advertise-peer-urls http://127.0.0.1:$peer_port \
        --initial-cluster k8s=http://127.0.0.1:$peer_port > etcd.log 2>&1 &
    PIDS+=($!)
    openssl genrsa -out sa.key 2048 2>/dev/null
    echo "e2e-token,admin,admin-uid,system:masters" > tokens.csv
    echo e2e-token > kube-token
    "$TOOLS/kube-apiserver" --etcd-servers=http://127.0.0.1:$etcd_port --bind-address=127.0.0.1 \
        --advertise-address="$advertise" --secure-port=$API --cert-dir=certs \
        --service-account-issuer=https://kubernetes.default.svc \
        --service-account-key-file=sa.key --service-account-signing-key-file=sa.key \
        --service-cluster-ip-range=10.96.0.0/24 --allow-privileged=true --authorization-mode=RBAC \
        --token-auth-file=tokens.csv --endpoint-reconciler-type=none > apiserver.log 2>&1 &
    PIDS+=($!)
    cat > kubeconfig <<KC
apiVersion: v1
kind: Config
clusters: [{name: e2e, cluster: {server: "https://127.0.0.1:$API", insecure-skip-tls-verify: true}}]
users: [{name: admin, user: {token: e2e-token}}]
contexts: [{name: e2e, context: {cluster: e2e, user: admin}}]
current-context: e2e
KC
    export KUBECONFIG=$PWD/kubeconfig
    wait_for "the API server" 60 kubectl get --raw /readyz
}
