"""Tool-use environments (METHOD.md §1, §2, §10): the ReAct text every model sees and its
parser, the built-in `shop` world, the GTA replay of the released episodes and its answer
matching, the Calculator tool, and the episode files themselves (ToolBench, LLM-judged,
is the lab's: lab/worlds/toolbench.py).

    env = make("gta", split="test", data_dir=...)       # or ShopEnv("test"), the built-in world
    ep = env.episode(0)
    while not ep.done:
        ep.step(policy(ep.messages))
    ep.score()          # in [0, 1], or None with ep.skip_reason

An episode is a chat: the task and the tool instructions, then one ReAct step
(parse_react) per assistant turn, a tool call answered by a user message
`Observation: ...`, until a final answer or the last turn allowed. Where the paper and the authors'
release are silent or disagree:
- GTA answer matching (gta_match): right iff every whitelist group has an alias in the answer and
  no blacklist alias is in it, GTA's reference `iscorrect`. The paper's "at least one
  whitelist group fully matched" is the release's loose matcher, which requires every
  alias of a group: the gold answers of GTA test 28 ("24185" for ["24185", "24,185"]),
  train 171 and 207 would fail it.
- A call the gold dialog repeats with different responses (ToolBench's retries) replays them in
  order, then the last one again; the release kept only the first (ReplayCache).
- The task shown to the model lists the episode's attached files (GTA's image paths): without
  them no GTA tool call can be written. The release did the same in its rollout prompt.
"""
from __future__ import annotations

import ast
import json
import math
import operator
import os
import random
import re
from dataclasses import dataclass
from decimal import Decimal, ROUND_HALF_UP
from functools import cached_property
from pathlib import Path
from typing import Callable

import requests

import model

MAX_TURNS = 10                      # assistant turns per episode (paper Appendix eval)
# longer tool results are cut and get "..." (METHOD.md §2)
OBSERVATION_CHARS = 1000


# ==== METHOD.md §2: the one text of tools, steps and observations, offline and online ===========
# Offline records and online rollouts render the same text, so a probe fitted offline
# scores the distribution it was fitted on. An assistant step is
#     Thought: {thought}
#     Action: {tool name}
#     Action Input: {json.dumps(arguments, ensure_ascii=False)}
# and a final turn "Thought: {thought}\nFinal Answer: {answer}", no Thought line without
# a thought. A tool result is a user message "Observation: {text}", cut to
# OBSERVATION_CHARS. The first user message is the task (and its files), a blank line,
# the tool list and _REPLY_FORMAT; consecutive messages of a role join with a blank line.
# model.py's Tokenizer.render adds the chat template.
_REPLY_FORMAT = """
Solve the task step by step. Each reply is one step, in exactly one of two formats.
To call one tool:
Thought: <your reasoning about what to do next>
Action: <the tool name, exactly as listed above>
Action Input: <the tool's inputs as one JSON object keyed by input name>
Then stop: the tool's result comes back to you as "Observation: <result>".
To answer, once you know the answer:
Thought: <your reasoning>
Final Answer: <the answer only>"""


def tool_instructions(tools: list[dict]) -> str:
    """The tool list and the reply format, after the task in the first user message: a line per
    tool (name: description), a line per input (name (type[, optional]): description). Whitespace
    is collapsed: a released description cannot break the layout."""
    lines = ["You can use the following tools:"]
    for tool in tools:
        desc = " ".join((tool.get("description") or "").split())
        lines.append(f"- {tool['name']}")
        if desc:
            lines[-1] += f": {desc}"
        for inp in tool.get("inputs") or []:
            optional = ""
            if inp.get("optional"):
                optional = ", optional"
            # a non-str type fails check_episode_file
            kind = (inp.get("type") or "text") + optional
            note = " ".join((inp.get("description") or "").split())
            lines.append(f"    {inp['name']} ({kind})")
            if note:
                lines[-1] += f": {note}"
    if not tools:
        lines.append("(none)")
    return "\n".join(lines) + "\n" + _REPLY_FORMAT


def render_action(thought: str | None, name: str, arguments: dict) -> str:
    """A tool call as the assistant writes it: Thought (when there is one), Action,
    Action Input (the arguments as one line of JSON, non-ASCII kept)."""
    text = f"Action: {name}\nAction Input: {json.dumps(arguments, ensure_ascii=False)}"
    return f"Thought: {thought}\n{text}" if thought else text


def render_final(thought: str | None, answer: str) -> str:
    """A final turn as the assistant writes it: Thought (when there is one), Final Answer."""
    return f"Thought: {thought}\nFinal Answer: {answer}" if thought else f"Final Answer: {answer}"


def render_observation(text: str) -> str:
    """A tool's result as the user message that answers a step. A lone surrogate becomes U+FFFD
    (no tokenizer encodes it) and a long result is cut: a web page would fill the context."""
    text = model.without_surrogates(text)
    if len(text) > OBSERVATION_CHARS:
        text = text[:OBSERVATION_CHARS] + "..."
    return f"Observation: {text}"


def render_task(task: str, files: list[dict] | tuple = ()) -> str:
    """The task text and the files it refers to (GTA tools take these paths as inputs)."""
    paths = [f"- {f['path']} ({f.get('type') or 'file'})" for f in files if f.get("path")]
    if paths:                           # "Files:\n- image/1.jpg (image)"
        return task.strip() + "\n\nFiles:\n" + "\n".join(paths)
    return task.strip()


def tool_result_text(message: dict) -> str:
    """The text of a released `tool` message: {type, content} or a plain string."""
    content = message.get("content")
    if isinstance(content, dict):
        content = content.get("content")
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)


def assistant_parts(message: dict) -> tuple[str | None, dict | None, str | None]:
    """(thought, tool call {name, arguments} or None, final content) of a released
    assistant turn. Three released turns carry text in `content` beside a tool call and
    no `thought`: it precedes the call (as in Qwen's tool template) and reads as the
    step's reasoning, so it is the thought. So is `explanation`, where one contaminated
    turn holds its rewritten thought (else unseen)."""
    parts = [message.get("thought"), message.get("explanation")]
    call = None
    final = None
    if message.get("tool_calls"):
        # check_dialog allows one call a turn
        call = message["tool_calls"][0]["function"]
        parts.append(message.get("content"))
    else:
        final = (message.get("content") or "").strip()
    # the non-empty parts, a blank line apart
    thought = "\n\n".join(p.strip() for p in parts if isinstance(p, str) and p.strip()) or None
    return thought, call, final


def render_assistant(message: dict) -> str:
    """A released assistant turn as the ReAct text a policy writes (assistant_parts)."""
    thought, call, final = assistant_parts(message)
    if call is not None:
        return render_action(thought, call["name"], call.get("arguments") or {})
    return render_final(thought, final)


def dialog_to_messages(dialog: list[dict], tools: list[dict],
                       files: list[dict] | tuple = ()) -> list[dict]:
    """A released dialog as chat messages: the task (+ files + tool instructions),
    assistant steps, tool results as user `Observation:` messages; consecutive messages
    of a role merged."""
    messages: list[dict] = []
    for i, m in enumerate(dialog):
        role = "user"
        if m["role"] == "assistant":
            role = "assistant"
            content = render_assistant(m)
        elif m["role"] == "user" and i:
            content = m["content"]
        elif m["role"] == "user":
            # the task: its files, then the tools and the reply format
            content = render_task(m["content"], files) + "\n\n" + tool_instructions(tools)
        else:                           # a tool result
            content = render_observation(tool_result_text(m))
        # released data: user messages only
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + content
        else:
            messages.append({"role": role, "content": content})
    return messages


