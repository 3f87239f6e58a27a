#!/usr/bin/env python3
"""Hot upgrade under load: the pause the hosts see, upgrade after upgrade.

    bench/upgrade.py [--upgrades 100] [--binary-b PATH] [--out bench/results/upgrade.md] [--check]

One engine (one reactor on --target-core, no busy polling) serves a RAM namespace and a
thin volume of a pool on a file. In two phases, one `nvpool bench --verify` (on
--bench-core, 10 ms timeline) runs 4 KiB randrw: at depth 32 on the RAM namespace, then
at depth 1 on the volume, which allocates as it goes (each write stamps its block; every
read checks it). One generator at a time: two busy-polling generators on one CPU take
turns, and their turns would bury the figure. After a second of load, the engine is
hot-upgraded --upgrades times per phase, --gap seconds apart (`nvpool engine upgrade`: to
its own binary, or alternating with --binary-b). For each upgrade it takes the engine's
pause (its report: from the moment it stopped reading to the moment the new process
went on) and the host's: the slowest I/O completed from the upgrade's start until 50 ms
after it returned. For comparison, the slowest I/O of the 10 ms windows away from any
upgrade. Errors, verify failures and dropped connections must be 0; with --check a run
that sees any fails.
Run as root, it moves into a network namespace of its own, as the suite does.
Timings are reported, never asserted. Standard library only.
"""
import argparse, json, statistics, subprocess, sys, tempfile, time

from suite import BIN, free_port, machine, own_network, wait_port

NQN = "nqn.2024-01.io.nvpool:upgrade-bench"
WINDOW_S = 0.01
AFTER_S = 0.05


