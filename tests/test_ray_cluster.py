"""The Ray controller on a 2-node cluster made on this machine (ray.cluster_utils.Cluster: a head and one more
node, one CPU each): the actor pool's two workers land on different nodes, and a short run completes.

    python -m pytest tests/test_ray_cluster.py -q
"""

import os
import re

import ray
from ray.cluster_utils import Cluster

from conftest import toy_config
from ray_trainer import RayConfig, RayTrainerConfig, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_pool_across_two_nodes(tiny_rl_setup, tmp_path, capsys):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled"}})
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        cfg = toy_config(**tiny_rl_setup, train_batch_size=8, ppo_mini_batch_size=4, rollout_n=4, max_response_length=6,
                         total_steps=2, eval_every=2, adv_estimator="grpo", out_dir=str(tmp_path))
        records = train(RayTrainerConfig(cfg, RayConfig(workers=2, strategy="STRICT_SPREAD")))
    finally:
        ray.shutdown()
        cluster.shutdown()
    placed = re.findall(r"\[ray\] actor rank (\d): node (\w+)", capsys.readouterr().out)
    assert sorted(rank for rank, _ in placed) == ["0", "1"]
    assert len({node for _, node in placed}) == 2, placed  # one worker on each node
    assert [r["step"] for r in records] == [0, 1, 2] and "val/accuracy" in records[-1]
    assert os.path.exists(os.path.join(tmp_path, "final", "model.safetensors"))
