#!/usr/bin/env python3
"""nvpool benchmark suite: the engine against what the machine allows, in one run.

For 4 KiB random read and write and 128 KiB sequential read at QD1, QD32 and QD128, it
measures with `nvpool bench` (pinned to one core) against:
  - the protocol-minimal responder (`nvpool responder`): the fastest NVMe/TCP on this
    machine, the denominator of every engine ratio;
  - for reads, the bare request/response loop (`nvpool responder --bare` driven by
    `nvpool bench --bare`): the same message sizes with no protocol, which shows what
    the generator itself costs (responder / bare);
  - the engine with the null, memory and file backends (one reactor on the other core);
  - fio with io_uring and O_DIRECT on the same backing file: the native disk figure the
    file backend is compared with. fio runs on the generator's core and, as a second
    figure, on the reactor's core: where the submitting CPU sits relative to the CPU
    that takes the disk's interrupts moves a virtual disk's IOPS by 10% and more, and
    the suite records which CPU that is.
Targets alternate within each configuration and every figure is the median over rounds,
because absolute numbers drift on shared machines (this machine has spells of several
seconds at half speed): ratios and latency differences are taken within a round, where
the runs are seconds apart, and the median of those is reported.
Run as root, the suite runs in a network namespace of its own with TCP's congestion
control set to cubic, Linux's default (see `own_network`).
Writes bench/results/results.{md,json} and results.svg. Standard library only.
"""
import argparse, contextlib, json, os, platform, shutil, signal, socket, statistics, subprocess, sys, time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(REPO, "target", "release", "nvpool")
NQN = "nqn.2024-01.io.nvpool:bench"
CONFIGS = [(w, bs, qd) for (w, bs) in (("randread", 4096), ("randwrite", 4096), ("read", 131072)) for qd in (1, 32, 128)]
ENGINE_BACKENDS = ("null", "memory", "file")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=10):
    end = time.time() + timeout
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on port {port}")


def start_engine(namespaces, core, tmp, busy_poll_us=None, remote_queues=None):
    """An engine on one core serving `namespaces` under NQN on a free port; returns the
    process, the port and its management socket."""
    port = free_port()
    sock = f"{tmp}/{port}.sock"
    cmd = [BIN, "engine", "--listen", f"127.0.0.1:{port}", "--subsystem", NQN, "--cores", str(core),
           "--discovery-port", "0", "--mgmt-socket", sock]
    for ns in namespaces:
        cmd += ["--namespace", ns]
    if busy_poll_us is not None:
        cmd += ["--busy-poll-us", str(busy_poll_us)]
    if remote_queues:
        cmd += ["--remote-queues", remote_queues]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return proc, port, sock


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Target:
    """A responder or engine process pinned to `core`."""

    def __init__(self, kind, core, file_path, reactors_cores=None):
        self.kind, self.port = kind, free_port()
        self.socket = f"/tmp/nvpool-bench-{self.port}.sock"
        if kind in ("responder", "bare"):
            cmd = [BIN, "responder", "--listen", f"127.0.0.1:{self.port}", "--core", str(core)]
            cmd += ["--bare"] if kind == "bare" else []
        elif kind == "pool":
            # Namespaces are added through the management API.
            cmd = [BIN, "engine", "--listen", f"127.0.0.1:{self.port}", "--cores", reactors_cores or str(core),
                   "--discovery-port", "0", "--mgmt-socket", self.socket]
        else:
            backend = {"null": "null:1GiB", "memory": "memory:1GiB", "file": f"file:{file_path}"}[kind]
            cmd = [BIN, "engine", "--listen", f"127.0.0.1:{self.port}", "--subsystem", NQN, "--namespace", backend,
                   "--cores", reactors_cores or str(core), "--discovery-port", "0",
                   "--mgmt-socket", self.socket]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def bench(port, workload, bs, qd, args, connections=1, bare=False):
    cmd = [BIN, "bench", "--target", f"127.0.0.1:{port}", "--bs", str(bs), "--qd", str(qd),
           "--duration", str(args.duration), "--warmup", str(args.warmup), "--core", str(args.bench_core), "--json"]
    if bare:
        cmd += ["--bare"]
    else:
        cmd += ["--nqn", NQN, "--workload", workload, "--connections", str(connections), "--span", "1GiB"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"bench failed: {' '.join(cmd)}\n{out.stderr}")
    return json.loads(out.stdout)


