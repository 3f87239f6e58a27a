#!/usr/bin/env python3
"""Hot migration under load: what the host sees while a volume moves between engines.

    bench/migration.py [--rates 0,200MiB] [--qd 32] [--out bench/results/migration.md]

Two engines (one reactor each, both on --target-core, no busy polling) with a pool on a
file each; a 1 GiB thick volume on A is exported to hosts, and B has an empty volume
of the same identity. `nvpool bench` (on --bench-core) writes 4 KiB blocks at random,
at --qd, through A for the whole run, reporting every 100 ms. After 3 s the volume
starts moving to B (`nvpool engine volume migrate`, at each copy rate of --rates; 0 is
no limit); once the first round is done the switch is allowed (pause budget 100 ms);
the host's I/O then reaches B through A. For each rate the table gives the rounds and
bytes per round, the total time, the pause the engine measured, the slowest host I/O
around the switch, and the host's IOPS before, during the copy, and after the switch.
Run as root, it moves into a network namespace of its own, as the suite does.
Timings are reported, never asserted. Standard library only.
"""
import argparse, json, subprocess, tempfile, time

from suite import BIN, free_port, own_network, wait_port

NQN = "nqn.2024-01.io.nvpool:migration-bench"
GIB = 1 << 30


def size_arg(s):
    units = {"k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
    s = s.strip().lower()
    for u in sorted(units, key=len, reverse=True):
        if s.endswith(u):
            return int(float(s[: -len(u)]) * units[u])
    return int(s)


def cli(sock, *args):
    out = subprocess.run([BIN, "engine", *args, "--socket", sock, "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"nvpool engine {' '.join(args)}: {out.stderr.strip()}")
    return json.loads(out.stdout) if out.stdout.strip() else None


def engine(name, core, tmp):
    port = free_port()
    sock = f"{tmp}/{name}.sock"
    proc = subprocess.Popen([BIN, "engine", "--listen", f"127.0.0.1:{port}", "--cores", str(core),
                             "--discovery-port", "0", "--busy-poll-us", "0", "--host-nqn",
                             f"nqn.2024-01.io.nvpool:bench-engine-{name}", "--mgmt-socket", sock],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    disk = f"{tmp}/{name}.disk"
    with open(disk, "wb") as f:
        f.truncate(GIB + 256 * (1 << 20))
    cli(sock, "pool", "create", "p", disk)
    return proc, port, sock


def one_run(rate, args, tmp):
    a, a_port, a_sock = engine("a", args.target_core, tmp)
    b, b_port, b_sock = engine("b", args.target_core, tmp)
    try:
        v = cli(a_sock, "volume", "create", "p", "v", "1GiB")
        cli(b_sock, "volume", "create", "p", "v", "1GiB", "--uuid", v["uuid"], "--nguid", v["nguid"])
        for sock in (a_sock, b_sock):
            cli(sock, "subsystem", "add", NQN, "--allow-any-host")
            cli(sock, "namespace", "add", NQN, "volume:p/v", "--nsid", "1")
        total = args.before + args.copy_limit + args.after
        bench = subprocess.Popen([BIN, "bench", "--target", f"127.0.0.1:{a_port}", "--nqn", NQN, "--workload",
                                  "randwrite", "--bs", "4k", "--qd", str(args.qd), "--duration", str(total),
                                  "--warmup", "1", "--timeline-ms", "100", "--core", str(args.bench_core),
                                  "--json"], stdout=subprocess.PIPE, text=True)
        started = time.monotonic() + 1.0  # the measured time begins after the warmup
        time.sleep(1.0 + args.before)
        events = {}
        migrate = ["volume", "migrate", "p", "v", "--to", f"127.0.0.1:{b_port}/{NQN}/1"]
        if rate:
            migrate += ["--rate", str(rate)]
        events["start"] = time.monotonic() - started
        cli(a_sock, *migrate)
        asked = False
        while True:
            m = cli(a_sock, "volume", "migration", "p", "v")
            if m["state"] == "failed":
                raise SystemExit(f"the migration failed: {m['error']}")
            if not asked and m["round_bytes"]:
                events["switch"] = time.monotonic() - started
                cli(a_sock, "volume", "switch", "p", "v", "--pause-ms", "100")
                asked = True
            if m["state"] == "switched":
                events["switched"] = time.monotonic() - started
                break
            if time.monotonic() - started > args.before + args.copy_limit:
                cli(a_sock, "volume", "cancel", "p", "v")
                raise SystemExit(f"the volume did not move within {args.copy_limit} s: {m}")
            time.sleep(0.05)
        report = json.loads(bench.communicate()[0])
        return m, events, report
    finally:
        for p in (a, b):
            p.terminate()
            p.wait()


def summarize(rate, m, events, report):
    windows = report["timeline"]

    def mean_iops(lo, hi):
        w = [x["iops"] for x in windows if lo <= x["at_s"] and x["at_s"] + 0.1 <= hi]
        return sum(w) / len(w) if w else 0.0

    before = mean_iops(0.0, events["start"])
    first = mean_iops(events["start"] + 0.2, events["switch"])
    converging = mean_iops(events["switch"], events["switched"] - 0.2)
    after = mean_iops(events["switched"] + 0.5, windows[-1]["at_s"] + 0.1 if windows else 0)
    around = [x["max_us"] for x in windows if events["switch"] - 0.2 <= x["at_s"] <= events["switched"] + 0.3]
    elsewhere = [x["max_us"] for x in windows if not (events["switch"] - 0.2 <= x["at_s"] <= events["switched"] + 0.3)]
    mib = lambda b: f"{b / (1 << 20):.1f}"
    rounds = ", ".join(mib(b) for b in m["round_bytes"][:10]) + (" ..." if len(m["round_bytes"]) > 10 else "")
    return (f"| {'no limit' if not rate else mib(rate) + ' MiB/s'} | {m['round']} | {rounds} | "
            f"{events['switch'] - events['start']:.1f} | {events['switched'] - events['start']:.1f} | "
            f"{mib(m['throttle'])} | {m['pause_us'] / 1000:.1f} | "
            f"{max(around, default=0) / 1000:.1f} | {max(elsewhere, default=0) / 1000:.1f} | {before:,.0f} | "
            f"{first:,.0f} ({first / before:.0%}) | {converging:,.0f} ({converging / before:.0%}) | {after:,.0f} | "
            f"{report['errors']} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="0,200MiB", help="copy rates to run, comma separated (0: no limit)")
    ap.add_argument("--qd", type=int, default=32)
    ap.add_argument("--before", type=float, default=3.0, help="seconds of load before the move starts")
    ap.add_argument("--after", type=float, default=3.0, help="seconds of load kept after the move")
    ap.add_argument("--copy-limit", type=float, default=30.0, help="longest the move may take")
    ap.add_argument("--target-core", type=int, default=0)
    ap.add_argument("--bench-core", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    own_network()
    lines = ["| copy rate | rounds | MiB per round | first round s | move s | last throttle MiB/s | engine pause "
             "ms | slowest host write around the switch ms | slowest elsewhere ms | host IOPS before | during the "
             "first round | while converging | after (via A) | errors |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    for rate in [size_arg(r) for r in args.rates.split(",")]:
        with tempfile.TemporaryDirectory(prefix="nvpool-migration-", dir="/var/tmp") as tmp:
            m, events, report = one_run(rate, args, tmp)
        lines.append(summarize(rate, m, events, report))
        print(lines[-1], flush=True)
    head = (f"`bench/migration.py --rates {args.rates} --qd {args.qd}`: a 1 GiB thick volume (a pool on a file "
            f"each) moves from engine A to B while `nvpool bench` writes 4 KiB blocks at random at QD{args.qd} "
            f"through A; engines on core {args.target_core}, the generator on core {args.bench_core}; "
            f"git {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}.\n")
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Hot migration under load\n\n" + head + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
