#!/usr/bin/env bash
# The quick check, for while you work (under 5 minutes on a warm target/):
# fmt, clippy on the default features, and the tests of what changed.
#
#   bash scripts/check.sh                  # the packages changed since main
#   bash scripts/check.sh cqd-core cqd     # these packages
#   CHECK_BASE=HEAD~3 bash scripts/check.sh
#
# "Changed" is every file that differs from CHECK_BASE (default: the
# branch's upstream if it has one, else `main`) in the work tree, committed
# or not, plus untracked files. A file under crates/NAME/ belongs to the
# package NAME, anything else that cargo builds (src/, tests/, examples/,
# benches/, Cargo.toml, Cargo.lock) to the facade `cqd`. Each changed
# package brings the packages that depend on it, and softverbs brings
# cqd-verbs and cqd-demo, whose tests run on its device. The tests run
# through scripts/test.sh, so they run as the README's test command runs
# them (doctests, then nextest; the softverbs tests under the launcher where
# it can run, counted skipped where it cannot).
#
# What this does not do is what `bash .ci/run` does besides: clippy with the
# optional features, the docs, loom, Miri, sanitizers, fuzzing, the release
# smoke runs, rdma-core's clients and the rxe VMs. Run that before a
# submission, or after changing a protocol, unsafe code, a feature or CI
# itself (docs/reliability.md says which check covers what).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
say() { printf 'check: %s\n' "$*"; }

say "fmt"
cargo fmt --all --check
say "clippy (default features)"
cargo clippy --workspace --all-targets --quiet -- -D warnings

if (($#)); then
  pkgs=("$@")
else
  base=${CHECK_BASE:-$(git rev-parse --abbrev-ref --symbolic-full-name '@{upstream}' 2>/dev/null || echo main)}
  git rev-parse --verify --quiet "$base^{commit}" >/dev/null ||
    { say "no commit '$base' to compare with: name the packages, or set CHECK_BASE"; exit 2; }
  changed=$( { git diff --name-only "$base"; git ls-files --others --exclude-standard; } | sort -u)
  # The mapping, with the workspace graph from cargo metadata.
  meta=$(cargo metadata --format-version 1 --no-deps)
  mapfile -t pkgs < <(CHANGED="$changed" python3 -c '
import json, os, sys
meta = json.load(sys.stdin)
root = meta["workspace_root"] + "/"
dirs = {}
users = {}
for p in meta["packages"]:
    d = os.path.dirname(p["manifest_path"]) + "/"
    dirs[p["name"]] = d[len(root):]
    for dep in p["dependencies"]:
        if dep.get("path"):
            users.setdefault(dep["name"], set()).add(p["name"])
# Tests that run on the softverbs device.
users.setdefault("softverbs", set()).update({"cqd-verbs", "cqd-demo"})
facade = ("src/", "tests/", "examples/", "benches/", "Cargo.toml", "Cargo.lock", "build.rs")
todo = set()
for f in os.environ["CHANGED"].split("\n"):
    if not f:
        continue
    own = [n for n, d in dirs.items() if d and f.startswith(d)]
    if own:
        todo.add(own[0])
    elif f.startswith(facade):
        todo.add("cqd")
        if f == "Cargo.lock":
            todo.update(dirs)
seen = set()
while todo:
    n = todo.pop()
    if n not in seen:
        seen.add(n)
        todo |= users.get(n, set())
print("\n".join(sorted(seen)))
' <<<"$meta")
  if ((${#pkgs[@]} == 0)); then
    say "nothing that cargo builds changed since $base: no tests to run" \
      "(name packages, or set CHECK_BASE to an older commit)"
    say "done in $(($(date +%s) - start)) s"
    exit 0
  fi
  say "changed since $base: ${pkgs[*]}"
fi

args=()
for p in "${pkgs[@]}"; do args+=(-p "$p"); done
say "tests of ${pkgs[*]}"
bash scripts/test.sh "${args[@]}"
say "done in $(($(date +%s) - start)) s"