def fio(path, workload, bs, qd, args, core):
    cmd = ["fio", "--name=native", f"--filename={path}", "--direct=1", "--ioengine=io_uring", f"--rw={workload}",
           f"--bs={bs}", f"--iodepth={qd}", "--time_based", f"--runtime={args.duration}",
           f"--ramp_time={args.warmup}", f"--cpus_allowed={core}", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"fio failed: {out.stderr}")
    job = json.loads(out.stdout)["jobs"][0]
    side = job["write"] if "write" in workload else job["read"]
    pct = side["clat_ns"].get("percentile", {})
    return {"iops": side["iops"], "latency": {"mean_us": side["lat_ns"]["mean"] / 1000,
                                              "p50_us": pct.get("50.000000", 0) / 1000,
                                              "p99_us": pct.get("99.000000", 0) / 1000}}


def disk_interrupt_cpus(path):
    """The CPUs that have taken the interrupts of the disk holding `path`, busiest first
    (empty when they cannot be told apart, e.g. for tmpfs)."""
    dev = os.stat(path).st_dev
    sysdev = os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if os.path.exists(os.path.join(sysdev, "partition")):
        sysdev = os.path.dirname(sysdev)
    driver_dev = os.path.join(sysdev, "device")
    if not os.path.exists(driver_dev):
        return []
    # virtio disks name their vectors after the virtio device (virtio1-req.0), NVMe
    # after the controller (nvme0q1).
    name = os.path.basename(os.path.realpath(driver_dev))
    if name.startswith("nvme"):
        name = os.path.basename(os.path.realpath(os.path.join(driver_dev, "..")))
    lines = open("/proc/interrupts").read().splitlines()
    ncpu = len(lines[0].split())
    per_cpu = [0] * ncpu
    for line in lines[1:]:
        fields = line.split()
        if fields and fields[-1].startswith(name) and not fields[-1].endswith("config"):
            for i, v in enumerate(fields[1:1 + ncpu]):
                per_cpu[i] += int(v) if v.isdigit() else 0
    return [c for c in sorted(range(ncpu), key=lambda c: -per_cpu[c]) if per_cpu[c]]


TCP_CONGESTION = "cubic"
HUGEPAGES = "/proc/sys/vm/nr_hugepages"


@contextlib.contextmanager
def hugepages(n):
    """Reserves at least `n` huge pages while the block runs, as SPDK's setup.sh does:
    SPDK takes all its memory from them, and the engine's memory backend uses them when
    enough are free. The earlier reservation is restored afterwards. Without root,
    nothing changes (and the memory backend uses ordinary pages)."""
    try:
        before = int(open(HUGEPAGES).read())
        if before < n:
            with open(HUGEPAGES, "w") as f:
                f.write(str(n))
    except OSError as e:
        print(f"note: cannot reserve {n} huge pages ({e})", file=sys.stderr)
        yield
        return
    try:
        # SPDK's DPDK maps its pages from hugetlbfs; the engine's memfds need no mount.
        if not os.path.ismount("/dev/hugepages"):
            os.makedirs("/dev/hugepages", exist_ok=True)
            subprocess.run(["mount", "-t", "hugetlbfs", "nodev", "/dev/hugepages"], check=True)
        yield
    finally:
        with open(HUGEPAGES, "w") as f:
            f.write(str(before))


def own_network():
    """Moves the suite into a network namespace of its own, with loopback up and TCP's
    congestion control set to TCP_CONGESTION; the host's setting is left alone. Some
    machines default to BBR, whose pacing of loopback flows made the same depth-128 run
    of the same target swing between 1.3M and 1.9M IOPS from one connection to the next
    (cubic: 1.85M to 1.98M), which buries any comparison."""
    if os.environ.get("NVPOOL_BENCH_NETNS"):
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        try:
            with open("/proc/sys/net/ipv4/tcp_congestion_control", "w") as f:
                f.write(TCP_CONGESTION)
        except OSError as e:
            # Some sandboxes refuse the setting even inside a namespace of our own; the
            # table records what TCP really used.
            print(f"note: cannot set {TCP_CONGESTION} ({e}); TCP uses {tcp_congestion_control()}", file=sys.stderr)
        return
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        print("note: not root (or no unshare/ip): the suite uses the host's TCP congestion control", file=sys.stderr)
        return
    allow_congestion_control(TCP_CONGESTION)
    os.environ["NVPOOL_BENCH_NETNS"] = "1"
    os.execvp("unshare", ["unshare", "--net", "--", sys.executable, *sys.argv])


