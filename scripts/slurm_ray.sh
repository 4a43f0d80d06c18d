#!/usr/bin/env bash
# A Ray cluster on the nodes of a Slurm job, then ray_trainer.py on it, one worker a GPU; arguments go to ray_trainer.py.
#
#   cd nanoverl && sbatch --nodes=4 scripts/slurm_ray.sh --model-path /path/to/model \
#       --train-files ... --val-files ... --fsdp.param-dtype bfloat16     # 4 nodes x 8 GPUs: --ray.workers 32
#   NODES=2 bash scripts/slurm_ray.sh --total-steps 2   # no Slurm: NODES Ray nodes on this machine, one CPU each
#
# Submit from the repository root; the code, its Python environment and the data must sit at the same paths on every
# node. Environment variables set before sbatch (NCCL_*, RAY_DEBUG_POST_MORTEM, ...) reach every node's workers.
# Each node runs `ray start --block` in the foreground of its own job step (locally: a background process); the
# script waits until every node has joined, runs the driver on the first node and at exit stops each node's
# `ray start` (SIGTERM: it stops that node's Ray), not `ray stop`, which stops every Ray on a machine, other runs' too.
# The driver prints the dashboard's URL (http://HEAD_IP:8265; from a laptop: ssh -L 8265:HEAD_IP:8265 LOGIN_NODE).
#SBATCH --job-name=nanoverl-ray
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"  # the repository root (sbatch runs a copy of this script elsewhere)

PORT=${PORT:-6379}                        # the head's GCS port
JOIN_TIMEOUT_S=${JOIN_TIMEOUT_S:-300}     # how long the nodes may take to join
if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then   # Slurm: one Ray node a Slurm node
  mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  GPUS=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
  RESOURCES=(--num-cpus "${SLURM_CPUS_PER_TASK:-$(nproc)}" --num-gpus "$GPUS")
  on_node() { local host=$1; shift; exec srun --nodes=1 --ntasks=1 -w "$host" "$@"; }
else                                          # local: NODES nodes here, named local0, local1, ...
  mapfile -t HOSTS < <(seq -f "local%g" 0 $((${NODES:-2} - 1)))
  GPUS=1                                      # one worker a node, on its CPU
  RESOURCES=(--num-cpus 1 --num-gpus 0)
  on_node() { shift; exec "$@"; }
fi
HEAD_IP=${HEAD_IP:-$(on_node "${HOSTS[0]}" hostname -I | awk '{print $1}')}  # set HEAD_IP to pick another interface

# on_node HOST CMD... runs CMD on HOST in place of the calling shell (exec), so call it in a subshell, & or $(...):
# then $! is the PID of CMD itself (or of its srun), which the exit trap signals.
PIDS=()
stop_ray() { if ((${#PIDS[@]})); then kill -TERM "${PIDS[@]}" 2>/dev/null || true; wait || true; fi; }
trap stop_ray EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

start_node() {  # start_node INDEX RAY_START_ARGS...: node INDEX's `ray start`, labelled with its host name
  local i=$1; shift
  # the dashboard agent's port differs per node: local nodes share one machine (the default 52365 would clash)
  on_node "${HOSTS[$i]}" ray start "$@" "${RESOURCES[@]}" --labels "nanoverl/node=${HOSTS[$i]}" \
    --dashboard-agent-listen-port $((52365 + i)) --disable-usage-stats --block &
  PIDS+=($!)
}

echo "[slurm_ray] head ${HOSTS[0]} at $HEAD_IP:$PORT; nodes: ${HOSTS[*]}"
start_node 0 --head --node-ip-address "$HEAD_IP" --port "$PORT" --include-dashboard true --dashboard-host 0.0.0.0
for ((t = 0; ; t++)); do  # until the head's GCS port answers: then the other nodes can join
  (exec 3<>"/dev/tcp/$HEAD_IP/$PORT") 2>/dev/null && break
  if ((t >= JOIN_TIMEOUT_S)) || ! kill -0 "${PIDS[0]}" 2>/dev/null; then
    echo "[slurm_ray] the Ray head on ${HOSTS[0]} did not start (nothing at $HEAD_IP:$PORT after $t s)" >&2
    exit 1
  fi
  sleep 1
done
for ((i = 1; i < ${#HOSTS[@]}; i++)); do
  start_node "$i" --address "$HEAD_IP:$PORT"
done
python - "$HEAD_IP:$PORT" "$JOIN_TIMEOUT_S" "${HOSTS[@]}" <<'PY'
import sys, time
import ray
address, timeout, want = sys.argv[1], float(sys.argv[2]), set(sys.argv[3:])
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
deadline = time.time() + timeout
while (missing := want - {n["Labels"].get("nanoverl/node") for n in ray.nodes() if n["Alive"]}) \
        and time.time() < deadline:
    time.sleep(1)
if missing:
    sys.exit(f"[slurm_ray] after {timeout:.0f} s these nodes have not joined: {' '.join(sorted(missing))}")
print(f"[slurm_ray] all {len(want)} nodes joined")
PY
python ray_trainer.py --ray.address "$HEAD_IP:$PORT" --ray.workers $((${#HOSTS[@]} * GPUS)) "$@"
