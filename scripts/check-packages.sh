#!/usr/bin/env bash
# Type-checks each package of the workspace on its own, as a user builds it, and the
# clustered-attention crate with each of its backend features alone.
#
# A build of the whole workspace (the tests', the docs') unifies the features that all its
# packages ask of their dependencies, so a package that uses a feature it does not ask for
# compiles there and fails on its own: `cargo run -p text-encoder` once failed with
# "unresolved import burn::optim" while every workspace build passed, asr-model having turned
# Burn's `optim` on for it. Here each package is checked alone with its default features, its
# library and programs (what `cargo build -p P` and `cargo install` compile, without the
# dev-dependencies, whose features Cargo would unify in; the tests, examples and benchmarks are
# built by the workspace's test build and type-checked by its CUDA check, and checking each
# package's again alone took 2.3 minutes of a cold CI); then clustered-attention's library
# with each backend feature alone and its default features off (`flex`, the default, is
# checked with the package; `vulkan` is `wgpu` as far as the crate's code goes).
#
# The programs ask Burn for one set of features (Cargo.toml), so most of these checks reuse
# each other's checked dependencies; the last check fails when asr and text-encoder resolve a
# shared dependency with different features, which would make each rebuild Burn's crates
# after the other (crates/program-deps). The `cuda` check needs the LLVM of
# scripts/offline-llvm.sh (scripts/test.sh runs it before this).
#
# Use: bash scripts/check-packages.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

packages=$(cargo metadata --locked --no-deps --format-version 1 |
    python3 -c 'import json, sys; print(" ".join(p["name"] for p in json.load(sys.stdin)["packages"]))')
checks=0
# check WHAT ARGS…: one `cargo check`, named and timed.
check() {
    local what=$1 start=$SECONDS
    shift
    cargo check --locked --quiet "$@"
    checks=$((checks + 1))
    echo "check-packages: $what: $((SECONDS - start)) s"
}
for package in $packages; do
    check "$package, its library and programs" -p "$package"
done
# `vulkan` is `wgpu` with Burn's Vulkan backend: the crate's code has no `vulkan` of its own.
for feature in ndarray wgpu cuda; do
    check "clustered-attention with $feature alone" -p clustered-attention \
        --no-default-features --features "$feature"
done

# asr and text-encoder resolve every dependency they share with the same features, so that a
# release build of one after the other rebuilds none of Burn's crates (crates/program-deps
# asks for the union; a new dependency may need an entry there).
echo "check-packages: the programs' shared dependencies' features"
for program in asr-model text-encoder; do
    cargo tree --locked -p "$program" -e normal,build --prefix none --no-dedupe -f '{p}|{f}' |
        sort -u >"$tmp/$program.txt"
done
python3 - "$tmp/asr-model.txt" "$tmp/text-encoder.txt" <<'PY'
import sys
def features(path):
    found = {}
    for line in open(path):
        if "|" in line:
            package, features = line.rstrip("\n").split("|", 1)
            found.setdefault(package, set()).add(features)
    return found
asr, text = features(sys.argv[1]), features(sys.argv[2])
differ = [p for p in sorted(set(asr) & set(text)) if asr[p] != text[p]]
for p in differ:
    print(f"  {p}: asr {sorted(asr[p])}, text-encoder {sorted(text[p])}")
if differ:
    sys.exit(f"check-packages: {len(differ)} shared dependencies with other features in asr and "
             "text-encoder (add the union to crates/program-deps/Cargo.toml)")
print(f"check-packages: {len(set(asr) & set(text))} shared dependencies, the same features")
PY
echo "check-packages: $((checks + 1)) checks passed in $SECONDS s"
