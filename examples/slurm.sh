#!/bin/bash
# Multi-node launch of examples/train.py under SLURM: one torchrun per node, each
# starting one worker per GPU; torchrun's c10d rendezvous on the first node joins them.
#
#     sbatch examples/slurm.sh --config examples/llama_small.toml --steps 1000
#
# Every node must see the repository and --ckpt-dir at the same path (a shared file
# system). Adjust the #SBATCH lines to your cluster (partition, account, time).
#SBATCH --job-name=fully_shard
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-8}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${PORT:-29500}

# NCCL picks the fastest network by itself; set NCCL_SOCKET_IFNAME / NCCL_IB_HCA here
# if your cluster needs it. OMP threads: the node's CPUs shared out among its workers.
export OMP_NUM_THREADS=$(( ${SLURM_CPUS_PER_TASK:-$GPUS_PER_NODE} / GPUS_PER_NODE ))

srun --kill-on-bad-exit=1 torchrun \
    --nnodes="$SLURM_NNODES" \
    --nproc-per-node="$GPUS_PER_NODE" \
    --rdzv-id="$SLURM_JOB_ID" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$HEAD_NODE:$PORT" \
    examples/train.py "$@"
