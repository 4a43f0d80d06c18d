"""The pieces of ppo.py's step that decide what a step sees: its prompts and its sampling seeds.

    python -m pytest tests/test_step.py -q
"""

from config import Config
from ppo import prompt_indices, sample_seed


def test_sample_seeds_are_distinct_for_distinct_steps_and_rows():
    seeds = {(seed, step, row): sample_seed(seed, step, row) for seed in range(3) for step in range(1, 60)
             for row in range(200)}
    assert len(set(seeds.values())) == len(seeds)  # 35,400 triples, no collision
    # the old affine mix gave seed 1, step s, row r the seed of seed 0, step s + 10, row r - 27
    assert sample_seed(1, 5, 40) != sample_seed(0, 15, 13)
    assert sample_seed(0, 7, 3) == sample_seed(0, 7, 3) and 0 <= sample_seed(5, 1, 1) < 2**48


def test_prompt_indices_cover_each_epoch_then_reshuffle():
    cfg = Config(train_batch_size=4, ppo_mini_batch_size=4, seed=3)
    steps = [prompt_indices(step, cfg, n_rows=10) for step in range(1, 6)]  # 2 steps an epoch; 2 rows left over
    assert all(len(s) == 4 and len(set(s)) == 4 for s in steps)
    assert not set(steps[0]) & set(steps[1])  # an epoch's steps never repeat a row
    assert not set(steps[2]) & set(steps[3])
    assert steps[2] + steps[3] != steps[0] + steps[1]  # epoch 2 is a fresh permutation
    assert prompt_indices(3, cfg, 10) == steps[2]  # a step alone decides its rows (a resumed run replays them)
    assert steps[4] != steps[0] and all(0 <= i < 10 for s in steps for i in s)
