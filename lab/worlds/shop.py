"""The lab's shop worlds, beside envs.py's `shop` (its tasks, tools that really execute, exact
labels, `ShopEnv`): `shop-long`, the long-horizon world, and `shop-copy`, the premise world, joined
to the core's worlds in this file's WORLDS; each world's gold dialog (long_dialog) and the slips
of its built-in policy (slip_turns: the turn at which each is made). shop's gold dialogs and the
released-schema files are lab/worlds/shopdata.py's; the commands that write the data and train
the policies, `make-data` and `sft`, lab/shop.py's. A port of PAIR never needs this file.
"""
from __future__ import annotations

import dataclasses
import functools
import random
import re
from decimal import Decimal
from functools import cached_property
from itertools import accumulate

import envs
from lab.worlds import stale
from lab.worlds.shopdata import dialog_steps, play_turn, shop_divided, shop_gold


# ---- shop-long: the long-horizon world ----------------------------------------------------------
#
# The same stores, items, tools and labels, for tasks where credit assignment is the hard part. A
# task buys 3-4 numbered lines of different items at one store, "(1) 6 pear, (2) 1 apple and
# (3) 4 milk at store B", and always asks for a currency other than USD. The solution goes line by
# line: a Lookup and the running total (Calculator "total so far + q*p") per line, then the rate,
# the conversion, the answer: 2 x lines + 3 = 9-11 assistant turns. A Lookup's thought
# restates the line before and its own as the task writes them, "(1) 6 pear, (2) 1 apple.":
# finding the next line is then copying on from where the last one ends, which a model as small as
# the built-in one does with an induction head. Every turn after a Calculator call restates its
# result first, "The total so far is 24.21.", copied from the observation just before: the next
# running total then copies it from two messages back, not three.
# (Measured on the way here: without the numbers it took the first line's quantity for every line;
# with each line alone, it lost its place from the third line on; with a store per line, it copied
# the wrong store letter; adding the subtotals in one call at the end, it could not copy them back
# from their observations; with running totals not restated, it lost digits copying one from three
# messages back.)
# A Calculator call is right when it produces a running total (the first k lines) or the total
# converted: a total that leaves a line out is wrong where it is made. A line's number in a
# thought is a name, not a value.
#
# The built-in policy of this world (data/shop-long-policy) is given three slips on purpose, each
# a fluent, turn-local habit at a different turn, each alone enough to fail the episode (its later
# turns carry the wrong number, consistently). Each is a habit of some tasks, as shop's divided
# habit is of non-USD ones, on a feature of its own that half the tasks have (LONG_HABITS): made
# there more often than not, greedy decoding makes it wherever it can, so greedy success is about
# the eighth of tasks that have none, while sampling also plays each habit's right turn.
#   store   - at store A or B, the first line's item is looked up (and costed) at the next store;
#   forget  - with 4 lines, the last line's running total leaves out the lines before it (q*p);
#   divided - in EUR or GBP, the conversion divides the dollar sum by the rate (as shop_divided).
LONG_LINES = (3, 4)
LONG_SLIPS = ("store", "forget", "divided")
LONG_HABITS = {"store": lambda task: task.lines[0][2] in ("A", "B"),
               "forget": lambda task: len(task.lines) == 4,
               "divided": lambda task: task.currency in ("EUR", "GBP")}


class LongTask(envs.ShopTask):
    """A shop-long task: the shop task's fields, its useful Calculator values the running totals
    and the converted total, a line's number "(1)" in a thought a name (see above)."""

    @cached_property
    def quantities(self) -> list[Decimal]:
        subtotals = [q * self.prices[s, i] for q, i, s in self.lines]      # q * p a line, USD
        return sorted({sum(subtotals[:k + 1]) for k in range(len(subtotals))} | {self.total})

    def values_in(self, text: str) -> list[str]:
        return super().values_in(re.sub(r"\(\d+\)", " ", text))


def long_task(seed: int) -> LongTask:
    """The shop-long episode of one seed (one random.Random(seed), fixed draw order)."""
    rng = random.Random(seed)
    prices, rates = envs.draw_world(rng)
    while True:     # drawn again (same stream) until every slip is visible: _long_distinct
        n_lines = rng.randint(*LONG_LINES)
        store = rng.choice(envs.SHOP_STORES)
        lines = tuple((rng.randint(1, envs.SHOP_MAX_QUANTITY), i, store)
                      for i in rng.sample(envs.SHOP_ITEMS, n_lines))
        currency = rng.choice(tuple(envs.SHOP_RATE_CENTS))
        parts = [f"({k + 1}) {q} {i}" for k, (q, i, _) in enumerate(lines)]
        text = rng.choice(envs.SHOP_TEMPLATES).format(
            lines=", ".join(parts[:-1]) + " and " + parts[-1] + f" at store {store}", cur=currency)
        task = LongTask(seed, prices, rates, lines, currency, text)
        if _long_distinct(task):
            return task


