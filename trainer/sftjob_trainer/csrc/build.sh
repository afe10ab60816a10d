#!/bin/sh
# Builds sftjob's CPU attention kernel (cpu_attention.c, next to this script) into the shared
# library OUT: the one place its compiler flags are written. The trainer image's build runs it
# (images/trainer/Dockerfile), and so does the trainer where no prebuilt library is found and
# a C compiler is (sftjob_trainer/cpu_attention.py). Exit 3: not an x86-64 machine, nothing built.
#   sh build.sh OUT.so        (CC picks the compiler; default cc)
set -eu
out="$1"
case "$(uname -m)" in
    x86_64 | amd64) ;;
    *) echo "cpu_attention.c is x86-64 code (AVX2, FMA); not built on $(uname -m)" >&2; exit 3 ;;
esac
# -mavx2 -mfma: the library is loaded only on CPUs with both (the trainer checks first).
# -fopenmp: threads from torch's own OpenMP runtime once torch has loaded it.
exec "${CC:-cc}" -std=gnu11 -O3 -mavx2 -mfma -fopenmp -fPIC -shared -Wall -Wextra \
    -o "$out" "$(dirname "$0")/cpu_attention.c" -lm
