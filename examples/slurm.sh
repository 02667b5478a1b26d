#!/bin/bash
# Multi-node launch of examples/train.py under SLURM: one torchrun per node, each
# starting one worker per GPU; torchrun's c10d rendezvous on the first node joins them.
#
#     sbatch examples/slurm.sh --config examples/llama_small.toml --steps 1000 \
#         --ckpt-dir /shared/ckpt --ckpt-every 100 --resume
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

# Elastic restarts: when a worker dies, torchrun restarts every worker of the job (up to
# MAX_RESTARTS times) and --resume continues from the newest checkpoint in --ckpt-dir. torch's
# c10d rendezvous keeps one store for all restarts, so a restarted worker can read a dead one's
# address: "Gloo connectFullMesh failed ... Connection refused" (NCCL: "socketPollConnect ...
# Connection refused", pytorch/pytorch#167288), or a hang. examples/train.py gives every attempt
# its own keys (another script: the same, or torch's TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, not
# tried here; see docs/troubleshooting.md). Allow several restarts all the same, and bound the waits so that a
# failed attempt ends and the next one runs: RDZV_TIMEOUT for the rendezvous and the process
# group (--dist-timeout), instead of torch's defaults of 10 and 30 minutes.
# To lose a node without stopping the others, see docs/fault-tolerance.md (torchft).
MAX_RESTARTS=${MAX_RESTARTS:-3}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-300}

srun --kill-on-bad-exit=1 torchrun \
    --nnodes="$SLURM_NNODES" \
    --nproc-per-node="$GPUS_PER_NODE" \
    --max-restarts="$MAX_RESTARTS" \
    --rdzv-id="$SLURM_JOB_ID" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$HEAD_NODE:$PORT" \
    --rdzv-conf="join_timeout=$RDZV_TIMEOUT" \
    examples/train.py --dist-timeout="$RDZV_TIMEOUT" "$@"
