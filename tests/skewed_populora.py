"""populora.py with rank 1's share of round 1's rows made empty on purpose, run under torchrun by
test_populora.py as `torchrun ... skewed_populora.py populora.py-flags...`.

With more ranks than rows (16 ranks, --proposals 8, a round with no valid problem), some ranks hold
no row of an update. On 2 ranks the teacher's proposals (at least 2) always give each rank one, so
here rank 1 drops its rows of round 1 before train() sees them. With --single_agent_update joint, a
rank that decided on its own rows alone would then skip the round's update while rank 0 waits in
its all-reduces.
"""
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import launch  # noqa: E402
import populora  # noqa: E402

TRAIN = populora.train


def train_without_rank_1s_rows(cfg, run, policy, rows, lr, joint=False):
    if not joint and run.state["round"] == 1 and dist.get_rank() == 1:
        rows = []
    return TRAIN(cfg, run, policy, rows, lr, joint)


if __name__ == "__main__":   # (data.grade's workers import this file again)
    populora.train = train_without_rank_1s_rows
    launch.main("populora.py", lambda: populora.main(populora.parse_args()))
