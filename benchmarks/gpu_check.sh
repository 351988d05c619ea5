#!/usr/bin/env bash
# The GPU checks of issues 3, 10 and 11 in one prepared run (10-15 minutes on one GPU), for a session that
# is lent a device: the Triton kernels compiled for real and compared with their PyTorch twins,
# the score-and-rank kernel against the PyTorch path, the row-wise optimizer step against its
# twin, and GRU4Rec training mini-batches/s at B=32..256 with PyTorch ops and with every kernel.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # from the repo root; OUT_DIR default: $OUT or outputs/gpu_check
#   STEPS="1 3" bash benchmarks/gpu_check.sh      # only some of the numbered steps (to fit one call's limit)
#
# The device image has torch, triton and lightning but not hydra-core/omegaconf: put their wheels
# in wheels/ (pip download hydra-core==1.3.8 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3
# --no-deps -d wheels), carry wheels/ with the call, and they are installed offline here first.
set -uo pipefail
out=${1:-${OUT:-outputs/gpu_check}}
mkdir -p "$out"
py=${PYTHON:-python3}
steps=" ${STEPS:-1 2 3 4 5 6 7} "
run_step() { [[ $steps == *" $1 "* ]]; }
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=offline
if compgen -G "wheels/*" > /dev/null; then
  # antlr4-python3-runtime 4.9.3 is an sdist only: built here without fetching build tools
  "$py" -m pip install -q --no-index --no-deps --no-build-isolation wheels/* 2>&1 | tail -1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"

# 1. kernels on the GPU against their twins (forward and backward)
run_step 1 && timeout 240 "$py" -m pytest -q -m triton tests/shared/test_target_rank_triton.py tests/gru4rec/test_sampled_loss_kernel.py \
  tests/gru4rec/test_rowwise_adagrad_triton.py \
  2>&1 | tail -15 | tee "$out/triton_tests.txt"
# 2. score-and-rank: 37k items (the spec's synthetic catalogue) and 1M items in bf16
run_step 2 && timeout 120 "$py" benchmarks/target_rank_bench.py 2>&1 | tee "$out/target_rank.txt"
run_step 2 && timeout 120 "$py" benchmarks/target_rank_bench.py -B 1024 -N 1000000 -d 64 --dtype bfloat16 \
  2>&1 | tee -a "$out/target_rank.txt"
# 3. one row-wise optimizer step (B=32 and 256, 2048 samples, 37k items)
run_step 3 && for b in 32 256; do
  timeout 60 "$py" benchmarks/rowwise_adagrad_bench.py --batch $b 2>&1 | tee -a "$out/rowwise_adagrad.txt"
done
# 4. GRU4Rec training mini-batches/s on synthetic sessions (20,000 items), rsc15 xe and bpr-max presets,
# B=32..256: PyTorch ops vs every Triton kernel (loss, optimizer, ranking)
run_step 4 && for kernel in pytorch triton; do
  for preset in xe bprmax; do for b in 32 64 128 256; do
    timeout 90 "$py" benchmarks/train_throughput.py --experiment gru4rec_rsc15_$preset --device cuda --threads 4 \
      --override data=synthetic --override data.generator.n_items=20000 --override data.generator.n_sessions=100000 \
      --batch-size $b --windows 3 --steps 150 --warmup 30 --eval-batches 20 \
      --override loss.kernel=$kernel --override evaluation.kernel=$kernel --override optimizer.kernel=$kernel \
      2>&1 | grep -v '^{' | tee -a "$out/throughput_$kernel.txt"
  done; done
done
# 5. HSTU (issue 10): its two kernels against their twins on the GPU, the attention table (Triton vs
# padded PyTorch vs SDPA, forward+backward time and peak memory, L = 256..8192), and training
# sequences/s of the ml-20m HSTU config on synthetic histories of the same shape, per kernel
run_step 5 && timeout 240 "$py" -m pytest -q tests/sequences/hstu/test_hstu_attention_triton.py tests/sequences/hstu/test_hstu_output.py \
  tests/sequences/hstu/test_hstu_oracle.py 2>&1 | tail -8 | tee "$out/hstu_tests.txt"
run_step 5 && timeout 300 "$py" benchmarks/hstu_attention_bench.py 2>&1 | tee "$out/hstu_attention.txt"
run_step 5 && for kernel in pytorch triton; do
  timeout 240 "$py" benchmarks/train_throughput.py --experiment hstu_ml-20m --level bare --threads 4 --no-eval \
    --override data=synthetic_histories --override data.generator.n_users=20000 \
    --override data.generator.n_items=26744 --device cuda \
    --override model.attention.kernel=$kernel --override model.output.kernel=$kernel \
    2>&1 | grep -v '^{' | tee "$out/hstu_ml20m_$kernel.txt"
done
# 6. DLRM (issue 11): the dot-interaction kernel and the reference oracle on the GPU, the kernel
# table (Triton vs PyTorch vs torch.compile, B = 2048..65536, d = 16/64/128), and training
# samples/s of the Kaggle configuration at batch 2048 per interaction kernel
run_step 6 && timeout 240 "$py" -m pytest -q tests/dlrm/test_dot_interaction.py tests/dlrm/test_dlrm_oracle.py \
  2>&1 | tail -8 | tee "$out/dlrm_tests.txt"
run_step 6 && timeout 300 "$py" benchmarks/dot_interaction_bench.py 2>&1 | tee "$out/dot_interaction.txt"
run_step 6 && for kernel in pytorch triton; do
  timeout 200 "$py" benchmarks/train_throughput.py --experiment dlrm_criteo_kaggle --level bare --no-eval \
    --device cuda --threads 4 --batch-size 2048 --override model.dot_interaction.kernel=$kernel \
    2>&1 | grep -v '^{' | tee "$out/dlrm_throughput_$kernel.txt"
done
# 7. DLRM with its tables split (issue 19) on the one GPU: hardware=model_parallel over NCCL with a
# mesh of one process (what a node of GPUs runs, at world 1): train, save a distributed checkpoint,
# test it; then the same run on the CPU path, for the metrics to compare
run_step 7 && for hw in "hardware=model_parallel trainer.devices=1 trainer.strategy.tensor_parallel_size=1" \
    "hardware=model_parallel_cpu trainer.devices=1 trainer.strategy.tensor_parallel_size=1"; do
  timeout 240 "$py" src/train.py model=dlrm $hw model.lazy_tables=true optimizer=rowwise_adagrad \
    data.generator.n_rows=200000 data.batch_size=2048 trainer.max_epochs=1 paths.log_dir="$out/sharded" \
    2>&1 | grep -E "test/|Error|error" | tee -a "$out/dlrm_sharded.txt"
done
