"""shop-stale: the built-in world whose slips are a stale value carried into an action after a
thought that states the current one.

    python -m lab.shop sft --world shop-stale --slips 0.55 --init data/shop-long-policy ...
    python -m lab.premise --env shop-stale --out results/shop-stale/regime.json

A task buys four numbered lines at one store and asks for the total in another currency, as
shop-long's do (lab/worlds/shop.py). The solution goes line by line, and every value it carries forward
changes as it goes: the price of the line being costed, the line's cost, the running total, the
total before and after conversion. Each line is a Lookup, a Calculator call for the line's cost
(q*p) and, from the second line on, one adding it to the running total; then the rate, the
conversion and the answer: 14 assistant turns. At each of eight decisions the turn's thought
restates the current value, always right, and its action then carries either that value (copied
from the thought, inside the turn) or the stale one it replaced (copied from an older message of
the prefix), STALE_DECISIONS:
    price k      (k = 2..4) line k's cost computed with the price of line k - 1;
    subtotal k   (k = 2..4) the running total adding the cost of line k - 1 again;
    convert      the running total before the last line converted;
    answer       the dollar total given as the answer.
Each alone fails the episode: every later turn goes on with what it got, so the answer is wrong
and the dialog fluent, and the world labels the turn that carried the stale value wrong (its
Calculator value is none the task needs, or the answer is not the total), its thought right.

Why: a per-turn reward from the policy's internals can beat the turn's confidence only where the
slip is made as confidently as the right turn and leaves a trace in the turn's state. The policy
is trained on dialogs where each decision carries the stale value with one probability near a
half (sft --slips), drawn on its own, so at the token where the two values part the policy gives
them about the same probability: the sampled token's probability, and the turn's mean
log-probability, cannot tell them apart. What differs is where the rest of the value is copied
from: the right one from the turn's own thought (attention on the turn's keys, `self`), the stale
one from an older message (attention on the prefix): the statistics PAIR's features read, the
same decision of the same episode sampled both ways. Which value goes stale, and what it is,
differs with every episode and every line.
"""
from __future__ import annotations

import functools
import random
import re
from decimal import Decimal
from functools import cached_property
from itertools import accumulate

import envs
from lab.worlds.shopdata import dialog_steps, play_turn

STALE_LINES = 4
STALE_DECISIONS = ("price", "subtotal", "convert", "answer")      # kinds, in turn order by line
# the decisions of every task, in turn order
DECISIONS = tuple(f"{kind} {k}" for k in range(2, STALE_LINES + 1)
                  for kind in ("price", "subtotal")) + ("convert", "answer")
STALE_MAX_TURNS = 18    # 14 turns solve a task; a few more before an episode is cut off


class StaleTask(envs.ShopTask):
    """A shop-stale task: the shop task's fields, its useful Calculator values each line's cost,
    the running totals and the converted total; a line's number "(1)" in a thought a name."""

    @cached_property
    def quantities(self) -> list[Decimal]:
        costs = [q * self.prices[s, i] for q, i, s in self.lines]          # q * p a line, USD
        return sorted(set(costs) | set(accumulate(costs)) | {self.total})

    def values_in(self, text: str) -> list[str]:
        return super().values_in(re.sub(r"\(\d+\)", " ", text))


def stale_task(seed: int) -> StaleTask:
    """The shop-stale episode of one seed (one random.Random(seed), fixed draw order), drawn
    again from the same stream until every stale value makes its turn wrong (_stale_distinct)."""
    rng = random.Random(seed)
    prices, rates = envs.draw_world(rng)
    while True:
        store = rng.choice(envs.SHOP_STORES)
        lines = tuple((rng.randint(1, envs.SHOP_MAX_QUANTITY), i, store)
                      for i in rng.sample(envs.SHOP_ITEMS, STALE_LINES))
        currency = rng.choice(tuple(envs.SHOP_RATE_CENTS))
        parts = [f"({k + 1}) {q} {i}" for k, (q, i, _) in enumerate(lines)]
        text = rng.choice(envs.SHOP_TEMPLATES).format(
            lines=", ".join(parts[:-1]) + " and " + parts[-1] + f" at store {store}", cur=currency)
        task = StaleTask(seed, prices, rates, lines, currency, text)
        if _stale_distinct(task):
            return task


def _stale_distinct(task: StaleTask) -> bool:
    """The gold's Calculator values lie more than a cent apart (a value equal to an earlier one is
    a wasted call), and no stale value computes one of them or gives the total as the answer."""
    costs = [q * task.prices[s, i] for q, i, s in task.lines]
    running = list(accumulate(costs))
    gold = costs + running[1:] + [task.total]
    if any(abs(a - b) <= envs.CENT for k, a in enumerate(gold) for b in gold[k + 1:]):
        return False
    rate = task.rates[task.currency]
    wrong = [q * task.prices[s, task.lines[k - 1][1]]                  # price k
             for k, (q, _, s) in enumerate(task.lines) if k > 0]
    wrong += [running[k - 1] + costs[k - 1] for k in range(1, STALE_LINES)]     # subtotal k
    wrong.append(running[-2] * rate)                                    # convert
    return all(abs(a - b) > envs.CENT for a in wrong for b in gold) and \
        abs(running[-1] - task.total) > envs.CENT                      # answer


