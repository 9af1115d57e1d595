# Sourced by scripts/paper-tables.sh and scripts/paper-times.sh: the paper's grid of models
# (§4.1 scaled to a 2-core CPU, docs/paper-tables.md) and the arguments every model of it is
# trained with. Expects `devices` and `backend` to be set.
# The grid: name, attention, layers, the models the tables need most first. The paper's
# 4, 6 and 9 layers become 2, 3 and 4.
grid=(
    "full-4 full 4"
    "clustered-100-4 clustered:100 4"
    "improved-100-4 improved:100:32 4"
    "shared-full-4 shared-full 4"
    "lsh-1-4 lsh:1 4"
    "lsh-4-4 lsh:4 4"
    "blocks-100-4 blocks:100 4"
    "improved-200-4 improved:200:32 4"
    "clustered-200-4 clustered:200 4"
    "full-3 full 3"
    "improved-100-3 improved:100:32 3"
    "full-2 full 2"
    "improved-200-3 improved:200:32 3"
    "clustered-300-4 clustered:300 4"
)
# The plain transformer: stacked frames (4 per step), no convolution module, fixed
# sinusoidal positions; ReLU (Flex evaluates GELU's erf one element at a time).
model=(--front-end stack --subsampling 4 --conv-kernel 0 --d-model 128 --n-heads 4
    --d-ff 512 --activation relu --dropout 0)
training=(--ctc-loss alpha-beta --augment none --batch-frames 6000 --learning-rate 1e-3
    --warmup-steps 200 --devices "$devices" --backend "$backend" --seed 0)