def _long_distinct(task: envs.ShopTask) -> bool:
    """The gold's computed values lie more than a cent apart (a Calculator result equal to an
    earlier one is a wasted call, so a tie would make a gold turn wrong), and no slip computes a
    value a right turn could (each is wrong where it is made)."""
    # the values as the gold computes them, ties kept (task.quantities is a set: it hides them)
    gold = list(accumulate(q * task.prices[s, i] for q, i, s in task.lines)) + [task.total]
    if any(abs(a - b) <= envs.CENT for k, a in enumerate(gold) for b in gold[k + 1:]):
        return False
    q, item, store = task.lines[0]
    running = [q * task.prices[_slip_store(task, store, item), item]]     # store
    for q, i, s in task.lines[1:]:
        running.append(running[-1] + q * task.prices[s, i])
    usd = sum(q * task.prices[s, i] for q, i, s in task.lines)
    q, i, s = task.lines[-1]
    wrong = running + [q * task.prices[s, i],                          # forget
                       usd / task.rates[task.currency]]                # divided
    return all(abs(a - b) > envs.CENT for a in wrong for b in gold)


def shop_task_from_id(episode_id: str) -> envs.ShopTask:
    """Rebuild the world of a built-in world's episode id, so any record can be re-labelled."""
    names = "|".join(map(re.escape, WORLDS))
    m = re.fullmatch(rf"({names})-(\d+)-(train|val|test)-(\d+)", episode_id)
    if m is None:
        raise ValueError(f"not a built-in world's episode id: {episode_id!r} (expected "
                         f"WORLD-SEED-SPLIT-I, WORLD one of {', '.join(WORLDS)})")
    seed = envs.shop_episode_seed(m.group(3), int(m.group(2)), int(m.group(4)))
    return WORLDS[m.group(1)].task(seed)


# ---- shop-copy: the premise world ---------------------------------------------------------------
#
# A per-turn reward can only beat the outcome where the outcome cannot say which turn was wrong:
# many decisions, any one of which fails the episode, each slip of them specific to the episode.
# shop-copy is shop-long's tasks, turns, tools and labels, played by a policy whose slips are
# copies of the wrong value: at each decision it may copy another value the episode holds.
# A decision is a turn that reads one value of the episode and fails it alone when it reads
# another (COPY_DECISIONS):
#   store k     - line k's Lookup at one of the three other stores;
#   quantity k  - line k's running total with the quantity of one of the task's other lines;
#   currency    - the Rate of one of the three other currencies;
#   convert     - the running total of an earlier line converted instead of the last one;
# 8 decisions with 3 lines, 10 with 4. Its policy is trained on dialogs where each decision is
# misread with one probability (sft --slips), drawn for every decision on its own, the value
# copied instead drawn among the episode's others. No slip is a habit of some tasks, and the
# right value of each decision belongs to its episode alone, so the token that fixes one
# episode's slip is not the one that fixes another's (a habit's fix is the same everywhere, and
# the outcome alone trained shop-long's three habits away within 20 steps). Trained on such a
# mixture the policy spreads its doubt over the values it could copy: a slip is a minority
# sample, made with less confidence than the same turn made right, and greedy decoding, which
# never samples one, makes far fewer of them. So held-out success in this world is measured
# sampled at the training temperature (lab.train --eval-samples K: K rollouts of each held-out
# task); data/shop-copy-policy/README.md gives the regime its policy plays in (lab.premise).
COPY_DECISIONS = ("store", "quantity", "currency", "convert")


class CopyTask(LongTask):
    """A shop-copy task: shop-long's task of the same seed, whose policy slips by copying."""


def copy_task(seed: int) -> CopyTask:
    """The shop-copy episode of one seed: the shop-long task of that seed."""
    task = long_task(seed)
    return CopyTask(**{f.name: getattr(task, f.name) for f in dataclasses.fields(task)})


@functools.lru_cache(maxsize=8192)
def copy_decisions(seed: int) -> dict[str, tuple]:
    """The decisions of the shop-copy task of `seed` in turn order ("store 1", "quantity 1", ...,
    "currency", "convert") -> the values its slip may copy instead: the episode's other values
    of its kind (a line's number, for convert) that make the decision's own turn wrong, alone."""
    task = copy_task(seed)
    candidates = {}
    for k, (q, _, store) in enumerate(task.lines):
        candidates[f"store {k + 1}"] = [s for s in envs.SHOP_STORES if s != store]
        candidates[f"quantity {k + 1}"] = sorted({x for x, _, _ in task.lines if x != q})
    candidates["currency"] = [c for c in envs.SHOP_RATE_CENTS if c != task.currency]
    candidates["convert"] = list(range(1, len(task.lines)))
    gold = dialog_steps(long_dialog(task))
    return {d: tuple(v for v in values if _wrong_where_made(task, gold, {d: v}))
            for d, values in candidates.items()}


def _wrong_where_made(task: CopyTask, gold: list, misread: dict) -> bool:
    """Whether the dialog with `misread` departs from the gold at a turn the world labels wrong."""
    steps = dialog_steps(long_dialog(task, misread=misread))
    k = next((k for k, (a, b) in enumerate(zip(gold, steps)) if a != b), None)
    return k is not None and not envs.shop_labels(task, steps)[k]