def allow_congestion_control(name):
    """A namespace may only pick a congestion control the host allows; where the host
    has `name` but does not allow it (a fresh machine here allowed reno and bbr only),
    it is added to the allowed list. The host's own default stays as it is."""
    base = "/proc/sys/net/ipv4/tcp_"
    try:
        allowed = open(base + "allowed_congestion_control").read().split()
        available = open(base + "available_congestion_control").read().split()
        if name in available and name not in allowed:
            with open(base + "allowed_congestion_control", "w") as f:
                f.write(" ".join(allowed + [name]))
    except OSError as e:
        print(f"note: cannot allow {name} ({e})", file=sys.stderr)


def tcp_congestion_control():
    try:
        return open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()
    except OSError:
        return "?"


def machine():
    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    mem = next((l.split()[1] for l in open("/proc/meminfo") if l.startswith("MemTotal")), "0")
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    return {"cpu": model, "cpus": os.cpu_count(), "memory_gib": round(int(mem) / 2**20, 1),
            "kernel": platform.release(), "tcp_congestion_control": tcp_congestion_control(), "revision": rev + ("-dirty" if dirty else ""),
            "hugepages_reserved": int(open(HUGEPAGES).read()),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def label(w, bs, qd):
    return f"{w} {bs // 1024}K QD{qd}"


def svg(results, path):
    """Grouped bars: each engine backend as a fraction of the responder, per config."""
    colors = {"null": "#4472c4", "memory": "#ed7d31", "file/fio": "#70ad47"}
    series = ["null", "memory", "file/fio"]
    W, H, left, top, bottom = 1060, 420, 60, 40, 110
    gw = (W - left - 20) / len(CONFIGS)
    bw = gw / (len(series) + 1)
    ymax = 1.2
    y = lambda v: top + (H - top - bottom) * (1 - min(v, ymax) / ymax)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<text x="{W/2}" y="18" text-anchor="middle" font-size="14">nvpool engine IOPS as a fraction of the minimal responder '
           f'(file/fio: file backend over native fio), {results["machine"]["revision"]}</text>']
    for t in (0, 0.25, 0.5, 0.75, 0.9, 1.0, 1.2):
        out.append(f'<line x1="{left}" x2="{W-20}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="{"#c00" if t in (0.9, 1.0) else "#ddd"}"/>')
        out.append(f'<text x="{left-5}" y="{y(t)+4:.1f}" text-anchor="end">{t:.0%}</text>')
    for i, c in enumerate(CONFIGS):
        row = results["rows"][label(*c)]
        for j, s in enumerate(series):
            v = row["ratios"].get(s)
            if v is None:
                continue
            x = left + i * gw + (j + 0.5) * bw
            out.append(f'<rect x="{x:.1f}" y="{y(v):.1f}" width="{bw*0.9:.1f}" height="{H-bottom-y(v):.1f}" fill="{colors[s]}"><title>{s}: {v:.1%}</title></rect>')
        out.append(f'<text transform="translate({left + i*gw + gw/2:.1f},{H-bottom+12}) rotate(30)" font-size="10">{label(*c)}</text>')
    for j, s in enumerate(series):
        out.append(f'<rect x="{left + j*120}" y="{H-28}" width="12" height="12" fill="{colors[s]}"/><text x="{left + j*120 + 16}" y="{H-18}">{s}</text>')
    out.append("</svg>")
    open(path, "w").write("\n".join(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--target-core", type=int, default=0)
    ap.add_argument("--bench-core", type=int, default=1)
    ap.add_argument("--file", default="/var/tmp/nvpool-bench/disk.img")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--quick", action="store_true", help="one round of 1 s runs (a smoke test of the suite)")
    ap.add_argument("--replot", action="store_true", help="only re-render the table and plot from results.json")
    ap.add_argument("--volume-dir", default="/dev/shm/nvpool-bench-volume",
                    help="where the volume-layer comparison keeps its pool disk and plain file")
    ap.add_argument("--volume-only", action="store_true",
                    help="run only the volume-layer comparison and merge it into results.json")
    ap.add_argument("--soak", type=float, default=0, metavar="SECONDS",
                    help="also run a soak: 64 connections against the memory backend, sampling the engine's RSS")
    args = ap.parse_args()
    if args.replot:
        write_outputs(json.load(open(os.path.join(args.out, "results.json"))), args)
        return
    if args.quick:
        args.rounds, args.duration, args.warmup = 1, 1.0, 0.3
    if not os.access(BIN, os.X_OK):
        raise SystemExit(f"{BIN} missing: run scripts/bench (it builds it)")
    own_network()
    # The memory backend's 1 GiB namespaces (the table's and the soak's), one at a time.
    with hugepages(1024):
        measure(args)


def measure(args):
    if args.volume_only:
        results = json.load(open(os.path.join(args.out, "results.json")))
        results["volume_layer"] = volume_layer(args)
        results["volume_layer"]["machine"] = machine()
        json.dump(results, open(os.path.join(args.out, "results.json"), "w"), indent=1)
        write_outputs(results, args)
        return
    if not shutil.which("fio"):
        raise SystemExit("fio missing: run scripts/bench (it installs it)")
    os.makedirs(os.path.dirname(args.file), exist_ok=True)
    if not os.path.exists(args.file) or os.path.getsize(args.file) < 2**30:
        # Written, not sparse: reads must hit real blocks for native and engine alike.
        subprocess.run(["dd", "if=/dev/urandom", f"of={args.file}", "bs=1M", "count=1024", "oflag=direct", "status=none"], check=True)
    raw = {label(*c): {} for c in CONFIGS}
    cpu = {b: [0.0, 0] for b in ENGINE_BACKENDS}
    # Every target stays up (idle ones sleep) so that each configuration can alternate
    # between them: the responder and the engine are measured moments apart.
    targets = {kind: Target(kind, args.target_core, args.file) for kind in ("bare", "responder") + ENGINE_BACKENDS}
    try:
        for rnd in range(args.rounds):
            for c in CONFIGS:
                for kind, t in targets.items():
                    if kind == "bare" and "read" not in c[0]:
                        continue  # the bare loop has the shape of reads only
                    before = cpu_seconds(t.proc.pid)
                    r = bench(t.port, *c, args, bare=kind == "bare")
                    if kind in ENGINE_BACKENDS:
                        cpu[kind][0] += cpu_seconds(t.proc.pid) - before
                        cpu[kind][1] += r["ios"] * (args.duration + args.warmup) / args.duration
                    raw[label(*c)].setdefault(kind, []).append(r)
                    print(f"round {rnd+1} {kind:9} {label(*c):18} {r['iops']:>10.0f} IOPS  mean {r['latency']['mean_us']:7.1f} us", flush=True)
                for kind, core in (("fio", args.bench_core), ("fio-reactor-core", args.target_core)):
                    r = fio(args.file, *c, args, core)
                    raw[label(*c)].setdefault(kind, []).append(r)
                    print(f"round {rnd+1} {kind:9} {label(*c):18} {r['iops']:>10.0f} IOPS  mean {r['latency']['mean_us']:7.1f} us", flush=True)
    finally:
        for t in targets.values():
            t.stop()
    rows = {}
    for c in CONFIGS:
        runs = raw[label(*c)]
        med = lambda k, f: statistics.median(f(r) for r in runs[k])
        row = {"iops": {}, "mean_us": {}, "p99_us": {}, "ratios": {}, "added_us": {}}
        for k in runs:
            row["iops"][k] = med(k, lambda r: r["iops"])
            row["mean_us"][k] = med(k, lambda r: r["latency"]["mean_us"])
            row["p99_us"][k] = med(k, lambda r: r["latency"]["p99_us"])
        for b in ENGINE_BACKENDS:
            row["ratios"][b] = statistics.median(e["iops"] / r["iops"] for e, r in zip(runs[b], runs["responder"]))
        for ref in ("fio", "fio-reactor-core"):
            row["ratios"][f"file/{ref}"] = statistics.median(e["iops"] / f["iops"] for e, f in zip(runs["file"], runs[ref]))
        if "bare" in runs:
            row["ratios"]["responder/bare"] = statistics.median(
                r["iops"] / b["iops"] for r, b in zip(runs["responder"], runs["bare"]))
        # Mean latency added over the reference, per round.
        added = lambda k, ref: statistics.median(a["latency"]["mean_us"] - b["latency"]["mean_us"]
                                                 for a, b in zip(runs[k], runs[ref]))
        row["added_us"]["null"] = added("null", "responder")
        row["added_us"]["file"] = added("file", "fio")
        rows[label(*c)] = row
    results = {"machine": {**machine(), "disk_interrupt_cpus": disk_interrupt_cpus(args.file)}, "rounds": args.rounds, "duration_s": args.duration, "rows": rows,
               "scaling": None, "volume_layer": None, "soak": None,
               "engine_cpu_s_per_million_ios": {b: (v[0] / v[1] * 1e6 if v[1] else None) for b, v in cpu.items()},
               "raw": raw}
    os.makedirs(args.out, exist_ok=True)
    # Saved now and again after each extra part, so a failure there loses nothing measured.
    for part, run in (("scaling", scaling), ("volume_layer", volume_layer), ("soak", soak if args.soak else None)):
        json.dump(results, open(os.path.join(args.out, "results.json"), "w"), indent=1)
        if run:
            results[part] = run(args)
    json.dump(results, open(os.path.join(args.out, "results.json"), "w"), indent=1)
    write_outputs(results, args)


def cli(socket, *argv):
    out = subprocess.run([BIN, "engine", *argv, "--socket", socket], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"nvpool engine {' '.join(argv)} failed: {out.stderr}")


def engine_json(sock, *argv):
    """`nvpool engine ARGV --json` against the engine at `sock`, parsed."""
    out = subprocess.run([BIN, "engine", *argv, "--json", "--socket", sock], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"nvpool engine {' '.join(argv)} failed: {out.stderr}")
    return json.loads(out.stdout)


def volume_layer(args):
    """The volume layer's cost: 4 KiB random reads and writes through the engine, to a
    thick volume on a one-disk pool and to a plain file backend, both files in
    `args.volume_dir`. That is tmpfs by default, so what is measured is the layer's own
    cost and not the disk's (this machine's disk is throttled and noisy)."""
    d = args.volume_dir
    os.makedirs(d, exist_ok=True)
    raw, disk = os.path.join(d, "raw.img"), os.path.join(d, "pool.img")
    subprocess.run(["dd", "if=/dev/urandom", f"of={raw}", "bs=1M", "count=1024", "status=none"], check=True)
    if os.path.exists(disk):
        os.remove(disk)
    with open(disk, "wb") as f:
        f.truncate(1152 * 2**20)
    plain = Target("file", args.target_core, raw)
    vol = Target("pool", args.target_core, None)
    sock = vol.socket
    cli(sock, "pool", "create", "bench", disk, "--force")
    cli(sock, "volume", "create", "bench", "v", "1GiB")
    cli(sock, "subsystem", "add", NQN, "--allow-any-host")
    cli(sock, "namespace", "add", NQN, "volume:bench/v")
    configs = [("randread", 4096, 1), ("randread", 4096, 32), ("randwrite", 4096, 1), ("randwrite", 4096, 32)]
    runs = {label(*c): {"file": [], "volume": []} for c in configs}
    try:
        # The volume is written once first, so neither side reads never-written blocks.
        bench(vol.port, "write", 131072, 32, argparse.Namespace(**{**vars(args), "duration": 4.0, "warmup": 0}))
        for rnd in range(args.rounds):
            for c in configs:
                for kind, t in (("file", plain), ("volume", vol)):
                    r = bench(t.port, *c, args)
                    runs[label(*c)][kind].append(r)
                    print(f"round {rnd+1} {kind:9} {label(*c):18} {r['iops']:>10.0f} IOPS  mean {r['latency']['mean_us']:7.1f} us", flush=True)
    finally:
        plain.stop()
        vol.stop()
    out = []
    for c in configs:
        k = runs[label(*c)]
        med = lambda kind, f: statistics.median(f(r) for r in k[kind])
        out.append({"workload": label(*c),
                     "iops": {kind: med(kind, lambda r: r["iops"]) for kind in k},
                     "mean_us": {kind: med(kind, lambda r: r["latency"]["mean_us"]) for kind in k},
                     "ratio": statistics.median(v["iops"] / f["iops"] for v, f in zip(k["volume"], k["file"]))})
    return {"dir": d, "rows": out}


def scaling(args):
    """4 KiB random reads from the null backend: 1 reactor and 1 connection against 2
    reactors and 2 connections (the generator shares the second CPU with a reactor)."""
    out = []
    for cores, conns in (("0", 1), ("0,1", 2)):
        t = Target("null", args.target_core, args.file, reactors_cores=cores)
        try:
            before = cpu_seconds(t.proc.pid)
            r = bench(t.port, "randread", 4096, 32, args, connections=conns)
            used = cpu_seconds(t.proc.pid) - before
            ios = r["ios"] * (args.duration + args.warmup) / args.duration
            out.append({"reactors": len(cores.split(",")), "connections": conns, "iops": r["iops"],
                        "mean_us": r["latency"]["mean_us"], "engine_cpu_s_per_million_ios": used / ios * 1e6})
            print(f"scaling: reactors on CPUs {cores}, {conns} connections: {r['iops']:.0f} IOPS", flush=True)
        finally:
            t.stop()
    return out


def soak(args):
    """64 connections at QD4 of 4 KiB random reads and writes against the memory
    backend for `args.soak` seconds, sampling the engine's RSS every 10 s."""
    t = Target("memory", args.target_core, args.file)
    samples = []
    try:
        cmd = [BIN, "bench", "--target", f"127.0.0.1:{t.port}", "--nqn", NQN, "--workload", "randrw", "--bs", "4096",
               "--qd", "4", "--connections", "64", "--duration", str(args.soak), "--warmup", "1",
               "--core", str(args.bench_core), "--span", "1GiB", "--verify", "--json"]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        start = time.time()
        while p.poll() is None:
            samples.append((round(time.time() - start), rss_kib(t.proc.pid)))
            time.sleep(10)
        out, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"soak failed: {err}")
        r = json.loads(out)
    finally:
        t.stop()
    steady = [kib for s, kib in samples if s >= 30] or [kib for _, kib in samples]
    print(f"soak: {r['iops']:.0f} IOPS, RSS {min(steady)}..{max(steady)} KiB after 30 s", flush=True)
    return {"seconds": args.soak, "connections": 64, "iops": r["iops"], "errors": r["errors"],
            "verify_failures": r["verify_failures"], "rss_kib_samples": samples,
            "rss_kib_after_30s": [min(steady), max(steady)]}


def write_outputs(results, args):
    """The Markdown table and the SVG plot, from the results."""
    rows = results["rows"]
    svg(results, os.path.join(args.out, "results.svg"))
    m = results["machine"]
    md = [f"# nvpool benchmark results", "",
          f"{m['date']}, revision {m['revision']}: {m['cpu']}, {m['cpus']} CPUs, {m['memory_gib']} GiB, kernel {m['kernel']}.",
          f"Median of {results['rounds']} interleaved rounds of {results['duration_s']:g} s; target on CPU "
          f"{args.target_core} (engine: 1 reactor), `nvpool bench` and fio on CPU {args.bench_core}. Ratios and added latencies are "
          f"taken within a round, then the median over rounds; IOPS columns are medians of their own.",
          f"The disk's interrupts go to CPU {', '.join(map(str, m.get('disk_interrupt_cpus') or ['?']))}. fio runs on CPU {args.bench_core} "
          f"(\"fio\", the native figure) and again on the reactor's CPU {args.target_core} (\"fio @reactor CPU\").",
          f"TCP congestion control: {m.get('tcp_congestion_control', '?')}. Huge pages reserved: "
          f"{m.get('hugepages_reserved', '?')} (the memory backend's 1 GiB namespace is on them when 512 are free). "
          "Goal ratios (issue 22: memory ≥ 90% of the responder) in bold.", "",
          "| workload | bare loop IOPS | responder | null | memory | file | fio (native file) | fio @reactor CPU | resp. / bare | null / resp. | memory / resp. | file / fio | file / fio @reactor CPU | mean latency us: resp. / null / file / fio | added us: null − resp. / file − fio |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for c in CONFIGS:
        r = rows[label(*c)]
        i, l, q = r["iops"], r["mean_us"], r["ratios"]
        a = r.get("added_us", {})
        bare = f"{i['bare']:,.0f}" if "bare" in i else "–"
        rb = f"{q['responder/bare']:.0%}" if "responder/bare" in q else "–"
        added = f"{a['null']:+.1f} / {a['file']:+.1f}" if a else "–"
        md.append(f"| {label(*c)} | {bare} | {i['responder']:,.0f} | {i['null']:,.0f} | {i['memory']:,.0f} | {i['file']:,.0f} | {i['fio']:,.0f} | "
                  f"{i['fio-reactor-core']:,.0f} | {rb} | {q['null']:.0%} | **{q['memory']:.0%}** | {q['file/fio']:.0%} | {q['file/fio-reactor-core']:.0%} | "
                  f"{l['responder']:.1f} / {l['null']:.1f} / {l['file']:.1f} / {l['fio']:.1f} | {added} |")
    if results.get("scaling"):
        md += ["", "Scaling (null backend, 4 KiB random read, QD32 per connection; the generator shares CPU 1 with the second reactor):", "",
               "| reactors | connections | IOPS | mean us | engine CPU s / million I/Os |", "|---:|---:|---:|---:|---:|"]
        md += [f"| {x['reactors']} | {x['connections']} | {x['iops']:,.0f} | {x['mean_us']:.1f} | {x['engine_cpu_s_per_million_ios']:.2f} |"
               for x in results["scaling"]]
    if results.get("volume_layer"):
        v = results["volume_layer"]
        when = f" ({v['machine']['date']}, revision {v['machine']['revision']})" if v.get("machine") else ""
        md += ["", f"Volume layer{when}: 4 KiB random I/O through the engine to a thick volume on a pool, and to a plain "
               f"file backend, both files on {v['dir']} (tmpfs: the layer's cost, not the disk's), medians of interleaved rounds:", "",
               "| workload | file IOPS | volume IOPS | volume / file | mean latency us: file / volume |", "|---|---:|---:|---:|---|"]
        md += [f"| {x['workload']} | {x['iops']['file']:,.0f} | {x['iops']['volume']:,.0f} | {x['ratio']:.1%} | "
               f"{x['mean_us']['file']:.1f} / {x['mean_us']['volume']:.1f} |" for x in v["rows"]]
    if results.get("soak"):
        k = results["soak"]
        md += ["", f"Soak: {k['connections']} connections, 4 KiB randrw with verify, memory backend, {k['seconds']:g} s: "
               f"{k['iops']:,.0f} IOPS, {k['errors']} errors, {k['verify_failures']} verify failures; engine RSS "
               f"{k['rss_kib_after_30s'][0]:,}..{k['rss_kib_after_30s'][1]:,} KiB after the first 30 s (this includes the 1 GiB "
               f"memory namespace, which is populated up front)."]
    md += ["", "Engine CPU per million I/Os (all configurations; a polling reactor counts its polling): " + ", ".join(
        f"{b} {v:.2f} s" for b, v in results["engine_cpu_s_per_million_ios"].items() if v), "",
        "![IOPS as a fraction of the machine's limit](results.svg)", ""]
    # SPDK side by side and where both targets' CPU goes (bench/spdk.py and profile.py,
    # run after this suite by scripts/bench), and the hand-kept list of what changed,
    # each change with its A/B figure. Their headings go one level down.
    for name, title, missing in (("spdk.md", "SPDK side by side", "SPDK was not built: run scripts/build-spdk, then scripts/bench, for the SPDK columns."),
                                 ("profile.md", "Where the targets' CPU goes", None),
                                 ("changes.md", "What changed", None)):
        path = os.path.join(args.out, name)
        if os.path.exists(path):
            body = "\n".join("#" + l if l.startswith("## ") else l
                             for l in open(path).read().splitlines() if not l.startswith("# ")).strip()
            md += [f"## {title}", "", body, ""]
        elif missing:
            md += [f"## {title}", "", missing, ""]
    open(os.path.join(args.out, "results.md"), "w").write("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
