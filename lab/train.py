"""python -m lab.train: grpo.py's training run with the lab's plug-ins, the same flags besides.

    python -m lab.train --reward igpo                    # the paper's other rewards
    python -m lab.train --reward tree_grpo               # the tree searches (at2po too)
    python -m lab.train --env shop-long --reward labels --advantage outcome-turn
    torchrun --nproc_per_node 2 -m lab.train ...

Importing this module plugs the lab into grpo.py (each module's `register`: grpo's REWARDS,
ADVANTAGES, PLAYERS, LOSSES and HOOKS): the paper's other rewards and the tree searches (lab/baselines.py), the exact-label
reward, the advantage forms and the premise gate (lab/credit.py), probes fitted on the fly and
refitted during a run (lab/onpolicy.py), and the long world (lab/shop.py).
"""
import grpo
from lab import baselines, credit, onpolicy, shop  # noqa: F401 (shop: the long world)

for module in (baselines, credit, onpolicy):
    module.register()
grpo.PROG = "python -m lab.train"

if __name__ == "__main__":
    grpo.main()
