"""Benchmarks, run as modules from the checkout's root (`python -m bench.run`; the make
targets in bench.mk): the trainer against TRL and a plain loop (run, peer_trl, plain_loop,
common), on a GPU (bench_gpu, gpu_check), memory, checkpoints, and the operator at scale
(bench.operator). FLOPs and parameter counts are the trainer's own (sftjob_trainer)."""
