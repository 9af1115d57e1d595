# Sourced by the scripts that install Debian packages (train.sh, test.sh, .ci/run,
# fresh-main-job.sh): defines install_system_packages.

# install_system_packages LIST...
# Installs the Debian packages named in each LIST file (one per line; `#` starts a comment)
# that are not installed yet, with apt-get, as root or through sudo. Returns 0 when every one is
# installed; otherwise prints, on stderr, the packages missing and why they could not be
# installed (no dpkg, neither root nor sudo, apt-get failed), and returns 1.
install_system_packages() {
    local list p packages=() missing=()
    for list in "$@"; do
        mapfile -t -O "${#packages[@]}" packages < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$list" | grep -v '^$' || true)
    done
    if ! command -v dpkg-query >/dev/null || ! command -v apt-get >/dev/null; then
        echo "system packages: not a Debian-based system (no dpkg-query or apt-get); install these by hand: ${packages[*]}" >&2
        return 1
    fi
    for p in "${packages[@]}"; do
        dpkg-query -W -f '${Status}\n' "$p" 2>/dev/null | grep -q ' installed$' || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=()
    if [ "$(id -u)" -ne 0 ]; then
        if ! command -v sudo >/dev/null; then
            echo "system packages: ${missing[*]} missing, and installing needs root or sudo" >&2
            return 1
        fi
        sudo=(sudo)
    fi
    echo "system packages: installing ${missing[*]}" >&2
    if ! "${sudo[@]}" apt-get update -qq ||
        ! "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; then
        echo "system packages: apt-get could not install ${missing[*]}" >&2
        return 1
    fi
}
