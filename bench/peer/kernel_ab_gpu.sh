#!/bin/bash
# hylora's FP8 workload with a kernel switch off and on, in one device call (BASELINE run 35), from the
# repo root with .vllm and .peerwhl carried (bench/peer/build_bundle.sh; the install is the peer's):
#   bash bench/peer/kernel_ab_gpu.sh
# The 16-layer cut, 8192 batched tokens, throughput_peer.py's workload (median of 5): FP8 with the
# defaults, with both FP8 fusions on (AB_KERNELS), with the fused norms only, then bf16; one table row
# each into $OUT/ab.md, every record in $OUT/ab.tgz; then the FP8 GPU tests in what is left of ~590 s.
t0=$(date +%s); . bench/peer/install.sh >/dev/null; P="python3 bench/peer/throughput_peer.py run"; A=/tmp/ab
$P ckpt:bf16,fp8 hylora:fp8:8192 --out $A/off --budget 240 > $OUT/ab.log 2>&1
K=${AB_KERNELS:-fp8_fused_norm_quant=1,fused_lora_expand_quantized=1}
$P hylora:fp8:8192 --reuse --out $A/on --kernels "$K" --budget 200 >> $OUT/ab.log 2>&1
$P hylora:fp8:8192 --reuse --out $A/norm --kernels fp8_fused_norm_quant=1 --budget 200 >> $OUT/ab.log 2>&1
$P hylora:bf16:8192 --reuse --out $A/bf16 --budget 200 >> $OUT/ab.log 2>&1
for d in off on norm bf16; do echo "== $d"; grep -E "^\| (bf16|fp8) \| 8192|^\| hylora" $A/$d/throughput_peer.md; done | tee $OUT/ab.md
tar czf $OUT/ab.tgz -C $A . ; el=$(( $(date +%s)-t0 )); echo "T $el"
timeout $(( 590-el )) python3 -m pytest -q -rfE -p no:cacheprovider --timeout=150 tests/test_silu_mul_lora.py tests/test_fp8_linear.py \
  -k "silu_mul_lora or cuda_ or start_up or weight_only_linear_equals_reference or weight_only_ignores" > $OUT/tests.log 2>&1
echo "tests rc $?"; tail -4 $OUT/tests.log