def cli(sock, *args):
    out = subprocess.run([BIN, "engine", *args, "--socket", sock, "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"nvpool engine {' '.join(args)}: {out.stderr.strip()}")
    return json.loads(out.stdout) if out.stdout.strip() else None


def generator(port, nsid, qd, span, seconds, core):
    return subprocess.Popen([BIN, "bench", "--target", f"127.0.0.1:{port}", "--nqn", NQN, "--nsid", str(nsid),
                             "--workload", "randrw", "--rwmixread", "50", "--bs", "4k", "--qd", str(qd),
                             "--span", span, "--verify", "--duration", str(seconds), "--warmup", "0.5",
                             "--timeline-ms", str(int(WINDOW_S * 1000)), "--core", str(core), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def percentile(values, p):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else 0


# The phases: name, namespace, depth, span.
PHASES = [("RAM namespace, depth 32", 1, 32, "64MiB"), ("thin volume, depth 1", 2, 1, "512MiB")]


def run(args, tmp):
    port = free_port()
    sock = f"{tmp}/engine.sock"
    log = open(f"{tmp}/engine.log", "w")
    engine = subprocess.Popen([BIN, "engine", "--listen", f"127.0.0.1:{port}", "--cores", str(args.target_core),
                               "--discovery-port", "0", "--busy-poll-us", "0", "--subsystem", NQN,
                               "--namespace", "memory:256MiB", "--block-size", "4096", "--mgmt-socket", sock],
                              stdout=subprocess.DEVNULL, stderr=log)
    wait_port(port)
    with open(f"{tmp}/disk", "wb") as f:
        f.truncate(1 << 30)
    cli(sock, "pool", "create", "p", f"{tmp}/disk")
    cli(sock, "volume", "create", "p", "v", "512MiB", "--thin")
    cli(sock, "namespace", "add", NQN, "volume:p/v", "--nsid", "2")
    seconds = 1.0 + args.upgrades * (args.gap + 0.1) + 1.0
    phases = []
    try:
        for name, nsid, qd, span in PHASES:
            gen = generator(port, nsid, qd, span, seconds, args.bench_core)
            time.sleep(1.5)
            upgrades = []
            try:
                for i in range(args.upgrades):
                    binary = args.binary_b if args.binary_b and i % 2 == 0 else BIN
                    t0 = time.time()
                    report = cli(sock, "upgrade", "--binary", binary)
                    upgrades.append((t0, time.time(), report))
                    time.sleep(args.gap)
                out, err = gen.communicate()
            finally:
                gen.kill()
            failure = f"nvpool bench failed: {err.strip()}" if gen.returncode != 0 else None
            phases.append((name, upgrades, None if failure else json.loads(out), failure))
    finally:
        pid = (cli(sock, "info") or {}).get("pid")
        if pid:
            subprocess.run(["kill", str(pid)])
        engine.wait()
    return phases


def summarize(upgrades, report):
    windows = [(report["started_unix_s"] + w["at_s"], w["max_us"]) for w in report["timeline"]]
    host = []
    for t0, t1, _ in upgrades:
        host.append(max((m for t, m in windows if t + WINDOW_S > t0 and t < t1 + AFTER_S), default=0))
    quiet = [m for t, m in windows
             if not any(t + WINDOW_S > t0 - AFTER_S and t < t1 + AFTER_S for t0, t1, _ in upgrades)]
    engine = {k: [u[2][k] for u in upgrades] for k in ("start_us", "pause_us", "park_us", "transfer_us", "rebuild_us")}
    return host, quiet, engine


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upgrades", type=int, default=100)
    ap.add_argument("--gap", type=float, default=0.2, help="seconds between upgrades")
    ap.add_argument("--binary-b", default=None, help="a second build to alternate with (odd upgrades)")
    ap.add_argument("--target-core", type=int, default=0)
    ap.add_argument("--bench-core", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--check", action="store_true", help="fail on any error, verify failure or lost connection")
    args = ap.parse_args()
    own_network()
    with tempfile.TemporaryDirectory() as tmp:
        phases = run(args, tmp)
    ms = lambda us: f"{us / 1000:.2f}"
    row = lambda name, v: f"| {name} | {ms(percentile(v, 50))} | {ms(percentile(v, 90))} | {ms(max(v, default=0))} |"
    versions = sorted({u[2]["new_version"] for _, ups, _, _ in phases for u in ups})
    m = machine()
    lines = [
        "# Hot upgrade under load",
        "",
        f"One engine (one reactor, CPU {args.target_core}) hot-upgraded {args.upgrades} times per phase, "
        f"{args.gap} s apart, between versions {', '.join(versions)}, while `nvpool bench --verify` (CPU "
        f"{args.bench_core}) ran 4 KiB randrw 50/50. Written by `bench/upgrade.py`.",
        "",
        f"Machine: {m['cpu']}, {m['cpus']} CPUs, kernel {m['kernel']}, TCP {m['tcp_congestion_control']}; revision "
        f"{m['revision']}, {m['date']}.",
    ]
    failed = False
    for name, upgrades, report, failure in phases:
        lines += ["", f"## {name}", ""]
        if failure:
            lines.append(f"**{failure}**")
            failed = True
            continue
        host, quiet, engine = summarize(upgrades, report)
        failed |= bool(report["errors"] or report["verify_failures"] or len(upgrades) != args.upgrades)
        lines += [
            f"**{report['ios']:,} I/Os, {report['errors']} errors, {report['verify_failures']} verify failures**; "
            f"every upgrade kept every connection ({upgrades[0][2]['connections'] if upgrades else 0} handed over).",
            "",
            "| ms | p50 | p90 | max |",
            "|---|---:|---:|---:|",
            row("**host: slowest I/O during an upgrade**", host),
            row("engine: pause (not reading)", engine["pause_us"]),
            row("of which: finishing the commands under way", engine["park_us"]),
            row("of which: checkpoint, state and sockets sent", engine["transfer_us"]),
            row("of which: the new process rebuilding", engine["rebuild_us"]),
            row("host: slowest I/O of a 10 ms window without an upgrade", quiet),
            row("before the pause: the new binary starting (the old one serves)", engine["start_us"]),
        ]
    lines += [
        "",
        "The host's figure is the pause as an application sees it: the slowest I/O completed from the upgrade's "
        "start until 50 ms after it returned. It includes the new binary's start, which runs beside the serving "
        "engine: on this 2-CPU machine it takes CPU time from the reactor's or the generator's CPU.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.check and failed:
        raise SystemExit("upgrade bench: I/O failed during the upgrades")


if __name__ == "__main__":
    main()