# ==== ReAct parser: one assistant reply -> a tool call, a final answer, or what was wrong with it
# The rules, and why:
# - A marker (Thought:, Action:, Action Input:, Final Answer:, Observation:) counts at
#   the start of a line only, in any case, with spaces or tabs around it: a word inside a
#   sentence is text.
# - The step is the first "Action:" whose next marker is "Action Input:", or the first
#   "Final Answer:", whichever comes first. A thought may itself hold a line "Action:"
#   (ToolBench's gold thoughts do), and what follows the step (an "Observation:" the
#   model invented, a second step) is ignored: the environment answers one step per turn.
# - The thought: from the first "Thought:" before the step (else the start) to it,
#   stripped, or None.
# - The tool's name is the text between "Action:" and "Action Input:" stripped of spaces,
#   quotes, backticks and asterisks (markdown); a name over several lines names no tool:
#   the call misses.
# - The Action Input is the first JSON value after its marker (an opening ``` fence
#   skipped, the rest ignored): an object, nested at most MAX_NESTING deep, holding no
#   lone surrogate escape.
# - Every failure is a ParseError whose message becomes the observation: it tells the
#   agent how to write the reply, and the episode goes on.
@dataclass
class Action:
    """A step that calls one tool."""
    thought: str | None     # None when the reply has none
    name: str
    arguments: dict         # the Action Input, a JSON object


@dataclass
class Final:
    """A step that answers: the episode ends."""
    thought: str | None
    answer: str             # stripped, never empty


@dataclass
class ParseError:
    """A reply that is neither step; the episode goes on with the message as its observation."""
    message: str        # written for the agent: it becomes the observation


_MARKER = re.compile(r"^[ \t]*(thought|action[ \t]*input|action|final[ \t]*answer|observation)"
                     # "action input" tried first
                     r"[ \t]*:", re.IGNORECASE | re.MULTILINE)
_FORMAT_HINT = ("Reply with 'Thought:', 'Action:' and 'Action Input:' lines to call a tool, or "
                "with 'Thought:' and 'Final Answer:' lines to answer.")
MAX_NESTING = 64             # of an Action Input's objects and lists


def parse_react(text: str) -> Action | Final | ParseError:
    """The first step by the rules above, or a ParseError saying what is wrong. Never raises."""
    if not isinstance(text, str):
        return ParseError(f"The reply is not text. {_FORMAT_HINT}")
    marks = [(re.sub(r"[ \t]+", " ", m.group(1).lower()), m.start(), m.end())
             # (keyword, lower case and single-spaced; start; end)
             for m in _MARKER.finditer(text)]
    head = None                         # the index in `marks` of the step's marker
    for k, (keyword, _, _) in enumerate(marks):
        if keyword == "final answer" or (keyword == "action" and k + 1 < len(marks)
                                         and marks[k + 1][0] == "action input"):
            head = k
            break
    if head is None:
        # no Action Input after it
        lone = next((mk for mk in marks if mk[0] == "action"), None)
        if lone is None:
            return ParseError(f"No 'Action:' or 'Final Answer:' line found. {_FORMAT_HINT}")
        # the rest of its line
        name = text[lone[2]:].split("\n", 1)[0].strip()
        return ParseError(f"'Action: {name[:100]}' must be followed by an 'Action Input:' line "
                          "with the tool's inputs as a JSON object.")
    # the step's keyword and marker
    kind, start, end = marks[head]
    # the thought starts after the first "Thought:" before the step, else at the start
    thought_at = next((mk[2] for mk in marks[:head] if mk[0] == "thought"), 0)
    thought = text[thought_at:start].strip() or None
    # where the marker's text ends: the next marker, or the end
    after = len(text)
    if head + 1 < len(marks):
        after = marks[head + 1][1]
    if kind == "final answer":
        answer = text[end:after].strip()
        if not answer:
            return ParseError("'Final Answer:' is empty: write the answer after it.")
        return Final(thought, answer)
    # markdown: **Search**, `Search`
    name = text[end:after].strip().strip("`'\"*").strip()
    if not name:
        return ParseError(f"'Action:' names no tool. {_FORMAT_HINT}")
    # all that follows "Action Input:"
    inputs = _action_input(text[marks[head + 1][2]:])
    if isinstance(inputs, ParseError):
        return inputs
    return Action(thought, name, inputs)


def _action_input(raw: str) -> dict | ParseError:
    """The JSON object after `Action Input:` (an opening ``` fence skipped), or what is wrong."""
    raw = re.sub(r"^```[A-Za-z]*", "", raw.lstrip()).lstrip()     # ```json opens a fence
    if not raw:
        return ParseError("'Action Input:' is empty: write the inputs as a JSON object "
                          "(use {} for a tool without inputs).")
    try:
        # the first value; the rest ignored
        arguments, _ = json.JSONDecoder().raw_decode(raw)
    except json.JSONDecodeError as e:
        return ParseError(f"Invalid JSON in Action Input: {e.msg} (line {e.lineno}, column "
                          f"{e.colno}). Write the inputs as one JSON object, for example "
                          '{"name": "value"}.')
    except RecursionError:
        return ParseError("Invalid JSON in Action Input: the value is too deeply nested.")
    except ValueError as e:
        # e.g. an integer longer than Python converts (4300 digits)
        return ParseError(f"Invalid JSON in Action Input: {str(e)[:200]}")
    if not isinstance(arguments, dict):
        return ParseError(f"Action Input must be a JSON object {{...}}, not a JSON "
                          f"{type(arguments).__name__}.")
    stack = [(arguments, 1)]        # iteratively: json.dumps (the replay key) recurses
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > MAX_NESTING:
                return ParseError(f"Invalid JSON in Action Input: nested deeper than "
                                  f"{MAX_NESTING} levels.")
            children = v
            if isinstance(v, dict):
                children = v.values()
            stack.extend((x, depth + 1) for x in children)
    # echoed back, no tokenizer could encode it
    if model.holds_lone_surrogate(arguments):
        return ParseError("Action Input holds a \\ud800-\\udfff escape that is not half of a "
                          "surrogate pair: write the character itself.")
    return arguments


# ==== Episodes and environments =================================================================
@dataclass
class StepResult:
    """What a step did to the chat: the observation appended, or the end of the episode.
    A rollout holding the chat in a KV cache renders it again from `rewritten_from` when
    that is not None."""
    observation: str | None     # content of the user message appended, None when done
    done: bool
    # the first message rewritten in place (a history cap)
    rewritten_from: int | None = None


