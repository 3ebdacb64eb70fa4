#!/usr/bin/env python3
"""bench/regression-table.py OUT_DIR SCENARIO...: the table of bench/regression.sh.

Reads OUT_DIR/raw/<scenario>-<old|new>-<round>.json and prints, per headline row, the median
over the rounds of each build and new ÷ old (every figure is a throughput: above 1, the new
build is faster). A second ratio divides each run's figure by its reference measured in the
same run first (the raw backend in the engine's round-robin, nbdkit's server of the same fio
job, the bare rotation of the same bytes): what the machine's load did to that run cancels
out, so on a busy host it is the steadier of the two.
"""
import glob
import json
import os
import statistics
import sys

MIB = 1 << 20
# Served by the same binaries for both builds: their ratios show the noise.
REFERENCE_NBD = ("nbdkit-plain", "nbdkit-luks1", "qsd-luks1")
SLOWER = 0.97


def rows(scenario, report):
    """(row name, is a reference, unit, throughput, reference throughput) of one run."""
    if scenario == "engine":
        raw = {
            (r["backend"], r["scenario"], r["cipher"]): r["value"]["median"]
            for r in report["rows"]
            if r["variant"] == "raw"
        }
        for r in report["rows"]:
            if r["unit"] != "MB/s":
                continue
            # The raw backend, the bare cipher and the limit computed from them.
            ref = r["variant"].startswith("raw") or r["variant"] in ("cipher x cores", "limit")
            name = f'{r["backend"]}: {r["scenario"]}, {r["cipher"]}, {r["variant"]}'
            base = raw.get((r["backend"], r["scenario"], r["cipher"]))
            yield name, ref, "MB/s", r["value"]["median"], base
    elif scenario == "nbd":
        by_job = {}
        for r in report["rows"]:
            by_job.setdefault(r["job"]["name"], {})[r["target"]] = r["mib_s"]["median"]
        for r in report["rows"]:
            job = r["job"]["name"]
            base = next((by_job[job][t] for t in REFERENCE_NBD[:2] if t in by_job[job]), None)
            name = f'{job}: {r["target"]}'
            yield name, r["target"] in REFERENCE_NBD, "MiB/s", r["mib_s"]["median"], base
    elif scenario == "reencrypt":
        data = report["data_bytes"]
        for r in report["rows"]:
            name = f'{r["resilience"]}, {r["busy_threads"]} busy threads'
            bare = data / MIB / r["bare_s"]["median"]
            yield name, False, "MiB/s", data / MIB / r["ucrypt_s"]["median"], bare


def ok(x):
    return x is not None and x == x and x > 0


def main():
    out, scenarios = sys.argv[1], sys.argv[2:]
    worst, summary = [], []
    print("Medians over the rounds of each build; new ÷ old above 1: the new build is faster.")
    print("to ref: each run's figure ÷ its reference in the same run (engine: the raw backend;")
    print("nbd: nbdkit's plain server, or its luks filter for the disk jobs; reencrypt: the bare")
    print("rotation), then new ÷ old of the medians. (ref) rows do not run the code under test.\n")
    for s in scenarios:
        table = {}  # name -> (ref, unit, {build: [values]}, {build: [value ÷ reference]})
        runs = {"old": 0, "new": 0}
        for build in runs:
            for path in sorted(glob.glob(os.path.join(out, "raw", f"{s}-{build}-*.json"))):
                try:
                    with open(path) as f:
                        report = json.load(f)
                except (OSError, ValueError) as e:
                    print(f"{path}: skipped ({e})\n")
                    continue
                runs[build] += 1
                for name, ref, unit, v, base in rows(s, report):
                    e = table.setdefault(name, (ref, unit, {"old": [], "new": []},
                                                {"old": [], "new": []}))
                    if ok(v):
                        e[2][build].append(v)
                        if ok(base):
                            e[3][build].append(v / base)
        print(f"### {s} ({runs['old']} runs of old, {runs['new']} of new)\n")
        print("| row | unit | old | new | new ÷ old | to ref |")
        print("|---|---|---:|---:|---:|---:|")
        ratios, normed, refs = [], [], []
        for name, (ref, unit, v, n) in table.items():
            if not v["old"] or not v["new"]:
                continue
            o, w = statistics.median(v["old"]), statistics.median(v["new"])
            r = w / o
            rn = None
            if n["old"] and n["new"] and not name.endswith(": nbdkit-plain"):
                rn = statistics.median(n["new"]) / statistics.median(n["old"])
            shown = "–" if rn is None or (ref and s == "engine") else f"{rn:.3f}"
            flag = ""
            if ref:
                refs.append(r)
            else:
                ratios.append(r)
                if rn is not None:
                    normed.append(rn)
                if r < SLOWER and (rn is None or rn < SLOWER):
                    flag = " **slower**"
                    worst.append((r, rn, s, name))
            label = f"{name} (ref)" if ref else name
            print(f"| {label} | {unit} | {o:.0f} | {w:.0f} | {r:.3f} | {shown}{flag} |")
        print()
        for what, rs in (("ucrypt", ratios), ("ucrypt to ref", normed), ("reference", refs)):
            if rs:
                line = (f"{s}: {len(rs)} {what} rows, new ÷ old geometric mean "
                        f"{statistics.geometric_mean(rs):.3f}, range {min(rs):.3f}–{max(rs):.3f}")
                if what != "reference":
                    line += f", {sum(x < SLOWER for x in rs)} more than 3 % slower"
                summary.append(line)
                print(line + ".\n")
    print("### Summary\n")
    for line in summary:
        print(f"- {line}.")
    if worst:
        print("\nMore than 3 % slower by both ratios (rerun alone, with more rounds, to tell noise")
        print("from a regression):")
        for r, rn, s, name in sorted(worst, key=lambda w: w[0]):
            also = "" if rn is None else f", to ref {rn:.3f}"
            print(f"- {s}: {name}: {r:.3f}{also}")


main()
