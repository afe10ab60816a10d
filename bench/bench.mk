# Throughput bench targets; the top-level Makefile includes this file (-include bench/bench.mk).
# REPS, STEPS, CONTENDERS, PRECISIONS and BENCH_ARGS pass through, e.g.
#   make bench REPS=3
#   make bench CONTENDERS=ours,trl_packed PRECISIONS=fp32
REPS ?= 1
STEPS ?= 20
CONTENDERS ?= ours,trl_padded,trl_packed,plain_padfree
PRECISIONS ?= fp32,bf16
# make bench-sweep SWEEP_ARGS="--points bench,L2048 --tokens 20000"
SWEEP_ARGS ?=

# `make gpu-check` runs tests/gpu with pytest: GPU_CHECK_ARGS adds pytest's options (e.g. -k offload).
# GPU_CHECK_SKIP=1: exit 0 on a machine without CUDA (by default that is a loud failure).
GPU_CHECK_ARGS ?=
GPU_CHECK_SKIP ?=

.PHONY: bench bench-sweep bench-gpu gpu-check

bench: install ## Our trainer vs TRL and a plain loop on the CPU bench: tokens/s, MFU, peak RSS, loss (~15-20 min)
	$(PY) -m bench.run --reps $(REPS) --steps $(STEPS) --contenders $(CONTENDERS) --precisions $(PRECISIONS) $(BENCH_ARGS)

bench-sweep: install ## The bench across shapes (length 128-2048, batch, micro-batch, 1 or 2 ranks): ours vs TRL packed vs a plain loop, MFU (~25 min; SWEEP_ARGS)
	$(PY) -m bench.sweep $(SWEEP_ARGS)

bench-gpu: install ## Our trainer on one GPU, 0.5B Qwen2-shaped model, bf16: tokens/s and MFU (fails without CUDA)
	$(PY) -m bench.bench_gpu $(BENCH_ARGS)

gpu-check: install ## On a CUDA machine (<8 min): tests/gpu (bf16 train+resume, flash-attn vs sdpa, offload, liger, bench-gpu, image import); exit 2 without CUDA
	GPU_CHECK_SKIP=$(GPU_CHECK_SKIP) $(PY) -m pytest tests/gpu -m gpu -rA -p no:cacheprovider $(GPU_CHECK_ARGS)
