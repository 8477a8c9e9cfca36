#!/usr/bin/env python3
"""verbs-diff.py SOFTVERBS.txt RXE.txt [DIFFERENCES]: compares what two
devices reported to crates/softverbs/examples/verbs_probe.rs.

Every probe line (`key = value`) must be the same on both devices, unless
the documented differences (default crates/softverbs/tests/rxe_differences.txt)
list that key with exactly the two values seen and a reason. A listed
difference that no longer occurs is an error too, so the list stays true.
Prints a table of what agreed and what differed; exit 0 when everything is
accounted for, 1 otherwise, 2 on bad input.
"""
import os
import sys


def probe_lines(path):
    out = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if " = " not in line:
                continue  # not a probe line (a VM's own output)
            key, value = line.split(" = ", 1)
            if key in out:
                sys.exit(f"{path}:{n}: {key} twice")
            out[key] = value
    if not out:
        sys.exit(f"{path}: no probe lines (did the probe run?)")
    return out


def differences(path):
    """key -> (softverbs value, rxe value, reason), from lines
    `key | softverbs value | rxe value | reason`."""
    out = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = [p.strip() for p in line.split("|")]
            if len(parts) != 4 or not all(parts):
                sys.exit(f"{path}:{n}: want `key | softverbs | rxe | reason`")
            out[parts[0]] = tuple(parts[1:])
    return out


def main():
    if len(sys.argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    here = os.path.dirname(os.path.abspath(__file__))
    listed_path = sys.argv[3] if len(sys.argv) == 4 else os.path.join(
        here, "..", "crates", "softverbs", "tests", "rxe_differences.txt")
    sv, rxe = probe_lines(sys.argv[1]), probe_lines(sys.argv[2])
    listed = differences(listed_path)
    bad = []
    agreed = differed = documented = 0
    for key in sorted(set(sv) | set(rxe)):
        a, b = sv.get(key, "(absent)"), rxe.get(key, "(absent)")
        if a == b:
            agreed += 1
            if key in listed:
                bad.append(f"{key}: listed as a difference, but both say {a!r}")
            continue
        differed += 1
        want = listed.get(key)
        if want is None:
            bad.append(f"{key}: softverbs {a!r}, rxe {b!r} (not a documented difference)")
        elif want[:2] != (a, b):
            bad.append(f"{key}: softverbs {a!r}, rxe {b!r}; documented as "
                       f"{want[0]!r} / {want[1]!r}")
        else:
            documented += 1
            print(f"  documented: {key}: softverbs {a!r}, rxe {b!r} — {want[2]}")
    for key in sorted(set(listed) - set(sv) - set(rxe)):
        bad.append(f"{key}: listed, but neither device reported it")
    print(f"verbs-diff: {agreed + differed} probe values, {agreed} agree, "
          f"{differed} differ ({documented} documented)")
    for b in bad:
        print(f"  FAIL {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