class Episode:
    """One task being played: its chat (`messages`), the parsed steps and the final answer. A
    subclass answers a call (call_tool(name, arguments) -> observation) and scores the episode
    (score() -> [0, 1], None: skipped; out of turns without an answer: 0)."""
    max_turns = MAX_TURNS               # a world with longer tasks allows more (World)

    def __init__(self, id: str, task: str, tools: list[dict], files: list[dict] | tuple = ()):
        self.id = str(id)
        # the chat so far as the policy reads it, from one user message (the task, its
        # files, the tools and the reply format)
        self.messages = dialog_to_messages([{"role": "user", "content": task}], tools, files)
        # parsed, one per assistant turn
        self.steps: list[Action | Final | ParseError] = []
        self.final_answer: str | None = None    # the Final step's answer
        self.done = False
        # why the episode cannot be scored, or None
        self.skip_reason: str | None = None

    def step(self, assistant_text: str) -> StepResult:
        """Append the policy's turn (its text without the closing <|im_end|>) and answer it."""
        if self.done:
            raise RuntimeError(f"episode {self.id} is done: no more steps")
        self.messages.append({"role": "assistant", "content": assistant_text})
        parsed = parse_react(assistant_text)
        self.steps.append(parsed)
        if isinstance(parsed, Final):
            self.final_answer = parsed.answer
        # out of turns: 0
        if isinstance(parsed, Final) or len(self.steps) >= self.max_turns:
            self.done = True
            return StepResult(None, True)
        if isinstance(parsed, Action):
            result = self.call_tool(parsed.name, parsed.arguments)
        else:
            # a ParseError: the agent reads what was wrong
            result = f"Invalid reply: {parsed.message}"
        observation = render_observation(result)
        self.messages.append({"role": "user", "content": observation})
        return StepResult(observation, False, self._after_observation())

    def _after_observation(self) -> int | None:
        """StepResult.rewritten_from of an observation; a replay's history cap overrides this."""
        return None

    def labels(self) -> list[bool] | None:
        """Each step's exact label (True: right), or None where the world cannot label
        steps: exact step labels exist only in the built-in worlds."""
        return None


class Env:
    """A split: env.episode(i or id) is a fresh Episode, _new_episode(id, records[id])."""

    def __init__(self, records: dict):
        # episode id -> record (a built-in world's: its index)
        self.records = records
        self.ids = list(records)

    def __len__(self) -> int:
        return len(self.ids)

    def episode(self, i: int | str) -> Episode:
        """A fresh Episode of the split's i-th episode (an int) or of the episode id `i`
        (a str); KeyError when the split has no such id."""
        key = self.ids[i] if isinstance(i, int) else str(i)
        if key not in self.records:
            raise KeyError(f"no episode {key!r} in this split")
        return self._new_episode(key, self.records[key])


# ==== The built-in world, shop: tasks drawn from a seed, tools that really execute, exact labels
# An episode's seed draws a world (USD prices of SHOP_ITEMS at SHOP_STORES, exchange
# rates) and a task, "What is the total cost of 3 apple at store B and 2 pear at store A,
# in EUR?": 2-5 tool calls (a Lookup per line, a Rate unless the currency is USD, one
# Calculator), then the answer with 2 decimals. Vocabulary and phrasing are small and
# regular on purpose: a tiny model trained on the gold dialogs must be able to learn the
# world. Every turn is labelled exactly (shop_labels): the tools run against the world,
# so any dialog, gold, contaminated or a rollout, is judged turn by turn by re-running
# its calls. The episode scores 1 when its answer's first number is within half a cent of
# the exact total (_answer_right).
SHOP_STORES = ("A", "B", "C", "D")
SHOP_ITEMS = ("apple", "bread", "egg", "milk", "pear", "rice")
# units of each currency one USD buys, drawn uniformly in cents
SHOP_RATE_CENTS = {"EUR": (80, 99), "GBP": (70, 89), "CAD": (120, 149), "JPY": (10000, 15999)}
SHOP_CURRENCIES = ("USD",) + tuple(SHOP_RATE_CENTS)
SHOP_PRICE_CENTS = (50, 999)        # USD 0.50 to 9.99
SHOP_MAX_QUANTITY = 6               # a line buys 1 to 6 of its item
SHOP_TEMPLATES = ("What is the total cost of {lines}, in {cur}?",
                  "How much do {lines} cost in total, in {cur}?",
                  "I buy {lines}. How much do I pay in {cur}?")
# Episode i's seed: seed * SHOP_SEED_STRIDE + SHOP_SPLIT_OFFSET[split] + i, disjoint
# across splits and seeds while i < SHOP_SPLIT_SIZE[split]; val is the top of the train
# range, which no run nears.
SHOP_SEED_STRIDE = 10_000_000
SHOP_SPLIT_OFFSET = {"train": 0, "val": 4_500_000, "test": 5_000_000}
SHOP_SPLIT_SIZE = {"train": 4_500_000, "val": 500_000, "test": 5_000_000}
# Held-out pools: a success rate near 0.3 on the 600 test episodes is known to +-3.7
# points (95%), a mean over 3 seeds to about +-2.
# a split's episodes by default
SHOP_EPISODES = {"train": 10_000, "val": 200, "test": 600}
# the rules' version (2: half a cent): cached evaluations and probes key on it
SHOP_SCORING = 2
# "equals" within half a cent: of a total, its rounding, not a cent off
_SHOP_VALUE_TOL = 0.005
CENT = Decimal("0.01")             # the answer's precision
# a number as prices and rates are written: 2.50, 3
_NUM = r"\d+(?:\.\d+)?"


def _text_input(key: str | None, text: str) -> dict:
    """One text input (or, key None, output) of a tool, in the released (GTA) tool schema."""
    return {"type": "text", "name": key, "description": text, "optional": False,
            "default": None, "filetype": None}


# the released (GTA) tool schema
SHOP_TOOLS = [{"name": name, "description": description,
               "inputs": [_text_input(k, text) for k, text in inputs.items()],
               "outputs": [_text_input(None, output)]}
              for name, description, inputs, output in (
    ("Lookup", "Look up the price in USD of one item at one store.",
     {"store": "The store: A, B, C or D.", "item": "The item, e.g. apple."}, "The price in USD."),
    ("Rate", "How many units of a currency one USD buys.",
     {"currency": "The currency: " + ", ".join(SHOP_CURRENCIES) + "."}, "The exchange rate."),
    ("Calculator", "Evaluate an arithmetic expression (+ - * / and parentheses).",
     {"expression": "e.g. (3*2.50+1.20)*0.92"}, "The value."))]
# each tool's input names, in the order its schema lists them
_SHOP_ARGS = {t["name"]: tuple(i["name"] for i in t["inputs"]) for t in SHOP_TOOLS}
# spelling, values, name in errors
_SHOP_NAMES = {"store": (str.upper, SHOP_STORES, "Stores"),
               "item": (str.lower, SHOP_ITEMS, "Items"),
               "currency": (str.upper, SHOP_CURRENCIES, "Currencies")}


def round_answer(amount: Decimal) -> str:
    """An amount as a shop answer states it: rounded half-up to the cent, "12.35"."""
    return str(amount.quantize(CENT, rounding=ROUND_HALF_UP))


