#!/usr/bin/env python3
"""One node of many volumes: what creating them costs, and what they cost at rest.

    bench/control_one_node.py [--volumes 1000] [--rest 60] [--out bench/results/control-one-node.md]

One node as a new user sets it up: an engine (one reactor, no busy polling) with a pool
on a sparse file, its agent, and a controller with the embedded store (heartbeat every
second, the default). `nvpool volume create` then makes --volumes thin 16 MiB volumes
one after another, as a user's script would; each command's time is measured from its
start to its exit (the CLI's own start, a few milliseconds, included). The table gives
the latency's p50, p99 and max for each quarter of the creations, then the CPU the
engine, the agent and the controller used during the creations and over --rest seconds
at rest afterwards (no I/O, nothing asked), as a share of one core, and their memory;
and where a creation's time goes, from the controller's and the agent's metrics: the
store's commits, the agent's application of the node's state, and what is left (the
CLI's start, gRPC, placement).
Run as root, it moves into a network namespace of its own, as the suite does. Timings
are reported, never asserted. Standard library only.
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time, urllib.request

from suite import BIN, cpu_seconds, free_port, own_network, rss_kib, wait_port


def percentile(values, p):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


def run(cmd, env=None):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: {out.stderr.strip()}")
    return out.stdout


def histogram(address, name):
    """(sum, count) of a Prometheus histogram at http://address/metrics."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"{name}_{part} ") or line.startswith(f"{name}_{part}{{"):
                values[part] = values.get(part, 0.0) + float(line.split()[-1])
    return values.get("sum", 0.0), values.get("count", 0.0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--volumes", type=int, default=1000)
    parser.add_argument("--rest", type=float, default=60.0, help="seconds at rest after the creations")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "control-one-node.md"))
    parser.add_argument("--label", default="", help="a word for the table's title (e.g. before, after)")
    args = parser.parse_args()
    own_network()
    procs = {}
    with tempfile.TemporaryDirectory(prefix="nvpool-one-node-") as tmp:
        try:
            nvme, ctl, agent_port = free_port(), free_port(), free_port()
            ctl_metrics, agent_metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
            sock = f"{tmp}/engine.sock"
            logs = {n: open(f"{tmp}/{n}.log", "w") for n in ("engine", "agent", "controller")}
            procs["engine"] = subprocess.Popen(
                [BIN, "engine", "--listen", f"127.0.0.1:{nvme}", "--discovery-port", "0", "--reactors", "1",
                 "--busy-poll-us", "0", "--mgmt-socket", sock], stdout=logs["engine"], stderr=subprocess.STDOUT)
            wait_port(nvme)
            disk = f"{tmp}/pool.img"
            with open(disk, "wb") as f:
                f.truncate(64 << 30)
            run([BIN, "engine", "pool", "create", "p", disk, "--socket", sock])
            procs["controller"] = subprocess.Popen(
                [BIN, "controller", "--listen", f"127.0.0.1:{ctl}", "--store", f"redb:{tmp}/controller.redb",
                 "--metrics-listen", ctl_metrics],
                stdout=logs["controller"], stderr=subprocess.STDOUT)
            wait_port(ctl)
            env = dict(os.environ, NVPOOL_CONTROLLER=f"127.0.0.1:{ctl}")
            procs["agent"] = subprocess.Popen(
                [BIN, "agent", "--name", "n1", "--listen", f"127.0.0.1:{agent_port}", "--engine-socket", sock,
                 "--metrics-listen", agent_metrics], stdout=logs["agent"], stderr=subprocess.STDOUT,
                env=env)
            deadline = time.time() + 30
            while not any(n["healthy"] for n in json.loads(run([BIN, "node", "list", "--json"], env))):
                if time.time() > deadline:
                    raise SystemExit("the agent did not register within 30 s")
                time.sleep(0.2)

            cpu0 = {n: cpu_seconds(p.pid) for n, p in procs.items()}
            commits0 = histogram(ctl_metrics, "nvpool_controller_store_commit_seconds")
            applies0 = histogram(agent_metrics, "nvpool_agent_apply_seconds")
            t0 = time.monotonic()
            latencies = []
            for i in range(args.volumes):
                start = time.monotonic()
                run([BIN, "volume", "create", f"v{i:05}", "16MiB", "--thin"], env)
                latencies.append((time.monotonic() - start) * 1000)
            create_wall = time.monotonic() - t0
            cpu1 = {n: cpu_seconds(p.pid) for n, p in procs.items()}
            commits1 = histogram(ctl_metrics, "nvpool_controller_store_commit_seconds")
            applies1 = histogram(agent_metrics, "nvpool_agent_apply_seconds")
            time.sleep(args.rest)
            cpu2 = {n: cpu_seconds(p.pid) for n, p in procs.items()}
            rss = {n: rss_kib(p.pid) // 1024 for n, p in procs.items()}
        finally:
            for p in procs.values():
                p.terminate()
            for p in procs.values():
                p.wait()

    quarter = max(1, args.volumes // 4)
    title = f"{args.volumes} volumes on one node" + (f" ({args.label})" if args.label else "")
    lines = [f"## {title}", "", f"`bench/control_one_node.py --volumes {args.volumes} --rest {args.rest:g}`", "",
             "| volumes created | create p50 (ms) | p99 (ms) | max (ms) |", "|---|---:|---:|---:|"]
    for q in range(0, args.volumes, quarter):
        part = latencies[q:q + quarter]
        lines.append(f"| {q + 1}–{q + len(part)} | {statistics.median(part):.0f} | {percentile(part, 0.99):.0f} | "
                     f"{max(part):.0f} |")
    lines += ["", f"All {args.volumes} creations took {create_wall:.1f} s.", "",
              "| process | CPU while creating (% of a core) | CPU at rest (% of a core) | RSS after (MiB) |",
              "|---|---:|---:|---:|"]
    for n in ("engine", "agent", "controller"):
        busy = 100 * (cpu1[n] - cpu0[n]) / create_wall
        rest = 100 * (cpu2[n] - cpu1[n]) / args.rest
        lines.append(f"| {n} | {busy:.1f} | {rest:.2f} | {rss[n]} |")
    per_create = lambda a, b: (1000 * (b[0] - a[0]) / args.volumes, (b[1] - a[1]) / args.volumes)
    commit_ms, commits = per_create(commits0, commits1)
    apply_ms, applies = per_create(applies0, applies1)
    mean = statistics.mean(latencies)
    lines += ["", "| one creation, on average | ms |", "|---|---:|",
              f"| store commits ({commits:.1f} per creation) | {commit_ms:.1f} |",
              f"| the agent applying the node's state ({applies:.1f} per creation) | {apply_ms:.1f} |",
              f"| the rest (CLI start, gRPC, placement) | {mean - commit_ms - apply_ms:.1f} |",
              f"| in all | {mean:.1f} |"]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
