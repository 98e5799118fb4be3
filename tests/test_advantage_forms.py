"""The lab's advantage forms beside the core's `process` and `release` (METHOD.md §9), the
exact-label reward, the premise gate and the release preset: every number worked out by hand
here, not by the code under test."""
import argparse
import math

import pytest
import torch

import grpo
from lab.methods import credit
from lab.probing import detection
from lab import train as lab_train
import pair


def args_for(**kw):
    return argparse.Namespace(**{"reward": "labels", "advantage": "process", "outcome_weight": 0.0,
                                 "turn_weight": 1.0, **kw})


# ---------------------------------------------------------------------------------------------
# --advantage position

def test_position_advantages_hand_worked():
    # rollout 0: r = [1.0, 0.0]; rollout 1: r = [0.5, 1.0, 0.4]
    # position means: t0 (1.0 + 0.5) / 2 = 0.75, t1 (0.0 + 1.0) / 2 = 0.5, t2 0.4 (rollout 1 alone)
    # c = [[0.25, -0.5], [-0.25, 0.5, 0.0]]: the lone turn 2 is its own mean, centred to 0
    # pooled: mean 0, population variance (0.0625 + 0.25 + 0.0625 + 0.25 + 0) / 5 = 0.125
    adv, zero = credit.position_advantages([[1.0, 0.0], [0.5, 1.0, 0.4]])
    s = 1 / (math.sqrt(0.125) + 1e-6)
    assert not zero
    # suffix sums of c x s
    assert adv[0] == pytest.approx([(0.25 - 0.5) * s, -0.5 * s], abs=1e-9)
    assert adv[1] == pytest.approx([(-0.25 + 0.5 + 0.0) * s, 0.5 * s, 0.0], abs=1e-9)


def test_position_advantages_drop_what_every_rollout_shares():
    # the same reward at each position in every rollout: process still moves every turn (pooled
    # r = [1, 0, 1, 0]: r^ = +-1), the per-position baseline has nothing to say
    assert pair.group_advantages([[1.0, 0.0], [1.0, 0.0]])[1] is False
    assert credit.position_advantages([[1.0, 0.0], [1.0, 0.0]]) == ([[0.0, 0.0], [0.0, 0.0]], True)
    # turns without a reward stay out of the mean and get 0: an outcome on the same last turn
    # gives the outcome's group advantage, (1 - 0.5) / (0.5 + 1e-6) on every turn
    adv, zero = credit.position_advantages([[None, 1.0], [None, 0.0]])
    q = 0.5 / (0.5 + 1e-6)
    assert not zero and adv == [pytest.approx([q, q]), pytest.approx([-q, -q])]


# ---------------------------------------------------------------------------------------------
# --advantage outcome-turn

def test_outcome_turn_advantages_hand_worked():
    # scores [1, 0]: mean 0.5, population std 0.5, z = +-0.5 / (0.5 + 1e-6) = +-q
    # c as in the position test: [[0.25, -0.5], [-0.25, 0.5, 0.0]]; lambda 2: A = z + 2c
    q = 0.5 / (0.5 + 1e-6)
    adv, zero = credit.outcome_turn_advantages([[1.0, 0.0], [0.5, 1.0, 0.4]], [1.0, 0.0], 2.0)
    assert not zero
    assert adv[0] == pytest.approx([q + 0.5, q - 1.0], abs=1e-12)
    assert adv[1] == pytest.approx([-q - 0.5, -q + 1.0, -q], abs=1e-12)
    # a rollout that played no turn stays out of the outcome's statistics, as under process:
    # scores [1, 0] of the two that played; c = [[0.5], [], [-0.5]]
    adv, _ = credit.outcome_turn_advantages([[1.0], [], [0.0]], [1.0, 0.0, 0.0], 1.0)
    assert adv == [pytest.approx([q + 0.5]), [], pytest.approx([-q - 0.5])]
    # equal outcomes: only the turns' own centred rewards; all equal: nothing
    adv, zero = credit.outcome_turn_advantages([[1.0, 0.0], [0.0, 0.0]], [1.0, 1.0], 1.0)
    assert not zero and adv == [pytest.approx([0.5, 0.0]), pytest.approx([-0.5, 0.0])]
    assert credit.outcome_turn_advantages([[0.3], [0.3]], [1.0, 1.0], 1.0) == ([[0.0], [0.0]], True)


