"""python -m lab.train: grpo.py's training run with the lab's plug-ins, the same flags besides.

    python -m lab.train --reward igpo                    # the paper's other rewards
    python -m lab.train --reward tree_grpo               # the tree searches (at2po too)
    python -m lab.train --env shop-long --reward labels --advantage outcome-turn
    torchrun --nproc_per_node 2 -m lab.train ...

`plug_in` registers each lab module with the core (pair.REWARDS, pair.ADVANTAGES, grpo.PLAYERS,
LOSSES and HOOKS, envs.WORLDS and REPLAYS): the paper's other rewards and the tree searches
(lab/baselines.py), the exact-label reward, the advantage forms, the premise gate and --oversample
(lab/credit.py), probes fitted on the fly and refitted during a run (lab/onpolicy.py), the run lock
(lab/runs.py), the long world (lab/shop.py), layers split across devices (lab/split.py), ToolBench's
replay and its LLM judge (lab/toolbench.py), the probes of a `lab.study train` directory
(lab/study.py), and several processes under torchrun (lab/torchrun.py).
"""
import grpo
from lab import baselines, credit, onpolicy, runs, shop, split, study, toolbench, torchrun


def plug_in() -> None:
    """The lab into grpo.py, once (calling it again changes nothing)."""
    for module in (baselines, credit, onpolicy, runs, shop, split, study, toolbench, torchrun):
        module.register()
    grpo.PROG = "python -m lab.train"


if __name__ == "__main__":
    plug_in()
    grpo.main()
