# Sourced by the scripts that check a set-up on a fresh machine (scripts/fresh-main-job.sh,
# scripts/fresh-gpu-setup.sh): a minimal Debian tree of the release this machine runs, made by
# debootstrap. Needs root (debootstrap, chroot, mount) and Debian's archive.

# fresh_debian NAME [DEBOOTSTRAP_OPTION...]: makes the tree in a new folder
# $FRESH_ROOT_PARENT/NAME.XXXXXX (default /tmp), its path in $root, with /proc mounted and this
# machine's resolv.conf; `fresh_debian_cleanup` unmounts and removes it (a trap of the caller's
# EXIT should call it). Prints how long debootstrap took.
fresh_debian() {
    local name=$1 suite start
    shift
    source scripts/system-packages/install.sh
    command -v debootstrap >/dev/null || install_system_packages <(echo debootstrap)
    # shellcheck disable=SC1091
    suite=$(. /etc/os-release && echo "$VERSION_CODENAME")
    root=$(mktemp -d "${FRESH_ROOT_PARENT:-/tmp}/$name.XXXXXX")
    # The tree's root as a system's root is (mktemp's 0700 would keep apt's _apt user out).
    chmod 755 "$root"
    start=$SECONDS
    debootstrap --variant=minbase "$@" "$suite" "$root" http://deb.debian.org/debian >/dev/null
    echo "$name: Debian $suite (minbase${*:+ $*}) in $root, $((SECONDS - start)) s"
    cp /etc/resolv.conf "$root/etc/resolv.conf"
    mount -t proc proc "$root/proc"
}

fresh_debian_cleanup() {
    [ -n "${root:-}" ] || return 0
    umount "$root/proc" 2>/dev/null || true
    # Nothing may stay mounted inside the tree when it is removed.
    if ! grep -q " $root/" /proc/mounts; then
        rm -rf "$root"
    else
        echo "$root still has mounts; left in place" >&2
    fi
}
