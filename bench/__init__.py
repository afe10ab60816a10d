"""Benchmarks, run as modules from the checkout's root (`python -m bench.run`; the make
targets in bench.mk): the trainer against TRL and a plain loop (run, peer_trl, plain_loop,
common), on a GPU (bench_gpu; the GPU correctness checks are tests under tests/gpu), memory,
checkpoints, and the operator at scale (bench.operator); outputs reads a run's output
directory. FLOPs and parameter counts are the trainer's own (sftjob_trainer)."""
