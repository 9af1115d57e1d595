#!/usr/bin/env bash
# Real recorded English speech for the ASR example, from two freeware games in Debian's archive
# (main): Beneath a Steel Sky (`beneath-a-steel-sky`, Revolution Software) and Flight of the
# Amazon Queen (`flight-of-the-amazon-queen`, Interactive Binary Illusions), whose licences allow
# free redistribution with their notices kept (each corpus keeps its package's `copyright`).
#
# 1. Fetches the two packages with `apt-get download` (as root or through sudo it runs
#    `apt-get update` first when the package lists lack them) and unpacks their files into
#    data/games/debian/ with `dpkg-deb -x`: the game player (scummvm) the packages depend on is
#    not needed, nor installed.
# 2. Unless `--packages-only`: imports each game as a corpus, data/games/sky and
#    data/games/queen (`asr import`; train/dev/test split by speaker or scene), and checks the
#    number of clips against what the data holds (at least 3,300 and 6,400).
#
# The asr binary is $ASR_BIN, else it is built (release). Safe to run again: what is there is
# kept. Exits non-zero, with the reason, when a step fails; nothing is left half-written.
set -euo pipefail
cd "$(dirname "$0")/.."

root=data/games/debian
packages=(beneath-a-steel-sky flight-of-the-amazon-queen)
sky_dir=$root/usr/share/scummvm/beneath-a-steel-sky
queen_dir=$root/usr/share/scummvm/flight-of-the-amazon-queen

fetch_packages() {
    if [ -f "$sky_dir/sky.dsk" ] && [ -f "$queen_dir/queen.1c" ]; then
        return 0
    fi
    if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
        echo "get-real-speech: apt-get and dpkg-deb are needed (a Debian-based system)" >&2
        return 1
    fi
    local tmp
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    if ! (cd "$tmp" && apt-get download "${packages[@]}") 2>"$tmp/err"; then
        local sudo=""
        if [ "$(id -u)" -ne 0 ]; then
            if ! command -v sudo >/dev/null; then
                cat "$tmp/err" >&2
                echo "get-real-speech: the package lists lack the games and updating them needs root or sudo" >&2
                return 1
            fi
            sudo=sudo
        fi
        $sudo apt-get update -qq
        (cd "$tmp" && apt-get download "${packages[@]}")
    fi
    mkdir -p "$tmp/root"
    for deb in "$tmp"/*.deb; do
        dpkg-deb -x "$deb" "$tmp/root"
    done
    mkdir -p "$(dirname "$root")"
    rm -rf "$root"
    mv "$tmp/root" "$root"
    echo "get-real-speech: unpacked ${packages[*]} into $root"
}

# Imports one game unless its corpus is there, then checks its clip count.
import_game() {
    local game=$1 from=$2 at_least=$3 out=data/games/$1
    if [ ! -f "$out/test.jsonl" ]; then
        rm -rf "$out.partial"
        "$bin" import --game "$game" --from "$from" --out "$out.partial"
        rm -rf "$out"
        # The manifests name their audio relative to the corpus, which can thus be moved.
        mv "$out.partial" "$out"
    fi
    local clips
    clips=$(cat "$out/train.jsonl" "$out/dev.jsonl" "$out/test.jsonl" | wc -l)
    if [ "$clips" -lt "$at_least" ]; then
        echo "get-real-speech: $out has $clips clips, expected at least $at_least" >&2
        return 1
    fi
    echo "get-real-speech: $out: $clips clips"
}

fetch_packages
if [ "${1:-}" = "--packages-only" ]; then
    exit 0
fi
bin=${ASR_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release --locked -p asr-model
    bin="${CARGO_TARGET_DIR:-target}/release/asr"
fi
import_game sky "$sky_dir" 3300
import_game queen "$queen_dir" 6400
