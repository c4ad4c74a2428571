#!/usr/bin/env bash
# lm-evaluation-harness against `hylora serve --demo`, as scoring clients use a vLLM server:
# `local-completions` with batched requests (batch size 4: a list of prompts per request) and
# loglikelihood through echo + max_tokens 0, on a small local multiple-choice task (no download).
# The demo's weights are random, so the accuracy means nothing; the run completing is the check.
#
#   bash bench/lm_eval_demo.sh            (from the repository root, in the venv of the README)
#
# lm-eval is installed into its own venv (/tmp/hylora-lm-eval) so it does not touch hylora's.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
port=${PORT:-8123}
lm_venv=${LM_EVAL_VENV:-/tmp/hylora-lm-eval}
[ -x "$lm_venv/bin/lm_eval" ] || { python3 -m venv "$lm_venv" && "$lm_venv/bin/pip" install -q "lm_eval[api]" transformers; }

cat > "$work/relics.jsonl" <<'EOF'
{"question": "The relic is a bronze", "choices": [" vessel", " disc", " figure"], "label": 0}
{"question": "The tomb has a sloping ramp", "choices": [" passage", " mural", " coin"], "label": 0}
{"question": "The mural on the east wall shows a procession of", "choices": [" riders", " jade", " bricks"], "label": 0}
{"question": "Pigments: red ochre, malachite", "choices": [" green", " bronze", " ramp"], "label": 0}
EOF
cat > "$work/relics.yaml" <<EOF
task: relics
dataset_path: json
dataset_kwargs:
  data_files: $work/relics.jsonl
test_split: train
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - metric: acc
EOF

hylora serve --demo --device cpu --port "$port" > "$work/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
demo=$(python3 -c "from hylora.demo import default_demo_dir; print(default_demo_dir())")
for model in hylora-demo relic; do  # the base model, then a task adapter
  "$lm_venv/bin/lm_eval" --model local-completions --tasks relics --include_path "$work" --batch_size 4 \
    --model_args "model=$model,base_url=http://127.0.0.1:$port/v1/completions,tokenizer=$demo,num_concurrent=2,max_retries=1"
done