@dataclass(frozen=True)
class ShopTask:
    """One episode: the world and the task. Facts are ("price", store, item) or ("rate", cur).
    Amounts are Decimals, so the exact total and its rounding carry no float error."""
    seed: int
    prices: dict            # (store, item) -> Decimal USD, every store sells every item
    rates: dict             # currency -> Decimal units per USD ("USD" -> 1.00)
    lines: tuple            # ((quantity, item, store), ...), distinct (store, item)
    currency: str
    text: str

    @cached_property
    def needed(self) -> tuple:
        """The facts to fetch, in the gold's order: each line's price, then the rate unless USD."""
        facts = tuple(("price", s, i) for _, i, s in self.lines)
        if self.currency != "USD":
            facts += (("rate", self.currency),)
        return facts

    def value(self, fact) -> Decimal:
        """The world's value of a fact: a price in USD or a rate."""
        return self.prices[fact[1:]] if fact[0] == "price" else self.rates[fact[1]]

    @cached_property
    def total(self) -> Decimal:
        """Exact total in the task's currency: sum over lines of q * p, times the rate."""
        return sum(q * self.prices[s, i] for q, i, s in self.lines) * self.rates[self.currency]

    @cached_property
    def answer(self) -> str:
        """The total rounded half-up to 2 decimals."""
        return round_answer(self.total)

    @cached_property
    def quantities(self) -> list[Decimal]:
        """Every value a useful Calculator call may produce: a sum of line subtotals q*p
        over any subset of the lines (any grouping), such a sum converted, a converted
        unit price p*r."""
        rate = self.rates[self.currency]
        # q * p a line, USD
        subtotals = [q * self.prices[s, i] for q, i, s in self.lines]
        sums = {sum(x for k, x in enumerate(subtotals) if mask >> k & 1)
                # bit k of mask: line k is in the sum
                for mask in range(1, 2 ** len(subtotals))}
        out = set(sums)
        if self.currency != "USD":
            out |= {x * rate for x in sums}
            out |= {self.prices[s, i] * rate for _, i, s in self.lines}
        return sorted(out)

    def values_in(self, text: str) -> list[str]:
        """The numbers `text` states as values: all here (lab/worlds/shop.py's LongTask
        skips "(1)")."""
        return re.findall(_NUM, text)


def draw_world(rng: random.Random) -> tuple[dict, dict]:
    """An episode's prices and rates (2.50 keeps its decimals), its seed's first draws."""
    # 250 -> 2.50
    prices = {(s, i): Decimal(rng.randint(*SHOP_PRICE_CENTS)).scaleb(-2)
              for s in SHOP_STORES for i in SHOP_ITEMS}
    rates = {"USD": Decimal("1.00")}    # a USD task's total is multiplied by 1.00 too
    for currency, span in SHOP_RATE_CENTS.items():
        rates[currency] = Decimal(rng.randint(*span)).scaleb(-2)
    return prices, rates


def shop_task(seed: int) -> ShopTask:
    """The episode of one seed (one random.Random(seed), fixed draw order: the world, the
    number of lines, their distinct (store, item) pairs, their quantities, the currency,
    the phrasing)."""
    rng = random.Random(seed)
    prices, rates = draw_world(rng)
    n_lines = rng.randint(1, 3)
    # the lines' (store, item) pairs, all distinct
    pairs = rng.sample([(s, i) for s in SHOP_STORES for i in SHOP_ITEMS], n_lines)
    lines = tuple((rng.randint(1, SHOP_MAX_QUANTITY), i, s) for s, i in pairs)
    currency = rng.choice(SHOP_CURRENCIES)
    parts = [f"{q} {i} at store {s}" for q, i, s in lines]
    listed = parts[-1]
    if len(parts) > 1:                  # "a, b and c"
        listed = ", ".join(parts[:-1]) + " and " + listed
    text = rng.choice(SHOP_TEMPLATES).format(lines=listed, cur=currency)
    return ShopTask(seed, prices, rates, lines, currency, text)


@dataclass(frozen=True)
class World:
    """A built-in world; the lab builds its longer ones the same way (lab/worlds/shop.py)."""
    name: str
    task: Callable[[int], ShopTask]     # an episode's seed -> its task
    max_turns: int                      # the assistant turns an episode allows
    # its own: --model's default (python -m lab.shop sft)
    policy: Path


# grpo.py's default
BUILTIN_POLICY = Path(__file__).resolve().parent / "data" / "shop-policy"
WORLDS = {"shop": World("shop", shop_task, MAX_TURNS, BUILTIN_POLICY)}


def shop_episode_seed(split: str, seed: int, i: int) -> int:
    """The seed of episode i of `split` for the run's `seed` (the comment above
    SHOP_SEED_STRIDE); ValueError for an unknown split, IndexError past the split's size."""
    if split not in SHOP_SPLIT_OFFSET:
        raise ValueError(f"shop: unknown split {split!r} (choose from train, val, test)")
    if not 0 <= i < SHOP_SPLIT_SIZE[split]:
        raise IndexError(f"shop: {split} episode index {i} out of range "
                         f"[0, {SHOP_SPLIT_SIZE[split]})")
    return seed * SHOP_SEED_STRIDE + SHOP_SPLIT_OFFSET[split] + i


def shop_episode_id(split: str, seed: int, i: int, world: str = "shop") -> str:
    """A built-in world's episode id, "shop-42-test-7": the world, the seed, the split, i."""
    return f"{world}-{seed}-{split}-{i}"


@dataclass(frozen=True)
class ShopResult:
    """One tool call run against the world: its observation, and what shop_labels checks."""
    text: str                   # the observation
    fact: tuple | None = None   # what a Lookup/Rate call learned ...
    value: Decimal | None = None    # ... and its value
    number: float | None = None     # a Calculator result


def _number(calculated: str) -> float | None:
    """A Calculator answer as a number; None for an "Error: ..." answer."""
    try:
        return float(calculated)
    except ValueError:              # "Error: ..."
        return None


def shop_execute(task: ShopTask, name: str, arguments) -> ShopResult:
    """Run one tool call against the episode's world. An unknown tool, inputs other than
    exactly the tool's own (each a string), or an unknown store, item or currency answers
    "Error: ..." naming what the world accepts; names are read in any case, spaces around
    them stripped."""
    keys = _SHOP_ARGS.get(name)
    if keys is None:
        return ShopResult(f"Error: unknown tool '{name}'. Tools: Lookup, Rate, Calculator.")
    if not isinstance(arguments, dict) or set(arguments) != set(keys) or \
            not all(isinstance(arguments[k], str) for k in keys):
        wanted = ", ".join(f'"{k}": ...' for k in keys)
        return ShopResult(f"Error: {name} takes {{{wanted}}}.")
    args = {k: arguments[k].strip() for k in keys}     # " A " is store A
    if name == "Calculator":
        out = calculate(args["expression"])
        number = _number(out)
        # an error, or an integer past 1e308
        if number is None or not math.isfinite(number):
            return ShopResult(out)
        # Float noise (9.108000000000001) is rounded away: a small model should not have
        # to copy it.
        return ShopResult(str(round(number, 6)), number=number)
    for key, raw in args.items():
        spelling, names, plural = _SHOP_NAMES[key]
        if spelling(raw) not in names:
            return ShopResult(f"Error: unknown {key} '{raw}'. {plural}: {', '.join(names)}.")
    if name == "Rate":
        cur = args["currency"].upper()
        return ShopResult(f"1 USD = {task.rates[cur]} {cur}.", ("rate", cur), task.rates[cur])
    store = args["store"].upper()
    item = args["item"].lower()
    price = task.prices[store, item]
    return ShopResult(f"{item} at store {store} costs {price} USD.", ("price", store, item), price)


