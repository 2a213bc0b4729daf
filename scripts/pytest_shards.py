#!/usr/bin/env python3
"""Run a pytest selection as N processes at once, so that the kernels its tests compile on first
use (NVRTC, one CPU core each) compile in parallel, on a GPU machine:

    python3 scripts/pytest_shards.py -n 12 --logdir /tmp/shards [--timeout 400] -- PYTEST_ARGS...

The selection (PYTEST_ARGS: files, node ids, -m / -k) is collected once and dealt to the shards
in runs of CHUNK neighbouring ids, round-robin: neighbouring parametrizations mostly share
their kernels, which one shard then compiles, and a family of large tests is spread over shards
that reach it at different times (each shard's tests return CuPy's cached blocks to the device,
tests/conftest.py, but N at once still share one GPU's memory). The other options in
PYTEST_ARGS (-rfE, --maxfail=N, ...) go to every shard; an option's value goes as --name=value,
or as the next argument for the options of VALUED. Shard i
writes LOGDIR/shard<i>.txt. Printed: each shard's exit code and pytest summary line, every
FAILED / ERROR line, the totals. A shard still running at --timeout seconds is killed and
reported so (its log holds how far it got), and one whose summary accounts for fewer tests
than it was dealt (an option that took an id as its value, a shard stopped by --maxfail) is
reported with how many. Exits 0 only when every shard exited 0 and ran all it was dealt.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
CHUNK = 8
# pytest options whose value may come as the next argument: kept with it (any other option
# followed by a word would take that word from the selection, silently).
VALUED = ("--deselect", "--ignore", "--ignore-glob", "--maxfail", "--tb", "--durations", "-o")
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)")
# The kinds of a summary line that a dealt test ends as (a teardown error may add one more).
RAN = ("passed", "failed", "skipped", "errors", "xfailed", "xpassed")


def collect(args: list[str]) -> list[str]:
    done = subprocess.run([*PYTEST, "--collect-only", "-q", *args], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"collection failed (exit {done.returncode}):\n"
                 f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return [line for line in done.stdout.splitlines() if "::" in line]


def shard_options(args: list[str]) -> list[str]:
    """The options every shard takes: all but the selection (paths, -m, -k), which the
    collected ids already are."""
    options, skip, keep = [], False, False
    for a in args:
        if skip:
            skip = False
        elif keep:
            options.append(a)
            keep = False
        elif a in ("-m", "-k"):
            skip = True
        elif a.startswith("-") and not a.startswith(("-m", "-k")):
            options.append(a)
            keep = a in VALUED
    return options


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, required=True, help="processes")
    ap.add_argument("--logdir", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=None, help="seconds for all shards")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = a.pytest_args[1:] if a.pytest_args[:1] == ["--"] else a.pytest_args
    ids = collect(args)
    if not ids:
        sys.exit("no test collected")
    options = shard_options(args)
    a.logdir.mkdir(parents=True, exist_ok=True)
    runs = [ids[i:i + CHUNK] for i in range(0, len(ids), CHUNK)]
    shards = [[t for run in runs[i::a.n] for t in run] for i in range(min(a.n, len(runs)))]
    start = time.perf_counter()
    procs = []
    for i, shard in enumerate(shards):
        log = a.logdir / f"shard{i}.txt"
        with log.open("w") as f:
            procs.append((log, subprocess.Popen([*PYTEST, "-q", *options, *shard],
                                                stdout=f, stderr=subprocess.STDOUT)))
    totals: dict[str, int] = {}
    failures: list[str] = []
    status = 0
    for (log, proc), shard in zip(procs, shards):
        left = None if a.timeout is None else max(0.0, a.timeout - (time.perf_counter() - start))
        try:
            rc = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            print(f"{log.name}: killed at the {a.timeout:.0f}s timeout (see its log)")
            status = 1
            continue
        status |= rc != 0
        lines = log.read_text(errors="replace").splitlines()
        failures += [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
        counted = [ln for ln in lines if COUNTS.search(ln)]
        summary = counted[-1].strip("= ") if counted else "(no summary line)"
        print(f"{log.name}: exit {rc}: {summary}")
        ran = 0
        for count, kind in COUNTS.findall(summary):
            kind = "errors" if kind.startswith("error") else kind
            totals[kind] = totals.get(kind, 0) + int(count)
            ran += int(count) if kind in RAN else 0
        if ran < len(shard):
            print(f"{log.name}: accounts for {ran} of the {len(shard)} tests it was dealt")
            status = 1
    for line in failures:
        print(line)
    total = ", ".join(f"{v} {k}" for k, v in totals.items())
    print(f"total over {len(shards)} shards ({len(ids)} tests): {total or 'none finished'} "
          f"in {time.perf_counter() - start:.1f}s")
    return status


if __name__ == "__main__":
    sys.exit(main())
