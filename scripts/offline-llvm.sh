#!/usr/bin/env bash
# Sets up, from Debian's packages, the LLVM that Burn 0.22's CUDA backend links, so that it
# builds on a machine that cannot reach GitHub. burn-cuda 0.22 depends on cubecl-cuda 0.11, which
# depends (not optionally) on cubecl-llvm, whose dependency tracel-llvm-bundler downloads an LLVM
# build from github.com/tracel-ai/tracel-llvm in its build script, unless its folder
# (${XDG_DATA_HOME:-~/.local/share}/tracel/tracel-llvm-VERSION) holds the marker
# `.tracel-llvm-installed`; cubecl-llvm then asks that folder's `bin/llvm-config` how to link.
# This script installs Debian's LLVM 22 development packages (llvm-22-dev, libpolly-22-dev,
# libzstd-dev: as root or through sudo), writes the marker and makes `bin/llvm-config` a wrapper
# of Debian's that names libraries as `-lNAME` (the bundler would turn an absolute
# `/…/libz3.so` into `-llibz3`). LLVM 22 stands in for the bundle's 23 where cubecl's `cuda-cpp`
# feature is on (a build on Burn 0.22 must turn it on): the kernels are then compiled by NVRTC at
# run time, and LLVM is linked in (statically) but not on that path. None of this is promised upstream: it relies
# on the bundler's marker and folder names (read from tracel-llvm-bundler 23.1.0-4's build.rs
# and config.rs), and a newer bundler version needs its own folder (TRACEL_LLVM_VERSION).
#
#   bash scripts/offline-llvm.sh          # once per machine; safe to run again
#
# With internet, none of this is needed: the bundler downloads its own LLVM. Exits non-zero,
# saying why, when the packages cannot be installed. Run again, it changes nothing that is
# already right: the wrapper is rewritten, and the marker touched, only when the wrapper's
# text differs (or the marker is missing), since the bundler's build script reruns (and with
# it the build of cubecl-llvm and of every crate above it) whenever the marker's mtime moves.
# A folder that holds the bundler's own download (its `bin/llvm-config` not this script's
# wrapper) is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
# The bundler's version that cubecl-llvm depends on, as Cargo.lock has it where it is locked,
# else the one this was read from (burn 0.22.1's).
version=$(awk '
    /^\[\[package\]\]/ { name = ""; deps = 0 }
    /^name = / { gsub(/"/, "", $3); name = $3 }
    /^version = / && name == "tracel-llvm-bundler" { gsub(/"/, "", $3); versions[$3] = 1 }
    name == "cubecl-llvm" && /^dependencies = \[/ { deps = 1 }
    deps && /"tracel-llvm-bundler/ { gsub(/[",]/, ""); wanted = ($2 == "" ? "any" : $2) }
    deps && /^\]/ { deps = 0 }
    END {
        if (wanted == "any") for (v in versions) wanted = v
        if (wanted != "") print wanted
    }' Cargo.lock)
version=${TRACEL_LLVM_VERSION:-${version:-23.1.0-4}}
dir="${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-$version"
llvm=/usr/lib/llvm-22

marker="$dir/.tracel-llvm-installed"
if [ -e "$marker" ] && [ -e "$dir/bin/llvm-config" ] &&
    ! grep -qs 'scripts/offline-llvm.sh' "$dir/bin/llvm-config"; then
    echo "offline-llvm: $dir holds the bundler's own LLVM; left as it is"
    exit 0
fi

source scripts/system-packages/install.sh
if ! install_system_packages <(printf '%s\n' llvm-22-dev libpolly-22-dev libzstd-dev); then
    echo "offline-llvm: without these packages, Burn's CUDA backend downloads LLVM while it builds (needs github.com)" >&2
    exit 1
fi
mkdir -p "$dir/bin"
wrapper=$(mktemp)
trap 'rm -f "$wrapper"' EXIT
cat >"$wrapper" <<EOF
#!/usr/bin/env bash
# Debian's LLVM 22 standing in for tracel-llvm $version (scripts/offline-llvm.sh): absolute
# library paths become -lNAME.
set -eo pipefail
$llvm/bin/llvm-config "\$@" | sed -E 's#(^| )/[^ ]*/lib([A-Za-z0-9_+-]+)\\.(so|a)#\\1-l\\2#g'
EOF
if ! cmp -s "$wrapper" "$dir/bin/llvm-config"; then
    cp "$wrapper" "$dir/bin/llvm-config"
    chmod 755 "$dir/bin/llvm-config"
    # Other flags from the wrapper: the marker's new mtime has cubecl-llvm built again.
    touch "$marker"
fi
[ -e "$marker" ] || touch "$marker"
echo "offline-llvm: $dir/bin/llvm-config wraps Debian's LLVM $("$dir/bin/llvm-config" --version)"