# What a thought can claim, read with fixed patterns (the gold dialogs' phrasing)
_SHOP_CLAIM = re.compile(
    # a price
    rf"(?P<item>[a-z]+) at store (?P<store>[a-z])\b costs (?P<price>{_NUM})(?: USD\b)?"
    # a rate
    rf"|\b1 USD = (?P<rate>{_NUM}) (?P<rcur>[a-z]{{3}})\b"
    # a price needed next
    r"|\bI need the price of (?P<nitem>[a-z]+) at store (?P<nstore>[a-z])\b"
    # a rate needed next
    r"|\bI need the (?P<ncur>[a-z]{3}) rate\b"
    # the total: an expression or a number, maybe with its currency
    r"|\bthe total is (?P<total>[\d.,+\-*/() ]*[\d)])(?: (?P<tcur>USD|EUR|GBP|CAD|JPY)\b)?",
    re.IGNORECASE)


def within_half_cent(x: float, values) -> bool:
    """x equals one of `values` within half a cent (1e-9 absorbs float error at the boundary)."""
    return any(abs(x - float(v)) <= _SHOP_VALUE_TOL + 1e-9 for v in values)


def _answer_right(task: ShopTask, answer: str | None) -> bool:
    """Its first number is within half a cent of the total (for 1.674: 1.67 or 1.674, not 1.68)."""
    # "1,234.50", "-3": commas allowed
    m = re.search(r"-?\d[\d,]*(?:\.\d+)?", answer or "")
    return m is not None and within_half_cent(float(m.group(0).replace(",", "")), [task.total])


def shop_thought_true(task: ShopTask, thought: str | None, known: dict,
                      computed: list[float]) -> bool:
    """Every _SHOP_CLAIM is true (a price or rate the world's; "I need ..." a needed fact not
    fetched yet; "the total is <expression or x> [CUR]" the total in the task's currency) and
    every other number (ShopTask.values_in) one the task involves: a quantity, a price or rate it
    needs or the dialog fetched (known: fact -> value), a useful Calculator value (quantities),
    the answer, an earlier Calculator result (computed)."""
    def true(m: re.Match) -> bool:
        if m.group("price"):
            key = (m.group("store").upper(), m.group("item").lower())
            price = float(m.group("price"))
            return key in task.prices and within_half_cent(price, [task.prices[key]])
        if m.group("rate"):
            cur = m.group("rcur").upper()
            rate = float(m.group("rate"))
            return cur in task.rates and within_half_cent(rate, [task.rates[cur]])
        if m.group("nitem") or m.group("ncur"):
            if m.group("nitem"):
                fact = ("price", m.group("nstore").upper(), m.group("nitem").lower())
            else:
                fact = ("rate", m.group("ncur").upper())
            return fact in task.needed and fact not in known
        expression = m.group("total").replace(",", "")      # "10,996.94"
        cur = m.group("tcur")
        # the longest start that computes: "21.91 (2 lines)" claims 21.91
        value = None
        for k in range(len(expression), 0, -1):
            value = _number(calculate(expression[:k]))
            if value is not None:
                break
        return not (cur and cur.upper() != task.currency) and value is not None \
            and within_half_cent(value, [task.total])

    if not thought:
        return True
    if not all(true(m) for m in _SHOP_CLAIM.finditer(thought)):
        return False
    # the numbers a thought may mention besides its claims
    allowed = [Decimal(q) for q, _, _ in task.lines] + [task.value(f) for f in task.needed]
    allowed += list(known.values()) + task.quantities + [Decimal(task.answer)]
    rest = _SHOP_CLAIM.sub(" ", thought)        # the thought without its claims
    return all(within_half_cent(float(x), allowed) or within_half_cent(float(x), computed)
               for x in task.values_in(rest))


def shop_labels(task: ShopTask, steps: list) -> list[bool]:
    """Exact correctness of each assistant turn (parse_react's steps; calls re-run
    against the world, observations never read). A turn is right iff its thought asserts
    nothing false (shop_thought_true) and its step is a Lookup or Rate of a fact the
    task needs that no earlier turn fetched, a Calculator call that evaluates to one of
    ShopTask.quantities no earlier call produced, or a final answer within half a cent of
    the exact total. An unknown tool, bad arguments or an unparsable reply is never
    right. Claims are checked against the world, not the dialog: matched contaminated
    data keep the clean observations after a contaminated call (as the release does), and
    a later gold turn restating the truth is true."""
    known: dict = {}                    # fact -> value, fetched by the turns so far
    computed: list[float] = []          # the Calculator results so far
    labels = []
    for step in steps:
        # a ParseError, or several released calls
        if not isinstance(step, (Action, Final)):
            labels.append(False)
            continue
        ok = True
        if isinstance(step, Final):
            ok = _answer_right(task, step.answer)
        ok = ok and shop_thought_true(task, step.thought, known, computed)
        if isinstance(step, Action):
            res = shop_execute(task, step.name, step.arguments)    # the call run again
            if res.fact is not None:            # a Lookup or Rate: a needed fact, new
                ok = ok and res.fact in task.needed and res.fact not in known
                known[res.fact] = res.value
            elif res.number is not None:
                # a Calculator result: a needed value, new
                ok = ok and within_half_cent(res.number, task.quantities)
                ok = ok and not within_half_cent(res.number, computed)
                computed.append(res.number)
            else:                               # an error: a call that does nothing
                ok = False
        labels.append(ok)
    return labels


class ShopEpisode(Episode):
    """A built-in world's episode: tools run against its world, half-cent score, exact labels."""

    def __init__(self, key: str, task: ShopTask, max_turns: int = MAX_TURNS):
        super().__init__(key, task.text, SHOP_TOOLS)
        self.task = task
        self.max_turns = max_turns

    def call_tool(self, name: str, arguments: dict) -> str:
        """The tool run against the episode's world: its observation."""
        return shop_execute(self.task, name, arguments).text

    def score(self) -> float:
        """1.0 when the final answer is within half a cent of the exact total, else 0.0."""
        return float(_answer_right(self.task, self.final_answer))

    def labels(self) -> list[bool]:
        """Every step's exact label (shop_labels)."""
        return shop_labels(self.task, self.steps)


class ShopEnv(Env):
    """One split (train, val or test) of a built-in world; records maps an id to its index."""

    def __init__(self, split: str = "test", seed: int = 42, episodes: int | None = None,
                 world: World = WORLDS["shop"]):
        shop_episode_seed(split, 0, 0)      # refuses an unknown split
        self.split = split
        self.seed = seed
        self.world = world
        n = SHOP_EPISODES[split] if episodes is None else episodes
        super().__init__({shop_episode_id(split, seed, i, world.name): i for i in range(n)})

    def _new_episode(self, key: str, i: int) -> ShopEpisode:
        task = self.world.task(shop_episode_seed(self.split, self.seed, i))
        return ShopEpisode(key, task, self.world.max_turns)


# ==== Replay (METHOD.md §10): tool calls answered from the gold dialog ==========================
# A released episode has no live tools: a call is answered from a cache built from its
# gold dialog (cache_key: the same call with its keys in another order hits). A call the
# gold dialog never made misses: GTA computes a Calculator miss (calculate), answers its
# unavailable tools as the paper's evaluation appendix says, and any other miss with
# simulator_miss's line. A replay scores the final answer only: it has no step labels
# (Episode.labels is None).
def cache_key(name: str, arguments) -> tuple[str, str]:
    """The replay cache's key of a call: its name and its arguments as JSON with sorted
    keys, so the keys' order does not matter."""
    return name, json.dumps(arguments, sort_keys=True)