def test_outcome_turn_gives_the_outcome_term_process_gives_the_outcome():
    rewards = [[0.2, 0.9, 0.4], [0.7], [0.1, 0.1]]
    scores = [1.0, 0.0, 1.0]
    outcome, _ = pair.group_advantages([[None] * (len(r) - 1) + [s]
                                        for r, s in zip(rewards, scores)])
    adv, _ = credit.outcome_turn_advantages(rewards, scores, 0.0)
    assert adv == outcome


def test_advantages_dispatch_reads_the_scores_only_where_the_form_needs_them():
    rewards, scores = [[1.0, 0.0], [0.5, 1.0, 0.4]], [1.0, 0.0]
    for form in ("process", "release", "position"):
        form_of = {"process": pair.group_advantages, "release": pair.release_advantages,
                   "position": credit.position_advantages}[form]
        forms = lab_train.forms(args_for(advantage=form))
        assert forms[form].advantages(rewards, scores) == form_of(rewards)
    forms = lab_train.forms(args_for(advantage="outcome-turn", turn_weight=2.0))
    assert forms["outcome-turn"].advantages(rewards, scores) == \
        credit.outcome_turn_advantages(rewards, scores, 2.0)
    assert set(forms) == {"process", "release", "position", "outcome-turn"}
    # the core's table is the core's own: the lab's rows are in the lab's table alone
    assert set(pair.ADVANTAGES) == {"process", "release"}
    # each form's log pi temperature: the sampling one, but the release's T = 1
    assert [forms[f].temperature for f in ("process", "release", "position", "outcome-turn")] \
        == [None, 1.0, None, None]


# ---------------------------------------------------------------------------------------------
# --reward labels

def test_labels_reward_is_the_exact_labels():
    traj = argparse.Namespace(steps=[None] * 3, score=1.0,
                              episode=argparse.Namespace(labels=lambda: [True, False, True]))
    labels = lab_train.REWARDS["labels"]
    assert pair.turn_rewards(traj, labels, None) == ([1.0, 0.0, 1.0], None)
    # --outcome-weight adds to the last turn, as for any reward
    assert pair.turn_rewards(traj, labels, None, outcome_weight=0.5) == ([1.0, 0.0, 1.5], None)


@pytest.mark.parametrize("argv, error", [
    (["--env", "gta", "--reward", "labels"], "--reward labels: gta has no exact step labels"),
    (["--reward", "outcome", "--advantage", "outcome-turn"], "--reward outcome has none"),
    (["--reward", "labels", "--advantage", "outcome-turn", "--outcome-weight", "1"],
     "--outcome-weight: --advantage outcome-turn adds"),
])
def test_labels_and_forms_are_refused_where_they_cannot_work(argv, error, tmp_path):
    with pytest.raises(SystemExit) as e:
        lab_train.parse_args([*argv, "--out", str(tmp_path / "r")])
    assert error in str(e.value.code)


@pytest.mark.parametrize("reward", ["tree_grpo", "at2po"])
@pytest.mark.parametrize("argv", [["--advantage", "position"], ["--advantage", "outcome-turn"],
                                  ["--preset", "release"]])
def test_tree_search_refuses_the_forms_it_cannot_use(reward, argv, tmp_path):
    args = lab_train.parse_args(["--reward", reward, *argv, "--out", str(tmp_path / "r")])
    with pytest.raises(SystemExit) as e:
        given = grpo.resolve_preset(args, pair.Processes(rank=1), lab_train.WORLDS)
        lab_train.baselines.preset(args, given)
    assert f"{' '.join(argv)}: --reward {reward} derives its advantages" in str(e.value.code)


# ---------------------------------------------------------------------------------------------
# the premise gate

def gate_turns(labels: list[list[int]], score: list[float], episode: str = "e") -> detection.Split:
    """Stored held-out turns of one group: per rollout its labels; distance as onpolicy writes
    it (turns since the nearest earlier wrong one, -1 for a clean prefix)."""
    y, t_idx, dist, roll, sc = [], [], [], [], []
    for k, (row, s) in enumerate(zip(labels, score)):
        last = None
        for t, ok in enumerate(row):
            y.append(ok), t_idx.append(t), roll.append(k), sc.append(s)
            dist.append(-1 if last is None else t - last)
            if not ok:
                last = t
    raw = {"label": torch.tensor(y), "turn_idx": torch.tensor(t_idx),
           "distance": torch.tensor(dist), "rollout": torch.tensor(roll),
           "score": torch.tensor(sc, dtype=torch.float64)}
    return detection.Split("gate", raw, raw["label"].long(), [episode] * len(y), {})