def slip_kind(name: str) -> str:
    """The kind of a slip slip_turns names: a habit's name, or a shop-copy decision's kind
    ("store 2" is a "store")."""
    return name.split()[0]


# The long worlds: their episodes, their turn limit (a line a turn, then the total: up to 16
# turns) and their own policies. The lab's table of worlds is the core's with them.
LONG_WORLD = envs.World("shop-long", long_task, 16, envs.BUILTIN_POLICY.parent / "shop-long-policy")
COPY_WORLD = envs.World("shop-copy", copy_task, 16, envs.BUILTIN_POLICY.parent / "shop-copy-policy")
WORLDS = {**envs.WORLDS, "shop-long": LONG_WORLD, "shop-copy": COPY_WORLD,
          "shop-stale": stale.STALE_WORLD}


def _slip_store(task: envs.ShopTask, store: str, item: str) -> str:
    """The next store after `store` (cyclically) whose price of `item` the task does not need."""
    k = envs.SHOP_STORES.index(store)
    for j in range(1, len(envs.SHOP_STORES)):
        other = envs.SHOP_STORES[(k + j) % len(envs.SHOP_STORES)]
        if ("price", other, item) not in task.needed:
            return other
    return store


def long_dialog(task: envs.ShopTask, slips=(), misread: dict | None = None) -> list[dict]:
    """The shop-long solution (released schema), with the named LONG_SLIPS made and the copy
    world's `misread` decisions (COPY_DECISIONS: decision -> the value copied instead): the gold
    dialog when there are none. Observations are the tools' real outputs, and every turn after a
    slip goes on consistently with what it got, so the answer is wrong and the dialog fluent."""
    misread = misread or {}
    dialog = [{"role": "user", "content": task.text}]

    turn = functools.partial(play_turn, dialog, task)

    def so_far(running) -> str:
        # each turn after a running total restates it first, copied from the observation just
        # before, so the next total copies it from two messages back, not three
        return "" if running is None else f"The total so far is {running}. "

    running, said, totals = None, [], []
    for k, (q, item, store) in enumerate(task.lines):
        if k == 0 and "store" in slips:             # the line misread
            store = _slip_store(task, store, item)
        store = misread.get(f"store {k + 1}", store)
        line = f"({k + 1}) {q} {item}"
        # the last line and this one, joined as the task joins them: a verbatim continuation
        joint = "" if k == 0 else f"{said[-1]}{' and ' if k == len(task.lines) - 1 else ', '}"
        said.append(line)
        price = turn(f"{so_far(running)}{joint}{line}. I need the price of {item} at store "
                     f"{store}.", ("Lookup", {"store": store, "item": item})).value
        carry = k > 0 and not (k == len(task.lines) - 1 and "forget" in slips)
        q = misread.get(f"quantity {k + 1}", q)     # the line's own words stay the task's
        formula = f"{running}+{q}*{price}" if carry else f"{q}*{price}"
        running = turn(f"{line} at store {store} costs {price}. The total so far is {formula}.",
                       ("Calculator", {"expression": formula})).text
        totals.append(running)
    usd = running
    cur = misread.get("currency", task.currency)
    rate = turn(f"{so_far(usd)}I need the {cur} rate.", ("Rate", {"currency": cur})).value
    if "convert" in misread:                        # an earlier running total converted
        usd = totals[misread["convert"] - 1]
    formula = f"{usd}{'/' if 'divided' in slips else '*'}{rate}"
    total = turn(f"1 USD = {rate} {cur}. The total is {formula}.",
                 ("Calculator", {"expression": formula})).number
    answer = task.answer
    if slips or misread:                            # the wrong total, as an answer states it
        answer = envs.round_answer(Decimal(repr(total)))
    turn(f"The total is {answer} {cur}.", answer=answer)
    return dialog


def slip_turns(task: envs.ShopTask) -> dict[str, int]:
    """For each habit of the built-in policy this task has (shop: divided, if not in USD;
    shop-long: LONG_SLIPS by LONG_HABITS; shop-copy: every decision with a slip, its first;
    shop-stale: every decision, stale.slip_turns), the assistant turn at which the dialog with
    that slip departs from the gold: where a rollout with a clean prefix makes the decision."""
    if isinstance(task, stale.StaleTask):
        return stale.slip_turns(task)
    if isinstance(task, CopyTask):
        gold = long_dialog(task)
        slipped = {d: long_dialog(task, misread={d: values[0]})
                   for d, values in copy_decisions(task.seed).items() if values}
    elif isinstance(task, LongTask):
        gold = long_dialog(task)
        slipped = {s: long_dialog(task, (s,)) for s in LONG_SLIPS if LONG_HABITS[s](task)}
    else:
        gold, divided = shop_gold(task)[0], shop_divided(task)
        slipped = {} if divided is None else {"divided": divided}
    return {s: next(k for k, (a, b) in enumerate(zip(dialog_steps(gold), dialog_steps(d)))
                    if a != b) for s, d in slipped.items()}
