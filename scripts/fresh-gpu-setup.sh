#!/usr/bin/env bash
# Checks the CUDA kit's set-up on a machine without the CUDA toolkit: `gpu-kit/run.sh
# --check-setup` runs inside a minimal Debian tree made now by debootstrap (the release this
# machine runs), where python3 has PyPI's NVRTC wheel (nvidia-cuda-nvrtc, as PyTorch installs
# it) and nothing else of CUDA: no toolkit, no headers, no driver. There run.sh must find NVRTC
# in python3's site-packages, point CUDA_PATH at the kit's own headers (cuda-headers.tar.xz),
# compile a probe kernel with them through NVRTC, and stop where the driver is needed. Exits
# non-zero when any of it fails. Needs root (debootstrap, chroot, mount) and Debian's archive
# and PyPI (from this machine: the tree installs the wheel from a file).
#
#   bash scripts/fresh-gpu-setup.sh [KIT_DIR]
#
# KIT_DIR (e.g. gpu-kit/tests, from scripts/gpu-bundle.sh) needs run.sh, cuda_offline.py and
# cuda-headers.tar.xz; its bin.tar.xz (the binaries) is not needed, since --check-setup runs
# nothing. Without KIT_DIR, a kit of those three files alone is made in a temporary folder. The tree is made under $FRESH_ROOT_PARENT (default /tmp)
# and removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "fresh-gpu-setup: needs root (debootstrap, chroot, mount)" >&2; exit 1; }

source scripts/fresh-debian.sh
kit_tmp=
trap 'fresh_debian_cleanup; rm -rf "$kit_tmp"' EXIT

kit=${1:-}
if [ -z "$kit" ]; then
    kit_tmp=$(mktemp -d)
    kit=$kit_tmp
    cp scripts/gpu-run.sh "$kit/run.sh"
    cp scripts/cuda_offline.py "$kit/cuda_offline.py"
    cuda_tree=$(bash scripts/cuda-offline.sh --tree)
    tar -C "$cuda_tree" -cf - include | xz -T1 >"$kit/cuda-headers.tar.xz"
fi
[ -f "$kit/run.sh" ] && [ -f "$kit/cuda_offline.py" ] && [ -f "$kit/cuda-headers.tar.xz" ] ||
    { echo "fresh-gpu-setup: $kit needs run.sh, cuda_offline.py and cuda-headers.tar.xz" >&2; exit 1; }

start=$SECONDS
fresh_debian fresh-gpu-setup --include=python3,python3-venv,xz-utils
mkdir -p "$root/work"
cp -r "$kit" "$root/work/gpu-kit"
# The NVRTC wheel, fetched here (pinned by hash) and installed there from the file.
grep '^nvidia-cuda-nvrtc==' scripts/cuda-offline-requirements.txt >"$root/work/nvrtc.txt"
python3 -m pip download --quiet --no-deps --require-hashes --only-binary :all: \
    -r "$root/work/nvrtc.txt" -d "$root/work/wheels"

# python3 with the NVRTC wheel only, in a virtual environment first on PATH (as a machine with
# PyTorch has its NVIDIA wheels); then the kit's set-up.
chroot "$root" env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root LANG=C.UTF-8 bash -c '
        set -euo pipefail
        python3 -m venv /opt/python
        /opt/python/bin/pip install --quiet --no-deps --require-hashes --only-binary :all: \
            --no-index --find-links /work/wheels -r /work/nvrtc.txt
        for cuda in /usr/local/cuda /opt/cuda /usr/bin/nvcc; do
            [ ! -e "$cuda" ] || { echo "fresh-gpu-setup: the tree has $cuda" >&2; exit 1; }
        done
        find / -xdev -name cuda_fp16.h 2>/dev/null | grep -q . &&
            { echo "fresh-gpu-setup: the tree has CUDA headers before the kit" >&2; exit 1; }
        cd /work
        PATH=/opt/python/bin:$PATH bash gpu-kit/run.sh --check-setup'
echo "fresh-gpu-setup: passed in $((SECONDS - start)) s"