def gate_of(turns, args, form, at):
    """The premise gate as a run computes it at its start (credit.gate_at_setup)."""
    return credit.premise_gate(turns, credit.gate_scores(turns, None, args, form), at, args)


def test_premise_gate_catches_an_advantage_that_inverts_the_reward():
    # The habit's decision is at turn 1. Rollout 0 makes it right and then goes wrong on the
    # harder turns that follow; rollout 1 slips there and gets the easy turns after it right.
    # The exact labels rank the right turn first (reward AUROC 1). Under process, pooled
    # labels [1,1,0,0, 1,0,1,1]: mean 5/8, std sqrt(15)/8 = d; A(right) = (3/8 - 2 x 5/8) / d
    # = -(7/8) / d, A(slip) = (-5/8 + 2 x 3/8) / d = (1/8) / d: the slip is credited, AUROC 0.
    # Per position (means 1, 1/2, 1/2, 1/2) the later turns still decide: A(right) ~ 0.5 - 0.5
    # - 0.5 < 0 < A(slip), AUROC 0. outcome-turn (equal outcomes) keeps the turn's own reward:
    # A(right) = +1/2 > A(slip) = -1/2, AUROC 1.
    turns = gate_turns([[1, 1, 0, 0], [1, 0, 1, 1]], [0.0, 0.0])
    at = [None, "forget", None, None] * 2
    lines = []
    got = {}
    for form in ("process", "position", "outcome-turn"):
        args = args_for(advantage=form)
        got[form] = gate = gate_of(turns, args, lab_train.forms(args)[form], at)
        credit.log_gate(gate, lambda text, **k: lines.append(text))
        assert (gate["turns"], gate["slips"], gate["groups"]) == (2, 1, 1)
        assert gate["reward_auroc"] == 1.0
    assert got["process"]["auroc"] == 0.0 and got["position"]["auroc"] == 0.0
    assert got["outcome-turn"]["auroc"] == 1.0
    assert got["process"]["by_habit"] == {"forget": 0.0}
    warnings = [line for line in lines
                if line.startswith("warning: the advantage credits the slip")]
    assert len(warnings) == 2 and "process" in warnings[0] and "position" in warnings[1]
    assert all("the turns that follow a decision, not the decision" in w for w in warnings)
    # every clean-prefix turn, in units of 1/d: right turns r0t0 = (3+3-5-5)/8 = -0.5, r0t1 =
    # -0.875, r1t0 = (3-5+3+3)/8 = 0.5; wrong turns r0t2 = -1.25, r1t1 = 0.125: 4 of 6 pairs
    assert got["process"]["clean_prefix"] == pytest.approx(4 / 6)


def test_the_gates_warning_names_the_cause_its_form_has():
    # each form takes a turn's credit from elsewhere: the warning says from where
    lines = []
    for form in ("process", "position", "release", "outcome-turn"):
        credit.log_gate({"advantage": form, "reward": "pair", "turns": 9, "slips": 3,
                         "groups": 2, "auroc": 0.4, "auroc_interval": [0.3, 0.5],
                         "reward_auroc": 0.5, "by_habit": {}, "clean_prefix": 0.5},
                        lambda text, **k: lines.append(text))
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 4
    assert "the turns that follow" in warnings[0] and "the turns that follow" in warnings[1]
    assert "its rollout's normalized total" in warnings[2]
    assert "centred within its group" in warnings[3]
    assert not any("the turns that follow" in w for w in warnings[2:])


def test_premise_gate_reads_the_outcome_on_the_last_turn():
    # --reward outcome: the advantage is the group-normalized outcome on every turn, so the
    # rollout that slipped and failed ranks below the one that made the decision right
    turns = gate_turns([[1, 1, 1], [1, 0, 0]], [1.0, 0.0])
    args = args_for(reward="outcome")
    gate = gate_of(turns, args, pair.ADVANTAGES["process"], [None, "store", None] * 2)
    assert gate["auroc"] == 1.0 and gate["reward_auroc"] is None    # no reward at turn 1


