#!/usr/bin/env bash
# Reproduces the heads for the embedded default model (SmolLM2-135M-Instruct): self-distillation,
# Medusa-1 training, tree calibration, and the EAGLE-style draft to compare with them (`medusa bench
# --suite`). Every step resumes: rerun the script after a stop.
# The prompt order is a seeded permutation of train_prompts.jsonl, so a larger PROMPTS extends the
# same data. Set SHIP=1 to copy the result into the package (medusa_heads/default_heads with the heads'
# replay record, from which tree="auto" chooses on each machine; trees/default.json, the fallback tree).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-../shared/data}
WORK=${WORK:-runs/default-heads}
# prompts to distill and train on (continuously batched, 64 at a time); the last 250 of the 12,790 are held
# out, at least 3 of each suite category, for `medusa calibrate` and `medusa bench --suite`
PROMPTS=${PROMPTS:-12540}
ANSWERS=${ANSWERS:-data/default-heads.answers.jsonl.gz}   # the answers alone, committed: a fresh checkout reuses them
EPOCHS=${EPOCHS:-3}
DRAFT_EPOCHS=${DRAFT_EPOCHS:-2}   # the EAGLE-style draft's
HEADS=${HEADS:-4}
LAYERS=${LAYERS:-2}
MEDUSA=.venv/bin/medusa
# the frozen backbone's hidden states, shared by the heads and the draft: in the package's cache folder, outside the
# checkout, so a later run (another session's, a larger PROMPTS) computes only the conversations not yet cached
HIDDEN_CACHE=${HIDDEN_CACHE:-$(.venv/bin/python -c 'from medusa_heads import default; print(default.cache_dir())')/hidden-cache}
mkdir -p "$WORK"
[ -f "$DATA/train_prompts.jsonl" ] || { echo "$DATA/train_prompts.jsonl not found: set DATA=" >&2; exit 2; }

# float32, the exact path, unless DTYPE=bfloat16 (then training autocasts too; the heads still learn from
# float32 hidden states, in float32 weights). Which is faster depends on the machine: bfloat16 answered 2.4x
# faster on a Sapphire Rapids (AMX), float32 ~1.6x faster on an AVX512-BF16 AMD EPYC (Zen 5): time both.
dtype=${DTYPE:-float32} bf16=()
[ "$dtype" = bfloat16 ] && bf16=(--bf16)
time "$MEDUSA" distill --prompts "$DATA/train_prompts.jsonl" --sample 12790 --seed 0 --limit "$PROMPTS" \
  --out "$WORK/distilled.jsonl" --answers "$ANSWERS" --batch-size 64 --max-new-tokens 256 --dtype "$dtype"

resume=()
[ -d "$WORK/heads/checkpoint" ] && resume=(--resume)
time "$MEDUSA" train --data "$WORK/distilled.jsonl" --out "$WORK/heads" --num-heads "$HEADS" --num-layers "$LAYERS" \
  --chained --projection shared --draft-vocab 8192 --epochs "$EPOCHS" --batch-size 8 --lr 1e-3 --hidden-cache "$HIDDEN_CACHE" \
  "${bf16[@]}" "${resume[@]}"

time "$MEDUSA" calibrate --heads "$WORK/heads" --prompts "$DATA/train_prompts.jsonl" --exclude "$WORK/distilled.jsonl" \
  --limit 20 --out "$WORK/tree.json"

# the EAGLE-style draft on the same data and the same cached hidden states (DRAFT_EPOCHS=0 leaves it out)
if [ "$DRAFT_EPOCHS" -gt 0 ]; then
  resume=()
  [ -d "$WORK/eagle/checkpoint" ] && resume=(--resume)
  time "$MEDUSA" train --draft eagle --draft-vocab 8192 --data "$WORK/distilled.jsonl" --out "$WORK/eagle" \
    --hidden-cache "$HIDDEN_CACHE" --epochs "$DRAFT_EPOCHS" --batch-size 8 --lr 1e-3 "${bf16[@]}" "${resume[@]}"
  time "$MEDUSA" calibrate --heads "$WORK/eagle" --prompts "$DATA/train_prompts.jsonl" --exclude "$WORK/distilled.jsonl" \
    --limit 20 --out "$WORK/eagle-tree.json"
fi

if [ "${SHIP:-0}" = 1 ]; then
  mkdir -p medusa_heads/default_heads
  cp "$WORK/heads/config.json" "$WORK/heads/model.safetensors" "$WORK/heads/replay.json" medusa_heads/default_heads/
  cp "$WORK/tree.json" medusa_heads/trees/default.json
  echo "shipped: medusa_heads/default_heads and medusa_heads/trees/default.json"
fi
