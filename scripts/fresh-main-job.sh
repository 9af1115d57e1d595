#!/usr/bin/env bash
# Checks that the main job sets itself up on a fresh machine: `scripts/train.sh` runs inside a
# minimal Debian tree made now by debootstrap (the release this machine runs, nothing of this
# machine's packages in it), with the repository's tracked scripts and data copied in and a
# given asr binary standing in for the build (there is no Rust toolchain in the tree). There
# train.sh must install its system packages (scripts/system-packages/main-job.txt), fetch and
# import the two games, and train its first steps on them with the games required
# (ASR_REQUIRE_GAMES=1, so a missing package fails the check instead of falling back to the
# bundled corpus). Exits non-zero when any of it fails. Needs root (debootstrap, chroot, mount)
# and Debian's archive.
#
#   bash scripts/fresh-main-job.sh ASR_BINARY [extra `asr train` arguments]
#
# The training stops after STEPS steps (default 2) of one epoch, then train.sh scores the model
# on the test sets (the decoding with the phone LM, which needs nothing more from the system, is
# left out: PHONE_LM=0). The tree is made in a temporary folder under $FRESH_ROOT_PARENT
# (default /tmp) and removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:?usage: fresh-main-job.sh ASR_BINARY [asr train arguments]}
shift
[ -x "$bin" ] || { echo "fresh-main-job: $bin is not an executable" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "fresh-main-job: needs root (debootstrap, chroot, mount)" >&2; exit 1; }

source scripts/fresh-debian.sh
trap fresh_debian_cleanup EXIT
start=$SECONDS
fresh_debian fresh-main-job

# What a fresh clone holds of scripts/ and data/ (nothing fetched or made since), and the binary.
mkdir -p "$root/work"
git ls-files -z scripts data | xargs -0 cp --parents -t "$root/work"
cp "$bin" "$root/usr/local/bin/asr"
# The binary's libraries must all be in the tree already (a release build needs no more).
missing=$(chroot "$root" ldd /usr/local/bin/asr | grep 'not found' || true)
if [ -n "$missing" ]; then
    echo "fresh-main-job: the asr binary needs libraries a fresh Debian lacks:" >&2
    echo "$missing" >&2
    exit 1
fi

chroot "$root" env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root LANG=C.UTF-8 ASR_BIN=/usr/local/bin/asr ASR_REQUIRE_GAMES=1 EPOCHS=1 PHONE_LM=0 \
    bash -c 'cd /work && bash scripts/train.sh --stop-after-steps "$0" "$@"' "${STEPS:-2}" "$@"
echo "fresh-main-job: passed in $((SECONDS - start)) s"