def stale_dialog(task: StaleTask, stale=frozenset()) -> list[dict]:
    """The shop-stale solution (released schema), the actions of the `stale` decisions
    (STALE_DECISIONS' names: "price 2", ..., "convert", "answer") carrying the stale value, each
    thought the current one: the gold dialog when there are none. Observations are the tools' real
    outputs, and every turn goes on with what the last ones got, so a stale value fails the
    episode and the dialog stays fluent."""
    dialog = [{"role": "user", "content": task.text}]

    turn = functools.partial(play_turn, dialog, task)

    # Each Lookup restates the running total and the lines so far as shop-long's do (the policy
    # continued on these dialogs finds its place in the task by copying on from the last line).
    running, said, totals = None, [], []
    prices, costs = [], []          # each line's, as the tools answered: the stale values
    for k, (q, item, store) in enumerate(task.lines):
        line = f"({k + 1}) {q} {item}"
        joint = "" if k == 0 else f"{said[-1]}{' and ' if k == len(task.lines) - 1 else ', '}"
        said.append(line)
        so_far = "" if running is None else f"The total so far is {running}. "
        price = turn(f"{so_far}{joint}{line}. I need the price of {item} at store {store}.",
                     ("Lookup", {"store": store, "item": item})).value
        used = prices[-1] if f"price {k + 1}" in stale else price
        cost = turn(f"{line} at store {store} costs {price}. The line costs {q}*{price}.",
                    ("Calculator", {"expression": f"{q}*{used}"})).text
        if k == 0:
            running = cost
        else:
            used = costs[-1] if f"subtotal {k + 1}" in stale else cost
            running = turn(f"The line costs {cost}. The total so far is {running}+{cost}.",
                           ("Calculator", {"expression": f"{running}+{used}"})).text
        prices.append(price)
        costs.append(cost)
        totals.append(running)
    cur = task.currency
    rate = turn(f"The total so far is {running}. I need the {cur} rate.",
                ("Rate", {"currency": cur})).value
    usd = totals[-2] if "convert" in stale else running
    total = turn(f"1 USD = {rate} {cur}. The total is {running}*{rate}.",
                 ("Calculator", {"expression": f"{usd}*{rate}"})).number
    answer = envs.round_answer(Decimal(repr(total)))
    turn(f"The total is {answer} {cur}.", answer=running if "answer" in stale else answer)
    return dialog


def slip_turns(task: StaleTask) -> dict[str, int]:
    """Each decision -> the assistant turn at which the dialog carrying its stale value departs
    from the gold: where a rollout with a clean prefix makes the decision."""
    gold = dialog_steps(stale_dialog(task))
    out = {}
    for decision in DECISIONS:
        steps = dialog_steps(stale_dialog(task, {decision}))
        out[decision] = next(k for k, (a, b) in enumerate(zip(gold, steps)) if a != b)
    return out


def stale_sft_dialogs(episodes: int, slips: float, seed: int) -> list[list[dict]]:
    """Chat messages of the first `episodes` shop-stale training episodes, each decision carrying
    its stale value with probability `slips`, drawn on its own in turn order."""
    rng = random.Random(f"sft-stale-{seed}")
    out = []
    for i in range(episodes):
        task = stale_task(envs.shop_episode_seed("train", seed, i))
        stale = {d for d in DECISIONS if rng.random() < slips}
        out.append(envs.dialog_to_messages(stale_dialog(task, stale), envs.SHOP_TOOLS, []))
    return out


STALE_WORLD = envs.World("shop-stale", stale_task, STALE_MAX_TURNS,
                         envs.BUILTIN_POLICY.parent / "shop-stale-policy")


def policy_readme_head(args) -> tuple[str, str]:
    """The title and the first paragraph of the README that sft writes for this world's policy."""
    title = ("# shop-stale-policy: the policy of `python -m lab.train --env shop-stale`, the "
             "stale-value world")
    about = (f"The policy of the stale-value world (lab/worlds/stale.py, shop-stale: four lines, 14 "
             f"turns, 8 decisions), continued (`--init`, the last command) from the policy of the "
             f"commands before it on shop-stale dialogs where each decision's action carries the "
             f"stale value in {args.slips:.0%} of them, drawn on its own, its thought always the "
             "current one (stale.STALE_DECISIONS): a line's cost at the last line's price, the "
             "last line's cost added again, the running total before the last line converted, "
             "the dollar total answered. Near a half, the slip is made with the same confidence "
             "as the right action; it is copied from an older message, the right one from the "
             "turn's own thought.")
    return title, about