# ---------------------------------------------------------------------------------------------
# --preset release

def test_release_preset_sets_the_release_and_flags_given_win(tmp_path):
    def resolved(*argv):
        args = lab_train.parse_args([*argv, "--out", str(tmp_path / "r")])
        grpo.resolve_preset(args, pair.Processes(rank=1), lab_train.WORLDS)
        return args
    a = resolved("--preset", "release")
    assert (a.weight_decay, a.warmup, a.top_p, a.advantage) == (0.01, 0.0, 0.95, "release")
    a = resolved("--preset", "release", "--top-p", "1.0", "--advantage", "position")
    assert (a.weight_decay, a.top_p, a.advantage) == (0.01, 1.0, "position")
    a = resolved()                      # no preset: the defaults as before
    assert (a.weight_decay, a.warmup, a.top_p, a.advantage) == (0.0, 0.05, 1.0, "process")
    assert "turn_weight" in lab_train.RESUME_KEYS and "turn_weight" in lab_train.RANGES
    # the core's own lists are not the lab's
    assert "turn_weight" not in grpo.RESUME_KEYS and "turn_weight" not in grpo.FLAG_RANGES


def test_compare_rows_take_labels_and_the_forms():
    from lab import compare
    assert compare.parse_spec("labels") == ("labels", [])
    assert compare.parse_spec("labels:advantage=position") == \
        ("labels", ["--advantage", "position"])
    assert compare.parse_spec("pair:advantage=outcome-turn,turn-weight=0.5") == \
        ("pair", ["--advantage", "outcome-turn", "--turn-weight", "0.5"])


# ---------------------------------------------------------------------------------------------
# --reward confidence: the trivial internal signal

def test_confidence_reward_is_each_turns_own_mean_log_probability():
    # Step.nll = -(mean log pi of the turn's tokens as sampled); a turn without one: no reward
    steps = [argparse.Namespace(nll=0.5), argparse.Namespace(nll=2.0),
             argparse.Namespace(nll=None)]
    traj = argparse.Namespace(steps=steps, score=0.0)
    confidence = lab_train.REWARDS["confidence"]
    assert pair.turn_rewards(traj, confidence, None) == ([-0.5, -2.0, None], None)


def test_premise_gate_reads_the_confidence_of_the_stored_turns():
    # the slip (rollout 0, turn 1) is the unsure turn: mean nll 3.0 against 0.3 for the same
    # decision made right, so the reward and, under process, its advantage rank it below
    turns = gate_turns([[1, 0], [1, 1]], [0.0, 1.0])
    turns.raw["nll"] = torch.tensor([0.1, 3.0, 0.2, 0.3])
    gate = gate_of(turns, args_for(reward="confidence"), pair.ADVANTAGES["process"],
                   [None, "store"] * 2)
    assert (gate["turns"], gate["slips"]) == (2, 1)
    assert gate["reward_auroc"] == 1.0 and gate["auroc"] == 1.0


def test_the_gate_carries_a_bootstrap_interval_over_its_turns():
    # the hand-worked gate above: two first-error turns, process ranks the slip first (0) and
    # outcome-turn last (1); every resample with both turns says the same
    turns = gate_turns([[1, 1, 0, 0], [1, 0, 1, 1]], [0.0, 0.0])
    at = [None, "forget", None, None] * 2
    for form, expected in (("process", [0.0, 0.0]), ("outcome-turn", [1.0, 1.0])):
        args = args_for(advantage=form)
        gate = gate_of(turns, args, lab_train.forms(args)[form], at)
        assert gate["auroc_interval"] == expected
    # on noisy scores: an interval around the AUROC, the same every time (seeded), and none
    # where the turns hold one class
    g = torch.Generator().manual_seed(1)
    y = torch.tensor([0, 1] * 40)
    score = y + 1.5 * torch.randn(80, generator=g, dtype=torch.float64)
    lo, hi = credit.bootstrap_auroc(y, score)
    point = credit.probes.auroc(y, score)
    assert 0 <= lo < point < hi <= 1 and hi - lo > 0.05
    assert credit.bootstrap_auroc(y, score) == [lo, hi]
    assert credit.bootstrap_auroc(torch.ones(5), torch.rand(5)) is None
