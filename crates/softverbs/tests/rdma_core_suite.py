#!/usr/bin/python3
"""rdma-core's own test suite (Debian's python3-pyverbs ships it under the
package's doc directory) on a verbs device, with per-module counts.

Usage (under softverbs-run, as .ci/softverbs.sh does):

    rdma_core_suite.py --dev softverbs0 --work DIR [--min-pass N]
                       [--src /usr/share/doc/rdma-core/tests]

The suite is copied into DIR (its modules are shipped gzipped) without the
vendor-specific modules (mlx5, efa, hns, ...: they test one vendor's
hardware through its direct-verbs interface) and without the rdma_cm
modules (they need a connection manager, a separate component), then run
with unittest as the suite's own run_tests.py does. Prints one line per
module (passed / skipped / failed / errors), each distinct skip reason with
its count, and the verdict. Exits 1 on any failure or error, or on fewer
than --min-pass passing tests; 2 when the suite is not installed.
"""

import argparse
import collections
import gzip
import os
import shutil
import sys
import unittest

VENDORS = ("mlx5", "efa", "hns", "bnxt", "irdma", "qedr", "cxgb", "erdma", "mana", "siw", "rxe")
SKIPPED_MODULES = ("rdmacm",)


def excluded(name):
    """Whether a test module of the suite is left out (vendor or rdma_cm)."""
    if not name.startswith("test_"):
        return False
    return any(v in name for v in VENDORS + SKIPPED_MODULES)


def stage(src, work):
    """Copy the suite into `work`, gunzipped, without excluded modules."""
    dst = os.path.join(work, "tests")
    if os.path.exists(dst):
        shutil.rmtree(dst)
    os.makedirs(dst)
    left_out = []
    for fn in sorted(os.listdir(src)):
        path = os.path.join(src, fn)
        name = fn[:-3] if fn.endswith(".gz") else fn
        if not name.endswith(".py"):
            continue
        if excluded(name):
            left_out.append(name)
            continue
        opener = gzip.open if fn.endswith(".gz") else open
        with opener(path, "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    return dst, left_out


class Recorder(unittest.TextTestResult):
    """Counts outcomes per module and keeps the skip reasons."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.per_module = collections.defaultdict(collections.Counter)
        self.reasons = collections.Counter()
        self.passed = 0

    @staticmethod
    def module(test):
        parts = test.id().split(".")
        return parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]

    def addSuccess(self, test):
        super().addSuccess(test)
        self.passed += 1
        self.per_module[self.module(test)]["passed"] += 1

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.per_module[self.module(test)]["skipped"] += 1
        self.reasons[reason] += 1

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.per_module[self.module(test)]["failed"] += 1

    def addError(self, test, err):
        super().addError(test, err)
        # A setUpClass/module error has no module of its own in its id.
        self.per_module[self.module(test)]["errors"] += 1

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self.per_module[self.module(test)]["expected failures"] += 1

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self.per_module[self.module(test)]["failed"] += 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dev", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--src", default="/usr/share/doc/rdma-core/tests")
    ap.add_argument("--min-pass", type=int, default=0)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    if not os.path.isdir(args.src):
        print(f"rdma-core suite: {args.src} not found (install python3-pyverbs)")
        return 2
    tests_dir, left_out = stage(args.src, args.work)
    print(f"rdma-core suite: {len(left_out)} modules left out: {' '.join(left_out)}")
    sys.path.insert(0, args.work)
    sys.path.insert(0, tests_dir)
    # The suite reads its options through its own parser (args_parser).
    sys.argv = [os.path.join(tests_dir, "run_tests.py"), "--dev", args.dev]
    from args_parser import parser  # noqa: E402 (the staged suite)

    parser.parse_args()
    import tests  # noqa: E402

    suite = unittest.defaultTestLoader.loadTestsFromModule(tests)
    runner = unittest.TextTestRunner(
        stream=sys.stdout, verbosity=2 if args.verbose else 1, resultclass=Recorder
    )
    res = runner.run(suite)
    total = collections.Counter()
    print(f"\n{'module':<28}{'passed':>8}{'skipped':>9}{'failed':>8}{'errors':>8}")
    for mod in sorted(res.per_module):
        c = res.per_module[mod]
        total.update(c)
        print(f"{mod:<28}{c['passed']:>8}{c['skipped']:>9}{c['failed']:>8}{c['errors']:>8}")
    print(
        f"{'total':<28}{total['passed']:>8}{total['skipped']:>9}"
        f"{total['failed']:>8}{total['errors']:>8}"
    )
    print("\nskip reasons:")
    for reason, n in res.reasons.most_common():
        print(f"  {n:3}  {reason}")
    bad = total["failed"] + total["errors"]
    ok = bad == 0 and res.passed >= args.min_pass
    print(
        f"\nrdma-core suite: {res.passed} passed, {total['skipped']} skipped, "
        f"{total['failed']} failed, {total['errors']} errors "
        f"(need 0 failed/errors and >= {args.min_pass} passed): {'PASSED' if ok else 'FAILED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
