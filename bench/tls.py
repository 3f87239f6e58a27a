#!/usr/bin/env python3
"""The cost of NVMe/TCP over TLS: what the machine's AES-GCM allows, and the kernel
host's 4 KiB random reads from the engine with TLS against without.

kTLS seals records in the kernel, so the cost per I/O is the AES-GCM work on the data
(the handshake happens once per queue). This machine's own kernel has no kTLS module,
so the I/O figures come from the test guest (tests/kernel/tls-e2e), which runs under
emulation: there the ratio TLS/plain means something, the absolute figures do not, and
emulated AES instructions make TLS look dearer than on hardware. The AES-GCM rate is the
host's own (openssl speed), the same code class the kernel's AES-NI GCM runs.

usage: bench/tls.py [--skip-guest] [--out bench/results/tls.md]
"""

import argparse
import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
# Alternating rounds of plain and TLS measurements in the guest.
ROUNDS = 5


def aes_gcm_rate(cipher: str, size: int) -> float:
    """Bytes per second one core seals with `cipher` in blocks of `size` bytes."""
    out = subprocess.run(
        ["openssl", "speed", "-evp", cipher, "-bytes", str(size), "-seconds", "2"],
        capture_output=True, text=True, check=True,
    ).stdout
    line = [l for l in out.splitlines() if l.upper().startswith(cipher.upper())][-1]
    return float(line.split()[-1].rstrip("k")) * 1000


def guest_figures(skip: bool) -> dict:
    """name -> ((IOPS, mean latency us) of the median round, rounds) from tls-e2e's figures."""
    out_dir = REPO / "tests/kernel/out/tls-e2e"
    if not skip:
        env = dict(os.environ, TLS_ROUNDS=str(ROUNDS))
        subprocess.run([str(REPO / "tests/kernel/tls-e2e"), str(out_dir)], check=True, stdout=subprocess.DEVNULL, env=env)
    runs = {}
    for line in (out_dir / "figures.txt").read_text().splitlines():
        m = re.match(r"(\S+)\s+QD\d+\s+(\d+) IOPS\s+([\d.]+) us mean", line)
        if m:
            runs.setdefault(m.group(1), []).append((int(m.group(2)), float(m.group(3))))
    # The median round of each, by IOPS: emulation makes single runs noisy.
    return {name: (sorted(r)[len(r) // 2], len(r)) for name, r in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-guest", action="store_true", help="use the last tls-e2e figures")
    p.add_argument("--out", default=str(REPO / "bench/results/tls.md"))
    a = p.parse_args()
    lines = ["# NVMe/TCP over TLS 1.3: the cost", "", "Made by `bench/tls.py`.", ""]
    lines += ["## AES-GCM on this machine (one core, openssl speed)", ""]
    lines += ["| cipher | block | GB/s | us per 4 KiB I/O (seal or open) |", "|---|---|---|---|"]
    for cipher in ["aes-128-gcm", "aes-256-gcm"]:
        for size in [4096, 65536]:
            rate = aes_gcm_rate(cipher, size)
            per_io = 4096 / rate * 1e6
            lines.append(f"| {cipher.upper()} | {size} | {rate / 1e9:.2f} | {per_io:.2f} |")
    figures = guest_figures(a.skip_guest)
    lines += ["", "## The kernel host's 4 KiB random reads (test guest, emulated CPU)", ""]
    lines += ["Median of alternating rounds (plain, then TLS, on the same listener).", ""]
    lines += [
        "| depth | rounds | plain IOPS | TLS IOPS | TLS/plain | plain mean us | TLS mean us |",
        "|---|---|---|---|---|---|---|",
    ]
    for depth in ["qd1", "qd32"]:
        plain, tls = figures.get(f"plain-{depth}"), figures.get(f"tls-{depth}")
        if plain and tls:
            (p, n), (t, _) = plain, tls
            lines.append(f"| {depth.upper()} | {n} | {p[0]} | {t[0]} | {t[0] / p[0]:.2f} | {p[1]:.0f} | {t[1]:.0f} |")
    lines += [
        "",
        "Reading: with kTLS the engine seals each read's data once and the host opens it once. At",
        "4 KiB, TLS adds about twice the 'us per 4 KiB I/O' figure to QD1 latency (one seal, one",
        "open), and takes one such figure of a reactor's core per I/O. The guest's ratio is lower",
        "than hardware would give: its CPU, AES instructions included, is emulated. This",
        "machine's kernel has no kTLS, so the engine's own TLS throughput cannot be measured here.",
    ]
    text = "\n".join(lines) + "\n"
    pathlib.Path(a.out).write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
