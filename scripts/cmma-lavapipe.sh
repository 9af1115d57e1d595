#!/usr/bin/env bash
# Runs the tests of the kernels on cooperative matrices (clustered-attention's `cmma` feature)
# without a GPU, on Mesa's software Vulkan driver. lavapipe has VK_KHR_cooperative_matrix
# (8 × 8 × 8 tiles, f16 into f32) from Mesa 25.1 on, and Debian 12 ships Mesa 22.3 (25.0 in its
# backports, without it), so the driver comes from a minimal Debian unstable tree made by
# debootstrap (about 250 MB, once, in $CMMA_ROOT, default ~/.cache/ca-sid). The suite is built
# here with `--features vulkan,cmma` (WGPU through SPIR-V, as cooperative matrices need) and
# its cmma test runs inside that tree through chroot. Needs root (debootstrap, chroot, mount).
#
#   bash scripts/cmma-lavapipe.sh [extra test-harness arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
root=${CMMA_ROOT:-$HOME/.cache/ca-sid}
test_name=gpu::wgpu::cmma_products_match_reference

if [ ! -e "$root/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so" ]; then
    command -v debootstrap >/dev/null ||
        env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap
    rm -rf "$root"
    debootstrap --variant=minbase --include=mesa-vulkan-drivers,libvulkan1 sid "$root" \
        http://deb.debian.org/debian
fi
echo "driver: $(chroot "$root" dpkg-query -W -f '${Package} ${Version}' mesa-vulkan-drivers)"

build=(cargo test -p clustered-attention --features vulkan,cmma --test suite --no-run)
"${build[@]}"
binary=$("${build[@]}" 2>&1 | sed -n 's/.*Executable tests\/suite\/main.rs (\(.*\))$/\1/p')
[ -x "$binary" ] || { echo "no test binary from: ${build[*]}" >&2; exit 1; }

cp "$binary" "$root/tmp/clustered-attention-suite"
# The suite's child processes find themselves through /proc/self/exe.
mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
trap 'umount "$root/proc" 2>/dev/null || true; rm -f "$root/tmp/clustered-attention-suite"' EXIT
chroot "$root" env XDG_RUNTIME_DIR=/tmp CUBECL_AUTOTUNE_LEVEL=minimal \
    /tmp/clustered-attention-suite --exact "$test_name" --nocapture "$@"