def simulator_miss(name: str, arguments) -> str:
    """The observation of a call the gold dialog never made (the release's line)."""
    return (f"[Simulator] Tool '{name}' with args {json.dumps(arguments, ensure_ascii=False)} "
            "has no cached response.")


class ReplayCache:
    """cache_key(call) -> the gold dialog's responses to it, in order, then the last again."""

    def __init__(self, dialog: list[dict]):
        self.entries: dict[tuple[str, str], list[str]] = {}
        self.served: dict[tuple[str, str], int] = {}    # key -> responses served so far
        # the latest assistant turn's call, until its result
        call = None
        for m in dialog:
            if m["role"] == "assistant":
                _, call, _ = assistant_parts(m)
            elif m["role"] == "tool" and call is not None:
                # the name a policy writes to repeat the call, as parse_react reads it
                # back: 54 ToolBench names carry a ToolLLaMA artifact,
                # 'Call the function "f".\n\nAction: f'
                args = call.get("arguments") or {}
                parsed = parse_react(render_action(None, call["name"], args))
                name = call["name"]
                if isinstance(parsed, Action):
                    name = parsed.name
                self.entries.setdefault(cache_key(name, args), []).append(tool_result_text(m))
                call = None

    def lookup(self, name: str, arguments) -> str | None:
        """The next response to this call (serve), or None when the gold dialog never made it."""
        return self.serve(cache_key(name, arguments))

    def serve(self, key) -> str | None:
        """The gold dialog's next response under `key`, the last one again once all are
        served; None for a key it never made."""
        responses = self.entries.get(key)
        if not responses:
            return None
        n = self.served.get(key, 0)         # this key's responses served so far
        self.served[key] = n + 1
        # the next one, then the last again
        return responses[min(n, len(responses) - 1)]


class ReplayEpisode(Episode):
    """A released episode: its task, tools and files, a call answered from its gold dialog, the
    score None when skipped (skip_reason), 0 without a final answer, else answer_score()."""

    def __init__(self, key: str, record: dict):
        # as released: no files, no tools
        self.task = record["dialogs"][0]["content"]
        super().__init__(key, self.task, record["tools"], record["files"])
        self.cache = ReplayCache(record["dialogs"])
        self.gt_answer = record["gt_answer"]

    def call_tool(self, name: str, arguments: dict) -> str:
        """The gold dialog's response to the call, or simulator_miss's line."""
        hit = self.cache.lookup(name, arguments)
        return hit if hit is not None else simulator_miss(name, arguments)

    def score(self, *match) -> float | None:
        """None when skipped, 0.0 out of turns without an answer, else answer_score(*match)."""
        if self.skip_reason is not None:
            return None
        if self.final_answer is None:       # out of turns without an answer
            return 0.0
        return self.answer_score(*match)


# ---- GTA: answers matched against the reference's aliases --------------------------------------
# A reference answer is {whitelist: [[alias, ...], ...], blacklist: [[alias, ...], ...] |
# null}. The paper trains on strict matching (an alias must stand alone in the answer)
# and evaluates with loose matching (a substring), and so does make_env. Episodes answer
# matching cannot score are skipped and counted (gta_skip_reason).
GTA_UNAVAILABLE = ("FastOCR", "FastCalculator", "ImageDescriptor", "WebSearch")
UNAVAILABLE_MESSAGE = "This tool is not available now. Consider other tools."
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
# GTA's final reply when the answer is an image
GTA_IMAGE_REPLY = "The image is saved."


def gta_skip_reason(gt, dialog: list[dict] = ()) -> str | None:
    """Why answer matching cannot score an episode, or None: a reference list (it needs
    an embedding model), no answer, an image answer, or a gold dialog ending on an image
    tool's result, bare or then "The image is saved." (test 211), whose whitelist matches
    no text."""
    if isinstance(gt, list):
        return "reference_list"
    if not isinstance(gt, dict) or not gt.get("whitelist"):
        return "no_answer"
    if any(a.strip().lower().endswith(IMAGE_SUFFIXES) for g in gt["whitelist"] for a in g):
        return "image_answer"
    tail = list(dialog[-2:])
    if tail and tail[-1]["role"] == "assistant" and not tail[-1].get("tool_calls") \
            and (tail[-1].get("content") or "").strip() == GTA_IMAGE_REPLY:
        tail = tail[:-1]
    if tail and tail[-1]["role"] == "tool" and isinstance(tail[-1]["content"], dict) \
            and tail[-1]["content"].get("type") == "image":
        return "image_answer"
    return None


def gta_match(prediction: str, gt: dict, mode: str = "strict") -> float:
    """1.0 iff every whitelist group has an alias in the prediction and no blacklist
    alias is in it (GTA's `iscorrect`), case-insensitive. strict: the alias touches no
    letter, digit or _ (GTA's \\b never matches an alias starting "-" or "$"); loose: a
    substring, spaces collapsed."""
    # what a loose alias is looked for in
    text = " ".join(prediction.split()).lower()
    found = {"strict": lambda a: re.search(r"(?<!\w)" + re.escape(a.strip()) + r"(?!\w)",
                                           prediction, re.IGNORECASE) is not None,
             "loose": lambda a: " ".join(a.split()).lower() in text}.get(mode)
    if found is None:
        raise ValueError(f"unknown match mode {mode!r}: choose strict or loose")
    right = all(any(found(a) for a in group) for group in gt["whitelist"]) and \
        not any(found(a) for group in gt.get("blacklist") or [] for a in group)
    return float(right)


class GTAEpisode(ReplayEpisode):
    """A released GTA episode: answers matched against the reference's aliases
    (gta_match, in `match` mode), skipped when they cannot be (gta_skip_reason); a
    Calculator miss computed, the tools GTA cannot run answered UNAVAILABLE_MESSAGE."""

    def __init__(self, key: str, record: dict, match: str = "strict"):
        super().__init__(key, record)
        self.match = match
        self.skip_reason = gta_skip_reason(self.gt_answer, record["dialogs"])

    def call_tool(self, name: str, arguments: dict) -> str:
        """The gold dialog's response; a miss computed (Calculator) or answered as a miss."""
        if name in GTA_UNAVAILABLE:
            return UNAVAILABLE_MESSAGE
        hit = self.cache.lookup(name, arguments)
        if hit is not None:
            return hit
        if name == "Calculator":        # a miss is computed
            expression = arguments.get("expression")
            if isinstance(expression, str):
                return calculate(expression)
            return 'Error: Calculator takes {"expression": "<arithmetic expression>"}'
        return simulator_miss(name, arguments)

    def answer_score(self, match: str | None = None) -> float:
        """`match` overrides the env's mode (the paper trains on strict, evaluates loose)."""
        return gta_match(self.final_answer, self.gt_answer, match or self.match)


class GTAEnv(Env):
    """A released GTA split, answers matched `match`: "strict" or "loose"."""

    def __init__(self, split: str = "test", data_dir=None, match: str = "strict"):
        super().__init__(load_episodes(episode_file("gta", split, data_dir)))
        self.match = match

    def _new_episode(self, key: str, record: dict) -> GTAEpisode:
        return GTAEpisode(key, record, self.match)


# the lab's table adds toolbench (LLM-judged, no training split)
REPLAYS = {"gta": GTAEnv}


