#!/usr/bin/env python3
"""A/B: two nvpool binaries' engines side by side, alternating run by run.

    bench/ab.py OLD_BINARY NEW_BINARY [--rounds 5] [--backend null:1GiB ...]

Each backend runs as one engine per binary (one reactor on --target-core), both up for
the whole run; `nvpool bench` (from NEW_BINARY, on --bench-core) drives them in turns,
A then B, then B then A, so drift on a shared machine falls on both. It prints, per
workload, the median IOPS of each and the median of the per-round ratios B/A with
their middle half and range (the spread a difference must beat), plus the mean
latencies. Run as root, it moves into a network namespace of its own with cubic, as
the suite does (`suite.own_network`), and reserves huge pages for both engines' RAM
namespaces (`HUGE_PAGES`). Standard library only; timings are reported, never
asserted.
"""
import argparse, json, os, shutil, statistics, subprocess, tempfile

from suite import free_port, hugepages, own_network, wait_port

WORKLOADS = [("randread", 4096, 1), ("randread", 4096, 32), ("randread", 4096, 128),
             ("randwrite", 4096, 32), ("read", 131072, 32)]
NQN = "nqn.2024-01.io.nvpool:ab"
# Huge pages reserved for the run (2 MiB each, 4 GiB): both engines' RAM namespaces, up
# to 2 GiB each. An engine's namespace is on huge pages only when enough are free, so
# without them A could take the host's few and B fall to ordinary pages, whose random
# I/O pays a TLB miss per command that A's does not.
HUGE_PAGES = 2048


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=2.0)
    ap.add_argument("--backend", action="append",
                    help="a namespace spec, or `volume` (a thick 1 GiB volume of a pool on a file in /dev/shm); "
                         "default: null:1GiB and a file on /dev/shm")
    ap.add_argument("--workload", action="append", metavar="NAME:BS:QD",
                    help="e.g. randread:4096:1 (default: 4K random read at QD1/32/128, 4K random write QD32, 128K read QD32)")
    ap.add_argument("--target-core", type=int, default=0)
    ap.add_argument("--bench-core", type=int, default=1)
    args = ap.parse_args()
    own_network()
    workloads = [(w, int(bs), int(qd)) for w, bs, qd in (x.split(":") for x in args.workload)] if args.workload else WORKLOADS
    tmp = tempfile.mkdtemp(prefix="nvpool-ab-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    backends = args.backend or ["null:1GiB", f"file:{tmp}/disk.img:1GiB"]
    procs = []
    try:
        with hugepages(HUGE_PAGES):
            for backend in backends:
                run_backend(backend, args, workloads, tmp, procs)
    finally:
        for p in procs:
            p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def run_backend(backend, args, workloads, tmp, procs):
    """Both binaries' engines on `backend`, driven in turns through every workload."""
    ports = {}
    # A volume is namespace 2, beside a null namespace 1 the quick form needs.
    nsid = 2 if backend == "volume" else 1
    for name, binary in (("A", args.old), ("B", args.new)):
        port = free_port()
        sock = f"{tmp}/{name}-{port}.sock"
        procs.append(subprocess.Popen(
            [binary, "engine", "--listen", f"127.0.0.1:{port}", "--subsystem", NQN, "--namespace",
             "null:1GiB" if backend == "volume" else backend, "--cores", str(args.target_core),
             "--discovery-port", "0", "--mgmt-socket", sock], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))
        wait_port(port)
        if backend == "volume":
            disk = f"{tmp}/{name}-pool.img"
            with open(disk, "wb") as f:
                f.truncate(1100 << 20)
            for cmd in (["pool", "create", "p", disk], ["volume", "create", "p", "v", "1GiB"],
                        ["namespace", "add", NQN, "volume:p/v", "--nsid", "2"]):
                subprocess.run([binary, "engine", *cmd, "--socket", sock], check=True, capture_output=True)
        ports[name] = port
    print(f"\n{backend}: A = {args.old}, B = {args.new}; {args.rounds} rounds of {args.duration} s")
    print(f"| workload | A IOPS | B IOPS | B/A | B/A middle half | B/A range | A mean us | B mean us |")
    print(f"|---|---:|---:|---:|---:|---:|---:|---:|")
    for (w, bs, qd) in workloads:
        res = {"A": [], "B": []}
        ratios = []
        for r in range(args.rounds):
            order = ("A", "B") if r % 2 == 0 else ("B", "A")
            got = {}
            for name in order:
                out = subprocess.run(
                    [args.new, "bench", "--target", f"127.0.0.1:{ports[name]}", "--nqn", NQN,
                     "--nsid", str(nsid), "--workload", w, "--bs", str(bs), "--qd", str(qd), "--duration", str(args.duration),
                     "--warmup", "0.5", "--core", str(args.bench_core), "--json"],
                    capture_output=True, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"{name} ({args.old if name == 'A' else args.new}) on {backend}, "
                                     f"{w} {bs} QD{qd}: {out.stderr.strip()}")
                got[name] = json.loads(out.stdout)
                res[name].append(got[name])
            ratios.append(got["B"]["iops"] / got["A"]["iops"])
        med = lambda name, key: statistics.median(x[key] if key == "iops" else x["latency"]["mean_us"] for x in res[name])
        # The spread of the per-round ratios says how far apart the two must be
        # before a difference means anything.
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        print(f"| {w} {bs // 1024}K QD{qd} | {med('A', 'iops'):,.0f} | {med('B', 'iops'):,.0f} | "
              f"{statistics.median(ratios):.1%} | {q1:.0%}-{q3:.0%} | {min(ratios):.0%}-{max(ratios):.0%} | "
              f"{med('A', 'lat'):.1f} | {med('B', 'lat'):.1f} |", flush=True)
    for p in procs:
        p.terminate()
        p.wait()
    procs.clear()


if __name__ == "__main__":
    main()
