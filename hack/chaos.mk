# Fault injection and operator scale (included by the top Makefile: -include hack/chaos.mk).
#   make chaos                         # 12 seeded faults of 9 kinds against one real job, then an
#                                      # elastic job through a node lost for minutes (node-lost-long)
#   make chaos CHAOS_ARGS="--elastic only"   # the elastic part alone (about 15 minutes)
#   make chaos CHAOS_SEED=7 CHAOS_ARGS="--faults 4 --kinds pod-delete,trainer-sigkill,operator-kill --min-kinds 3"
#   make bench-operator BENCH_JOBS=50  # a quick run of the scale benchmark
#   make restart-gap GAP_MODEL=large   # preempt a 0.37B full fine-tune and break its restart gap down
CHAOS_SEED ?= 1
CHAOS_FAULTS ?= 12
CHAOS_ARGS ?=
BENCH_JOBS ?= 1000
BENCH_OPERATOR_ARGS ?=
GAP_MODEL ?= tiny

.PHONY: chaos bench-operator restart-gap

chaos: install ## Seeded faults (pod kills, SIGKILL, operator kills and outage, MinIO outage, S3 throttling, node loss) on a real job; weights must match a clean run bit for bit; then an elastic job shrinks and grows back through a long node loss, bit for bit too
	OMP_NUM_THREADS=1 $(PY) -m hack.chaos --seed $(CHAOS_SEED) --faults $(CHAOS_FAULTS) $(CHAOS_ARGS)

bench-operator: install ## Operator at scale: BENCH_JOBS (1000) SFTJobs x 2 pods on 22 kwok nodes; latency, RSS, scrape load vs targets
	$(PY) -m bench.operator.run --jobs $(BENCH_JOBS) $(BENCH_OPERATOR_ARGS)

restart-gap: install ## Evict a pod of a training job (GAP_MODEL=tiny: the example; large: a 0.37B full fine-tune) and break the restart gap down, SIGTERM to the next first step
	OMP_NUM_THREADS=1 $(PY) -m hack.chaos.restart_gap --model $(GAP_MODEL)