def make(family: str, split: str = "test", data_dir=None, replays=REPLAYS, **kw) -> Env:
    """A released split of a family of `replays`: make("gta", split="test", match="loose")."""
    if family not in replays:
        raise DataError(f"unknown environment {family!r}: choose {', '.join(replays)} (toolbench "
                        "is the lab's: python -m lab.train --env toolbench)")
    return replays[family](split, data_dir, **kw)


def make_env(args, split: str, evaluation: bool = False, worlds=WORLDS, replays=REPLAYS):
    """The `--env` environment of one split: a built-in world of `worlds`, or a released
    family of `replays` (the lab passes its tables, which add shop-long and toolbench).
    GTA answers are matched as the paper does: strictly for the training reward, loosely
    in evaluation."""
    if args.env in worlds:
        return ShopEnv(split, world=worlds[args.env])
    kw = {}
    if args.env == "gta":
        kw["match"] = "strict"
        if evaluation:
            kw["match"] = "loose"
    return make(args.env, split, args.data_dir, replays, **kw)


def scorable(env) -> list[int]:
    """Indices of the episodes that can be scored (GTA skips some, METHOD.md §10; shop none)."""
    if isinstance(env, ShopEnv):
        return list(range(len(env)))
    return [i for i in range(len(env)) if env.episode(i).skip_reason is None]


