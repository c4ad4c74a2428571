#!/bin/bash
# hylora's throughput workload with kernel switches A/B'd on one warm machine, in one device call, from
# the repo root with .vllm and .peerwhl carried (bench/peer/build_bundle.sh; the install is the peer's):
#   AB_VARIANTS="- gdn_single_tokens_recurrent=1 lora_stacked_below=4096 -" bash bench/peer/kernel_ab_gpu.sh
# The 16-layer cut, throughput_peer.py's workload. AB_WEIGHTS (bf16 or fp8, default bf16), AB_MNBT
# (default 2048), AB_REPEATS (default 3) and AB_VARIANTS: one engine each, in order, `-` for the
# defaults, else KernelsConfig fields (`a=1,b=4096`); a variant given twice shows the drift between
# engines. AB_AFTER: throughput_peer.py steps and flags run last on the same checkpoint (e.g.
# "hylora:bf16:8192 --profile-prefill"). One table row per engine into $OUT/ab.md, every record in
# $OUT/ab.tgz, the log in $OUT/ab.log. Run 35 (FP8 fusions): AB_WEIGHTS=fp8 AB_MNBT=8192
# AB_VARIANTS="- fp8_fused_norm_quant=1,fused_lora_expand_quantized=1 fp8_fused_norm_quant=1".
t0=$(date +%s); . bench/peer/install.sh >/dev/null; P="python3 bench/peer/throughput_peer.py run"; A=/tmp/ab
W=${AB_WEIGHTS:-bf16}; M=${AB_MNBT:-2048}; R=${AB_REPEATS:-3}; i=0; reuse=""
for v in ${AB_VARIANTS:--}; do
  i=$((i + 1)); k=(); [ "$v" = "-" ] || k=(--kernels "$v")
  steps="hylora:$W:$M"; [ -n "$reuse" ] || steps="ckpt:$W $steps"
  echo "== $i: ${v}" >> "$OUT/ab.log"
  # shellcheck disable=SC2086  # the steps are words
  $P $steps $reuse --repeats "$R" --out "$A/$i" "${k[@]}" --budget 300 >> "$OUT/ab.log" 2>&1
  reuse=--reuse
done
# shellcheck disable=SC2086
[ -z "${AB_AFTER:-}" ] || $P $AB_AFTER --reuse --out "$A/after" --budget 300 >> "$OUT/ab.log" 2>&1
i=0
for v in ${AB_VARIANTS:--}; do
  i=$((i + 1)); echo "== $i: $v"; grep -E "^\| $W \| $M|^\| hylora" "$A/$i/throughput_peer.md"
done | tee "$OUT/ab.md"
tar czf "$OUT/ab.tgz" -C $A . ; echo "T $(( $(date +%s) - t0 ))"