def eval_splits(args, train_env, train_pool, worlds=WORLDS,
                replays=REPLAYS) -> tuple[dict, list[int]]:
    """{"val": (env, pool), "test": (env, pool)} and the training pool left: a built-in world
    has a validation split, a replay sets aside its last --val-episodes training episodes."""
    test = make_env(args, "test", True, worlds, replays)
    if args.env in worlds:
        val = make_env(args, "val", True, worlds, replays)
        return {"val": (val, scorable(val)), "test": (test, scorable(test))}, train_pool
    # k episodes held out: --val-episodes, else a tenth of the pool (at least 1); never
    # more than half the pool
    k = min(args.val_episodes or max(1, len(train_pool) // 10), len(train_pool) // 2)
    val = make_env(args, "train", True, worlds, replays)
    return ({"val": (val, train_pool[len(train_pool) - k:]), "test": (test, scorable(test))},
            train_pool[:len(train_pool) - k])


# ==== Released data (METHOD.md §1): the episode files, downloaded and validated =================
# The authors' files are read at a pinned commit, fetched when absent, and every record
# is checked on load: a bad one is a DataError naming the file, the record and what is
# wrong, before any work.
RELEASE_REPO = "wonjoong-kim/PAIR"
# the commit the splits were taken at
RELEASE_REF = "03e41ad6e5ce69b288a2cb14ac541b088ea1d3d9"
RELEASE_URL = "https://raw.githubusercontent.com/{repo}/{ref}/data/{family}/{name}"
# what the core reads; the lab's lab/worlds/released.py fetches the rest
RELEASE_FILES = {"gta": ["clean_train.json", "clean_test.json"],
                 # no train split released (METHOD.md §1)
                 "toolbench": ["clean_test.json"]}


class DataError(ValueError):
    """Missing or malformed released data; the message names the file and the record."""


def default_data_dir() -> Path:
    """$PAIR_DATA, else data/ under the project's cache root."""
    return Path(os.environ.get("PAIR_DATA") or model.cache_root() / "data")


def episode_file(family: str, split: str, data_dir: str | Path | None) -> Path:
    """data_dir/family/clean_{split}.json, downloaded with the family's other files if missing."""
    name = f"clean_{split}.json"
    path = Path(data_dir or default_data_dir()) / family / name
    if path.is_file():
        return path
    if name not in RELEASE_FILES[family]:       # a split the authors did not release
        raise DataError(f"{family} has no released '{split}' split (released: "
                        f"{', '.join(RELEASE_FILES[family])}) and {path} is missing: `python "
                        f"-m lab.data split-episodes {family} --out OUT/{family}` writes one from "
                        "its test files (then --data-dir OUT)")
    for released in RELEASE_FILES[family]:
        fetch(family, released, path.parent, check_episode_file)
    return path


def fetch(family: str, name: str, folder: Path, check, ref: str = RELEASE_REF,
          force: bool = False) -> None:
    """One released file to folder/name, written only once check(data, url) accepts it: a
    partial or wrong download never lands on disk."""
    if (folder / name).exists() and not force:
        return
    url = RELEASE_URL.format(repo=RELEASE_REPO, ref=ref, family=family, name=name)
    try:
        r = requests.get(url, timeout=300)
    except requests.RequestException as e:
        raise DataError(f"cannot download {url}: {e}") from e
    if r.status_code != 200:
        raise DataError(f"cannot download {url}: HTTP {r.status_code}")
    # every record, before anything is written
    check(read_data_json(url, r.content), url)
    model.write_atomic(folder / name, r.content)


def read_data_json(where: str | Path, raw: bytes | None = None) -> object:
    """The JSON of released data, `raw` or else the file `where`; bad input is a DataError naming
    `where` (model.read_json is a checkpoint's, whose errors are CheckpointErrors)."""
    if raw is None:
        if not Path(where).is_file():
            raise DataError(f"{where}: no such file")
        raw = Path(where).read_bytes()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise DataError(f"{where}: not valid JSON ({type(e).__name__}: {e})") from None


def load_episodes(path: str | Path) -> dict[str, dict]:
    """An episode file: {episode id: record}, every record validated (METHOD.md §1)."""
    data = read_data_json(Path(path))
    check_episode_file(data, Path(path))
    return data


def require(ok, where, message: str) -> None:
    """The checks' one failure: DataError("<file>: record <id>[: dialogs[i]]: <what is wrong>")."""
    if not ok:
        raise DataError(f"{where}: {message}")


def _aliases(groups) -> bool:
    """[[alias, ...], ...] with no empty group or alias: either would match every answer."""
    return isinstance(groups, list) and all(isinstance(g, list) and g and all(
        isinstance(a, str) and a.strip() for a in g) for g in groups)


def check_episode_file(data, path) -> None:
    """Every record of an episode file: an object holding a dialog (check_dialog), tools and files
    that render as the policy will read them, and a reference answer of a known shape."""
    require(isinstance(data, dict), path, "an episode file is a JSON object keyed by episode id")
    for rid, rec in data.items():
        where = f"{path}: record {rid}"         # every message names the record
        require(isinstance(rec, dict), where, "not an object")
        for key in ("dialogs", "tools", "files", "gt_answer"):
            require(key in rec, where, f"missing '{key}'")
        check_dialog(rec["dialogs"], where)
        # rendered as the first user message will be, then dropped
        try:
            tool_instructions(rec["tools"]) + render_task("", rec["files"])
        except (AttributeError, KeyError, TypeError) as e:
            raise DataError(f"{where}: its tools or files do not render ({type(e).__name__}: "
                            f"{e})") from None
        gt = rec["gt_answer"]
        require(gt is None or (isinstance(gt, list) and all(isinstance(a, str) for a in gt)) or (
            isinstance(gt, dict) and _aliases(gt.get("whitelist")) and
            (gt.get("blacklist") is None or _aliases(gt["blacklist"]))), where,
            "'gt_answer' must be null, a list of reference strings, or {whitelist: [[str]], "
            "blacklist: [[str]] | null} (no empty group or alias)")


def check_dialog(dialog, where) -> None:
    """The user's task first, text where text is rendered, at most one tool call per
    assistant turn (METHOD.md §2) with a name and an arguments object, each tool result
    after a call."""
    require(isinstance(dialog, list) and dialog, where, "'dialogs' must be a non-empty list")
    for i, m in enumerate(dialog):
        at = f"{where}: dialogs[{i}]"           # ... and the message
        role = None
        if isinstance(m, dict):
            role = m.get("role")
        require(role in ("user", "assistant", "tool") and (i > 0 or role == "user"), at,
                f"role {role!r}: a dialog is the user's task, then user, assistant, tool messages")
        calls = m.get("tool_calls")
        if role == "tool":
            require(dialog[i - 1].get("role") == "assistant" and dialog[i - 1].get("tool_calls"),
                    at, "a tool result must follow an assistant tool call")
        elif role == "user" or not calls:
            require(isinstance(m.get("content"), str), at, f"a {role} turn without a tool call "
                    "needs text content")
        else:
            require(isinstance(calls, list) and len(calls) == 1, at,
                    "at most one tool call per assistant turn (METHOD.md §2)")
            fn = None
            if isinstance(calls[0], dict):
                fn = calls[0].get("function")
            require(isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"] and
                    isinstance(fn.get("arguments"), dict), at,
                    "tool call arguments must be a JSON object, under a function name")


# ==== The Calculator tool (GTA's and shop's): an AST whitelist, never eval ======================
# A policy under RL writes whatever earns reward, so an expression is parsed with `ast`
# and only numbers, arithmetic, parentheses and the math functions and constants of the
# tables below are evaluated: nothing else can run. Every operation is bounded before it
# runs (an integer result of at most MAX_INT_BITS, factorial's argument and round's
# digits at most MAX_ARGUMENT), so no expression of at most MAX_EXPRESSION_CHARS
# characters runs long. Every value is a finite number: a float past 1.8e308 (a literal
# such as 1e309, or a result) is refused, not answered inf or nan. A refusal is a
# ValueError; calculate answers any error as "Error: <what is wrong>" for the agent.
MAX_EXPRESSION_CHARS = 1000
# ~1200 digits: bounds the work of *, ** and str() on integers
MAX_INT_BITS = 4000
MAX_ARGUMENT = 1000          # of factorial, and of round's digits (10 ** |n| is built)


def _whole(x, fn: str, over: str = "argument too large") -> int:
    """An integer argument (an integral float counts) of at most MAX_ARGUMENT in size."""
    # round(2.675, 2.0) rounds to 2 digits
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    if not isinstance(x, int):
        raise ValueError(f"{fn}() needs an integer")
    if abs(x) > MAX_ARGUMENT:
        raise ValueError(f"{fn}() {over} (limit {MAX_ARGUMENT})")
    return x


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
              ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCTIONS = {name: getattr(math, name) for name in (      # math's functions by name
    "sqrt cbrt exp log log10 log2 log1p sin cos tan asin acos atan atan2 sinh cosh tanh degrees "
    "radians floor ceil trunc fabs hypot gcd isqrt").split()}
_FUNCTIONS.update(abs=abs, min=min, max=max, int=int, float=float, pow=operator.pow,
                  round=lambda x, n=None: round(x) if n is None else round(x, _whole(
                      # round and factorial: arguments bounded
                      n, "round", "digits out of range")),
                  factorial=lambda n: math.factorial(_whole(n, "factorial")))
# no inf, no nan: numbers only
_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}
_TOO_LARGE = "the result is too large"


def _too_large(op, xs: list) -> bool:
    """Would op(*xs) build an integer over MAX_INT_BITS? Decided before the work it
    bounds: a * b has at most bits(a) + bits(b) bits, a ** b about b log2 |a|."""
    if len(xs) != 2 or not all(isinstance(x, int) for x in xs):
        return False
    a, b = xs
    if op is operator.mul:
        return a.bit_length() + b.bit_length() > MAX_INT_BITS + 1
    return op is operator.pow and b > 0 and abs(a) > 1 and b * math.log2(abs(a)) > MAX_INT_BITS


def _math_name(node) -> str:
    """The name `sqrt` or `math.sqrt` refers to; no other attribute exists."""
    name = ast.unparse(node).removeprefix("math.")
    if "." in name:
        raise ValueError("attribute access is not allowed")
    return name


def _evaluate(node):
    """The value of a whitelisted node, an int or a float; a refusal is a ValueError."""
    if isinstance(node, ast.Constant):
        # True, 'a' and 1j are not numbers here
        if type(node.value) not in (int, float):
            raise ValueError(f"unsupported literal {node.value!r}")
        # 1e309 reads inf
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("a number in the expression is too large")
        return node.value
    if isinstance(node, (ast.BinOp, ast.UnaryOp)) and type(node.op) in _OPERATORS:
        op = _OPERATORS[type(node.op)]          # + - * / // % ** and the signs
        if isinstance(node, ast.BinOp):
            args = [node.left, node.right]
        else:
            args = [node.operand]
    elif isinstance(node, (ast.Name, ast.Attribute)):
        name = _math_name(node)
        if name not in _CONSTANTS:
            raise ValueError(f"unknown name '{name}'")
        return _CONSTANTS[name]
    elif isinstance(node, ast.Call):
        name = _math_name(node.func)
        if name not in _FUNCTIONS:
            raise ValueError(f"unknown function '{name}'")
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise ValueError(f"{name}() takes plain positional arguments only")
        op = _FUNCTIONS[name]
        args = node.args
    else:                               # comparisons, lists, lambdas, subscripts, ...
        raise ValueError(f"unsupported syntax ({type(node).__name__})")
    xs = [_evaluate(a) for a in args]   # the operands' values, left to right
    if _too_large(op, xs):
        raise ValueError(_TOO_LARGE)
    # an OverflowError (10.0 ** 400, exp(1000)) is answered in calculate
    value = op(*xs)
    # complex: (-8) ** (1/3)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("the result is not a real number")
    # factorial(1000), or a sum
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError(_TOO_LARGE)
    # 1e308 * 10 overflows to inf without an error (NaN needs an infinite operand, which
    # is refused before)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(_TOO_LARGE)
    return value


def calculate(expression: str) -> str:
    """One arithmetic expression (numbers, + - * / // % **, signs, parentheses, math
    functions and constants as `sqrt(2)` or `math.sqrt(2)`) as Python prints it, a finite
    number, or "Error: ..." saying what is wrong. Never raises."""
    try:
        if len(expression) > MAX_EXPRESSION_CHARS:
            raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
        # one expression, no statement
        body = ast.parse(expression.strip(), mode="eval").body
        if isinstance(body, ast.Tuple):         # "29,000 + 1" parses as (29, 0 + 1)
            raise ValueError("a comma separates values: write numbers without thousands "
                             "separators")
        # as Python prints it: 0.1 + 0.2 -> 0.30000000000000004
        return str(_evaluate(body))
    except SyntaxError as e:
        return f"Error: invalid expression ({e.msg})"
    except RecursionError:
        return "Error: expression nested too deeply"
    except OverflowError:
        # a float past 1.8e308: 10.0 ** 400, exp(1000), float(10 ** 400)
        return f"Error: {_TOO_LARGE}"
    except Exception as e:
        # a refusal, ZeroDivisionError, math domain errors, bad arity ...
        return f"Error: {e}"
