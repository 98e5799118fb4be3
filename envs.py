"""Tool-use environments for PAIR: the GTA and ToolBench replay benchmarks, their scorers, and the
one text format every model sees (METHOD.md §1, §2, §10).

An environment hands out episodes. An episode holds the chat so far (METHOD.md §2), takes the
policy's next assistant turn with `step(text)`, answers with the tool's observation, and is done
at a `Final Answer:` or after MAX_TURNS = 10 assistant turns (then it scores 0):

    env = make("gta", split="test", data_dir=...)
    ep = env.episode(0)
    while not ep.done:
        ep.step(policy(ep.messages))
    ep.score()          # in [0, 1], or None with ep.skip_reason

The rendering functions (tool_instructions, render_action, render_final, dialog_to_messages) are
shared by offline probe data and online rollouts, so a probe sees the same text in both.

The built-in world, `shop` (episodes drawn from a seed, exact step labels, `make-data`), is in
shop.py (`shop.ShopEnv`), one floor up: it is built on the classes here.

Replay (paper Appendix eval): a tool call is answered from a cache built from the episode's gold
dialog, keyed by (tool name, json.dumps(arguments, sort_keys=True)). Choices made here where the
paper and the release are silent or disagree (each is marked where it is implemented):
- GTA answer matching. Each whitelist group is a list of aliases; an answer is correct iff every
  group has an alias in it and no blacklist alias is in it. This is GTA's reference `iscorrect`.
  The paper's wording ("at least one whitelist group fully matched") describes the release's loose
  matcher, which reads the aliases of a group as all required: under it the gold answers of
  GTA test episodes 28 ("24185" for ["24185", "24,185"]) and train 171, 207 would score 0.
  strict mode: an alias must stand alone (no letter/digit/_ touching either end) - the reference
  regex uses \\b, which can never match an alias that starts with "-" or "$" ("-2", "$3120");
  loose mode: case-insensitive substring after collapsing whitespace.
- A call repeated in the gold dialog with different responses (ToolBench retries) replays its
  responses in order; later repeats get the last one. The release kept only the first.
- GTA skip reasons: reference_list, no_answer, image_answer - the last also when the gold dialog
  answers with an image (gta_skip_reason).
- ToolBench history cap: see ToolBenchEpisode.
- The task shown to the model lists the episode's attached files (GTA image paths): without them
  no GTA tool call can be written. The release did the same in its rollout prompt.
- Released assistant turns with text in `content` beside a tool call, or under `explanation`:
  that text is the thought (assistant_parts). A gold tool name polluted by a ToolLLaMA parsing
  artifact is replayed under the name a policy would write (written_tool_name).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import requests

import calculator
import chat_api
import common

MAX_TURNS = 10                      # assistant turns per episode (paper Appendix eval)
OBSERVATION_CHARS = 1000            # METHOD.md §2: longer tool results are cut and get "..."
CONTAMINATION_TYPES = ("reasoning_error", "tool_misuse", "observation_misinterpretation",
                       "stale_memory")


# ---------------------------------------------------------------------------------------------
# METHOD.md §2: the canonical text of tools, steps and observations
# ---------------------------------------------------------------------------------------------

def tool_instructions(tools: list[dict]) -> str:
    """The tool list and the reply format, appended to the task in the first user message."""
    lines = ["You can use the following tools:"]
    for tool in tools:
        desc = " ".join((tool.get("description") or "").split())
        lines.append(f"- {tool['name']}: {desc}" if desc else f"- {tool['name']}")
        for inp in tool.get("inputs") or []:
            kind = inp.get("type") or "text"
            kind += ", optional" if inp.get("optional") else ""
            note = " ".join((inp.get("description") or "").split())
            lines.append(f"    {inp['name']} ({kind})" + (f": {note}" if note else ""))
    if not tools:
        lines.append("(none)")
    lines += [
        "",
        "Solve the task step by step. Each reply is one step, in exactly one of two formats.",
        "To call one tool:",
        "Thought: <your reasoning about what to do next>",
        "Action: <the tool name, exactly as listed above>",
        "Action Input: <the tool's inputs as one JSON object keyed by input name>",
        'Then stop: the tool\'s result comes back to you as "Observation: <result>".',
        "To answer, once you know the answer:",
        "Thought: <your reasoning>",
        "Final Answer: <the answer only>",
    ]
    return "\n".join(lines)


def render_action(thought: str | None, name: str, arguments: dict) -> str:
    text = f"Action: {name}\nAction Input: {json.dumps(arguments, ensure_ascii=False)}"
    return f"Thought: {thought}\n{text}" if thought else text


def render_final(thought: str | None, answer: str) -> str:
    return f"Thought: {thought}\nFinal Answer: {answer}" if thought else f"Final Answer: {answer}"


def render_observation(text: str) -> str:
    """A tool result as the content of a user message (METHOD.md §2)."""
    text = common.without_surrogates(text)
    if len(text) > OBSERVATION_CHARS:
        text = text[:OBSERVATION_CHARS] + "..."
    return f"Observation: {text}"


def render_task(task: str, files: list[dict] | tuple = ()) -> str:
    """The task text, with the files it refers to (GTA tools take these paths as inputs)."""
    task = task.strip()
    paths = [f"- {f['path']} ({f.get('type') or 'file'})" for f in files if f.get("path")]
    return task + "\n\nFiles:\n" + "\n".join(paths) if paths else task


def tool_result_text(message: dict) -> str:
    """The text of a released `tool` message: {type, content} or a plain string."""
    content = message.get("content")
    if isinstance(content, dict):
        content = content.get("content")
    if isinstance(content, str):
        return content
    return json.dumps(content, ensure_ascii=False)


def assistant_parts(message: dict) -> tuple[str | None, dict | None, str | None]:
    """(thought, tool call {name, arguments} or None, final content) of a released assistant turn.

    Three released turns carry text in `content` next to a tool call and no `thought`: that text
    precedes the call (as in Qwen's own tool template) and reads as the step's reasoning, so it
    is the thought. One contaminated turn holds its rewritten thought under `explanation` (the
    contamination LLM's key): it is the thought too, otherwise that contamination is invisible.
    """
    calls = message.get("tool_calls") or []
    call = calls[0]["function"] if calls else None
    parts = [message.get("thought"), message.get("explanation")]
    if call is not None:
        parts.append(message.get("content"))
    thought = "\n\n".join(p.strip() for p in parts if isinstance(p, str) and p.strip()) or None
    final = None if call is not None else (message.get("content") or "").strip()
    return thought, call, final


def render_assistant(message: dict) -> str:
    thought, call, final = assistant_parts(message)
    if call is not None:
        return render_action(thought, call["name"], call.get("arguments") or {})
    return render_final(thought, final)


def dialog_to_messages(dialog: list[dict], tools: list[dict],
                       files: list[dict] | tuple = ()) -> list[dict]:
    """A released dialog as chat messages {role, content} in METHOD.md §2 text form.

    The first user message becomes task (+ files) + blank line + tool instructions; assistant
    turns become Thought/Action/Action Input or Thought/Final Answer text; tool results become
    user `Observation:` messages; consecutive messages of one role are merged with a blank line.
    """
    messages: list[dict] = []
    for i, m in enumerate(dialog):
        if m["role"] == "user":
            role, content = "user", m["content"]
            if i == 0:
                content = render_task(content, files) + "\n\n" + tool_instructions(tools)
        elif m["role"] == "assistant":
            role, content = "assistant", render_assistant(m)
        else:  # tool
            role, content = "user", render_observation(tool_result_text(m))
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + content
        else:
            messages.append({"role": role, "content": content})
    return messages


def task_messages(task: str, tools: list[dict], files: list[dict] | tuple = ()) -> list[dict]:
    """The chat an episode starts from, as the policy sees it: one user message, the task and
    its files, then the tool list and the reply format."""
    return dialog_to_messages([{"role": "user", "content": task}], tools, files)


def record_messages(record: dict) -> list[dict]:
    """Messages of an episode record, or of a matched record returned by load_matched."""
    return dialog_to_messages(record["dialogs"], record["tools"], record.get("files") or ())


# ---------------------------------------------------------------------------------------------
# ReAct parser: one assistant reply -> a tool call, a final answer, or what was wrong with it
# ---------------------------------------------------------------------------------------------

@dataclass
class Action:
    thought: str | None
    name: str
    arguments: dict


@dataclass
class Final:
    thought: str | None
    answer: str


@dataclass
class ParseError:
    message: str        # written for the agent: it becomes the observation


# A marker is a keyword at the start of a line; "Action Input" must be tried before "Action".
_MARKER = re.compile(r"^[ \t]*(thought|action[ \t]*input|action|final[ \t]*answer|observation)"
                     r"[ \t]*:", re.IGNORECASE | re.MULTILINE)
_FORMAT_HINT = ("Reply with 'Thought:', 'Action:' and 'Action Input:' lines to call a tool, or "
                "with 'Thought:' and 'Final Answer:' lines to answer.")


MAX_NESTING = 64             # of an Action Input's objects and lists


def _nesting(value) -> int:
    """How deep lists and objects nest in a parsed JSON value (iteratively: no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def parse_react(text: str) -> Action | Final | ParseError:
    """Parse the first step of a reply. Never raises.

    The step is the first `Action:` marker whose next marker is `Action Input:`, or the first
    `Final Answer:`, whichever comes first: a thought may itself contain a line starting with
    "Action:" (ToolBench's gold thoughts do), and anything after the step (an invented
    `Observation:`, say) is ignored. The tool's name is the text between the two markers,
    stripped (a name over several lines names no tool there is, and the tool call misses). The
    Action Input is the first JSON value after its marker (an opening ``` fence is skipped), an
    object nested at most MAX_NESTING deep.
    """
    if not isinstance(text, str):
        return ParseError(f"The reply is not text. {_FORMAT_HINT}")
    marks = [(re.sub(r"[ \t]+", " ", m.group(1).lower()), m.start(), m.end())
             for m in _MARKER.finditer(text)]
    head = next((k for k, mk in enumerate(marks) if mk[0] == "final answer" or
                 (mk[0] == "action" and k + 1 < len(marks) and
                  marks[k + 1][0] == "action input")), None)
    if head is None:
        lone = next((mk for mk in marks if mk[0] == "action"), None)
        if lone is None:
            return ParseError(f"No 'Action:' or 'Final Answer:' line found. {_FORMAT_HINT}")
        line_end = text.find("\n", lone[2])
        name = text[lone[2]:line_end if line_end >= 0 else len(text)].strip()
        return ParseError(f"'Action: {name[:100]}' must be followed by an 'Action Input:' line "
                          "with the tool's inputs as a JSON object.")
    kind, start, end = marks[head]
    thought_at = next((mk[2] for mk in marks[:head] if mk[0] == "thought"), 0)
    thought = text[thought_at:start].strip() or None

    if kind == "final answer":
        after = marks[head + 1][1] if head + 1 < len(marks) else len(text)
        answer = text[end:after].strip()
        if not answer:
            return ParseError("'Final Answer:' is empty: write the answer after it.")
        return Final(thought, answer)

    name = text[end:marks[head + 1][1]].strip().strip("`'\"*").strip()
    if not name:
        return ParseError(f"'Action:' names no tool. {_FORMAT_HINT}")
    raw = text[marks[head + 1][2]:].lstrip()
    if raw.startswith("```"):
        raw = re.sub(r"^```[A-Za-z]*", "", raw).lstrip()
    if not raw:
        return ParseError("'Action Input:' is empty: write the inputs as a JSON object "
                          "(use {} for a tool without inputs).")
    try:
        arguments, _ = json.JSONDecoder().raw_decode(raw)
    except json.JSONDecodeError as e:
        return ParseError(f"Invalid JSON in Action Input: {e.msg} (line {e.lineno}, column "
                          f"{e.colno}). Write the inputs as one JSON object, for example "
                          '{"name": "value"}.')
    except RecursionError:
        return ParseError("Invalid JSON in Action Input: the value is too deeply nested.")
    except ValueError as e:         # e.g. an integer longer than Python converts (4300 digits)
        return ParseError(f"Invalid JSON in Action Input: {str(e)[:200]}")
    if not isinstance(arguments, dict):
        return ParseError(f"Action Input must be a JSON object {{...}}, not a JSON "
                          f"{type(arguments).__name__}.")
    if _nesting(arguments) > MAX_NESTING:
        # json.dumps (the tool cache's key, the check below) recurses and would overflow
        return ParseError(f"Invalid JSON in Action Input: nested deeper than {MAX_NESTING} "
                          "levels.")
    if common.holds_lone_surrogate(arguments):
        # a tool would echo it back, and no tokenizer can encode the observation
        return ParseError("Action Input holds a \\ud800-\\udfff escape that is not half of a "
                          "surrogate pair: write the character itself.")
    return Action(thought, name, arguments)


# ---------------------------------------------------------------------------------------------
# Episodes and environments
# ---------------------------------------------------------------------------------------------

@dataclass
class StepResult:
    observation: str | None     # content of the user message appended, None when done
    done: bool
    rewritten_from: int | None = None   # first message rewritten in place (ToolBench history
    #                                     cap): a caller holding a KV cache re-renders from it


class Episode:
    """One task being played: the chat so far and the rules that answer each step.

    Subclasses implement call_tool (the observation text for a parsed tool call) and score.
    """
    max_turns = MAX_TURNS               # a world with longer tasks allows more

    def __init__(self, id: str, task: str, tools: list[dict], files: list[dict] | tuple = ()):
        self.id = str(id)
        self.tools = tools
        self.messages = task_messages(task, tools, files)
        self.steps: list[Action | Final | ParseError] = []   # one per assistant turn
        self.final_answer: str | None = None
        self.done = False
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
            self.done = True
            return StepResult(None, True)
        if len(self.steps) >= self.max_turns:   # out of turns without an answer: scores 0
            self.done = True
            return StepResult(None, True)
        if isinstance(parsed, Action):
            text = self.call_tool(parsed.name, parsed.arguments)
        else:
            text = f"Invalid reply: {parsed.message}"
        observation = render_observation(text)
        self.messages.append({"role": "user", "content": observation})
        return StepResult(observation, False, self._after_observation())

    def call_tool(self, name: str, arguments: dict) -> str:
        raise NotImplementedError

    def _after_observation(self) -> int | None:
        return None

    def score(self) -> float | None:
        raise NotImplementedError

    def labels(self) -> list[bool] | None:
        return None     # exact step labels exist only in the built-in world


class Env:
    """A split of episodes: env.episode(i) is a fresh Episode (an index or an episode id)."""
    MAX_TURNS = MAX_TURNS

    def __init__(self, records: dict[str, dict]):
        self.records = records
        self.ids = list(records)

    def __len__(self) -> int:
        return len(self.ids)

    def episode(self, i: int | str) -> Episode:
        key = self.ids[i] if isinstance(i, int) else str(i)
        if key not in self.records:
            raise KeyError(f"no episode {key!r} in this split")
        return self._new_episode(key, self.records[key])

    def _new_episode(self, key: str, record: dict) -> Episode:
        raise NotImplementedError


def play_gold(episode: Episode, dialog: list[dict]) -> list[tuple[str, str | None]]:
    """Step an episode through a gold dialog's assistant turns (METHOD.md §2 text).

    Returns (recorded observation, returned observation) for every gold tool call answered.
    """
    pairs = []
    for i, m in enumerate(dialog):
        if m["role"] != "assistant":
            continue
        result = episode.step(render_assistant(m))
        nxt = dialog[i + 1] if i + 1 < len(dialog) else None
        if nxt is not None and nxt["role"] == "tool":
            pairs.append((render_observation(tool_result_text(nxt)), result.observation))
        if result.done:
            break
    return pairs


# ---------------------------------------------------------------------------------------------
# Released data (METHOD.md §1): locations, download, validated loading
# ---------------------------------------------------------------------------------------------

RELEASE_REPO = "wonjoong-kim/PAIR"
RELEASE_REF = "03e41ad6e5ce69b288a2cb14ac541b088ea1d3d9"    # the commit the splits were taken at
RELEASE_URL = "https://raw.githubusercontent.com/{repo}/{ref}/data/{family}/{name}"
RELEASE_FILES = {
    "gta": [f"{kind}{part}_{split}.json" for kind in ("", "matched_")
            for part in ("clean", "contaminated") for split in ("train", "test")],
    # The ToolBench train splits are missing from the authors' repository (METHOD.md §1).
    "toolbench": [f"{kind}{part}_test.json" for kind in ("", "matched_")
                  for part in ("clean", "contaminated")],
}


class DataError(ValueError):
    pass


def default_data_dir() -> Path:
    return Path(os.environ.get("PAIR_DATA") or common.cache_root() / "data")



def download(family: str, data_dir: str | Path | None = None, ref: str = RELEASE_REF,
             force: bool = False) -> Path:
    """Fetch the released files of `family` into data_dir/family/; returns that folder.

    Each file is validated (every record) before it is written, so a partial or wrong download
    never lands on disk.
    """
    if family not in RELEASE_FILES:
        raise ValueError(f"unknown data family {family!r}: choose {', '.join(RELEASE_FILES)}")
    folder = Path(data_dir or default_data_dir()) / family
    for name in RELEASE_FILES[family]:
        dest = folder / name
        if dest.exists() and not force:
            continue
        url = RELEASE_URL.format(repo=RELEASE_REPO, ref=ref, family=family, name=name)
        print(f"downloading {url}", file=sys.stderr)
        try:
            r = requests.get(url, timeout=300)
        except requests.RequestException as e:
            raise DataError(f"cannot download {url}: {e}") from e
        if r.status_code != 200:
            raise DataError(f"cannot download {url}: HTTP {r.status_code}")
        data = _parse_json(r.content, url)
        if name.startswith("matched_"):
            _check_matched_file(data, url)
        else:
            _check_episode_file(data, url)
        common.write_atomic(dest, r.content)
    return folder


def _parse_json(raw: bytes | str, where) -> object:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        # RecursionError: a value nested deeper than Python's parser goes ('[' * 100000)
        raise DataError(f"{where}: not valid JSON ({type(e).__name__}: {e})") from None


def load_episodes(path: str | Path) -> dict[str, dict]:
    """An episode file: {episode id: record}, every record validated (METHOD.md §1)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    data = _parse_json(path.read_bytes(), path)
    _check_episode_file(data, path)
    return data


def load_matched(path: str | Path) -> list[dict]:
    """A matched file, every record validated, each given the `tools` and `files` of its episode
    (from the episode file of the same family: matched_clean_train -> clean_train.json)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    data = _parse_json(path.read_bytes(), path)
    _check_matched_file(data, path)
    if not path.name.startswith("matched_"):
        raise DataError(f"{path}: a matched file is named matched_<family>_<split>.json")
    episodes = load_episodes(path.with_name(path.name[len("matched_"):]))
    out = []
    for i, rec in enumerate(data):
        ep = episodes.get(rec["episode_id"])
        if ep is None:
            raise DataError(f"{path}: record {i} (episode {rec['episode_id']}): episode not "
                            f"found in {path.with_name(path.name[len('matched_'):])}")
        out.append({**rec, "tools": ep["tools"], "files": ep["files"]})
    return out


def matched_record(episode_id: str, turn_idx: int, label: bool, kind, indices: list[int],
                    prefix_type: str, dialog: list[dict], **extra) -> dict:
    """One record of a matched file, in the released key order."""
    return {"episode_id": episode_id, "turn_idx": turn_idx, "label": int(label),
            "contamination_type": kind,
            "has_contaminated_prefix": any(i < turn_idx for i in indices),
            "original_contaminated_turn_indices": list(indices), "prefix_type": prefix_type,
            **extra, "dialogs": dialog}


def _check_episode_file(data, path) -> None:
    if not isinstance(data, dict):
        raise DataError(f"{path}: an episode file is a JSON object keyed by episode id")
    for rid, rec in data.items():
        where = f"{path}: record {rid}"
        if not isinstance(rec, dict):
            raise DataError(f"{where}: not an object")
        for key in ("dialogs", "tools", "files", "gt_answer"):
            if key not in rec:
                raise DataError(f"{where}: missing '{key}'")
        _check_dialog(rec["dialogs"], where)
        _check_tools(rec["tools"], where)
        if not isinstance(rec["files"], list) or not all(isinstance(f, dict)
                                                         for f in rec["files"]):
            raise DataError(f"{where}: 'files' must be a list of objects")
        _check_gt_answer(rec["gt_answer"], where)
        _check_contamination(rec, where)


def _check_matched_file(data, path) -> None:
    if not isinstance(data, list):
        raise DataError(f"{path}: a matched file is a JSON list of records")
    for i, rec in enumerate(data):
        where = f"{path}: record {i}"
        if not isinstance(rec, dict):
            raise DataError(f"{where}: not an object")
        where += f" (episode {rec.get('episode_id')}, turn {rec.get('turn_idx')})"
        checks = {"episode_id": lambda v: isinstance(v, str),
                  "turn_idx": lambda v: type(v) is int,
                  "dialogs": lambda v: True,
                  "label": lambda v: type(v) is int and v in (0, 1),
                  "contamination_type": lambda v: v is None or v in CONTAMINATION_TYPES,
                  "has_contaminated_prefix": lambda v: isinstance(v, bool),
                  "original_contaminated_turn_indices":
                      lambda v: isinstance(v, list) and all(type(x) is int for x in v),
                  "prefix_type": lambda v: v in ("clean", "contaminated")}
        for key, ok in checks.items():
            if key not in rec:
                raise DataError(f"{where}: missing '{key}'")
            if not ok(rec[key]):
                raise DataError(f"{where}: bad '{key}': {rec[key]!r}")
        _check_dialog(rec["dialogs"], where)
        if rec["turn_idx"] != len(rec["dialogs"]) - 1 \
                or rec["dialogs"][-1]["role"] != "assistant":
            raise DataError(f"{where}: the dialog must end at turn_idx with the assistant "
                            "evaluation turn")


def _check_dialog(dialog, where) -> None:
    if not isinstance(dialog, list) or not dialog:
        raise DataError(f"{where}: 'dialogs' must be a non-empty list")
    for i, m in enumerate(dialog):
        at = f"{where}: dialogs[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{at}: not an object")
        role = m.get("role")
        if i == 0 and role != "user":
            raise DataError(f"{at}: the dialog must start with the user's task")
        if role == "user":
            if not isinstance(m.get("content"), str):
                raise DataError(f"{at}: user message without text content")
        elif role == "assistant":
            _check_assistant(m, at)
        elif role == "tool":
            prev = dialog[i - 1]
            if prev.get("role") != "assistant" or not prev.get("tool_calls"):
                raise DataError(f"{at}: a tool result must follow an assistant tool call")
            content = m.get("content")
            if isinstance(content, dict):
                content = content.get("content", None)
            if not isinstance(m.get("name"), str) or content is None:
                raise DataError(f"{at}: a tool message needs 'name' and 'content'")
        else:
            raise DataError(f"{at}: unknown role {role!r}")


def _check_assistant(m: dict, at: str) -> None:
    for key in ("thought", "content", "explanation"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise DataError(f"{at}: '{key}' must be a string")
    calls = m.get("tool_calls")
    if calls is None or calls == []:
        if m.get("content") is None:
            raise DataError(f"{at}: assistant message with neither tool_calls nor content")
        return
    if not isinstance(calls, list) or len(calls) > 1:
        raise DataError(f"{at}: at most one tool call per assistant turn (METHOD.md §2)")
    fn = calls[0].get("function") if isinstance(calls[0], dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise DataError(f"{at}: tool call without a function name")
    if not isinstance(fn.get("arguments"), dict):
        raise DataError(f"{at}: tool call arguments must be a JSON object")


def _check_tools(tools, where) -> None:
    if not isinstance(tools, list):
        raise DataError(f"{where}: 'tools' must be a list")
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise DataError(f"{where}: tools[{j}] needs a 'name'")
        inputs = t.get("inputs") or []
        if not isinstance(inputs, list) or not all(isinstance(x, dict) and
                                                   isinstance(x.get("name"), str)
                                                   for x in inputs):
            raise DataError(f"{where}: tools[{j}] ({t['name']}): 'inputs' must be a list of "
                            "objects with a 'name'")
        # the tool instructions render these as text
        texts = [("description", t.get("description"))] + [
            (f"inputs[{i}].{key}", x.get(key)) for i, x in enumerate(inputs)
            for key in ("type", "description")]
        for key, value in texts:
            if value is not None and not isinstance(value, str):
                raise DataError(f"{where}: tools[{j}] ({t['name']}): '{key}' must be a string")


def _check_gt_answer(gt, where) -> None:
    def phrase_groups(v):               # an empty group or alias would match every answer
        return isinstance(v, list) and all(isinstance(g, list) and g and
                                           all(isinstance(a, str) and a.strip() for a in g)
                                           for g in v)
    if gt is None or (isinstance(gt, list) and all(isinstance(a, str) for a in gt)):
        return
    if isinstance(gt, dict) and phrase_groups(gt.get("whitelist")) and \
            (gt.get("blacklist") is None or phrase_groups(gt["blacklist"])):
        return
    raise DataError(f"{where}: 'gt_answer' must be null, a list of reference strings, or "
                    "{whitelist: [[str]], blacklist: [[str]] | null} (no empty group or alias)")


def _check_contamination(rec, where) -> None:
    keys = ("contaminated_turn_indices", "contamination_types", "original_turn_contents")
    if not any(k in rec for k in keys):
        return
    if not all(isinstance(rec.get(k), list) for k in keys) or \
            len({len(rec[k]) for k in keys}) != 1:
        raise DataError(f"{where}: {', '.join(keys)} must be lists of one length")
    for idx, kind in zip(rec["contaminated_turn_indices"], rec["contamination_types"]):
        if type(idx) is not int or not 0 <= idx < len(rec["dialogs"]) or \
                rec["dialogs"][idx]["role"] != "assistant":
            raise DataError(f"{where}: contaminated turn index {idx!r} is not an assistant turn")
        if kind not in CONTAMINATION_TYPES:
            raise DataError(f"{where}: unknown contamination type {kind!r}")


def episode_file(family: str, split: str, data_dir: str | Path | None) -> Path:
    """data_dir/family/clean_{split}.json, downloaded first when it is missing (a split the
    authors did not release, such as ToolBench's train, is one `split-episodes` wrote)."""
    name = f"clean_{split}.json"
    path = Path(data_dir or default_data_dir()) / family / name
    if path.is_file():
        return path
    if name not in RELEASE_FILES[family]:
        raise DataError(f"{family} has no released '{split}' split (released: "
                        f"{', '.join(RELEASE_FILES[family])}) and {path} is missing: `python "
                        f"envs.py split-episodes {family} --out OUT/{family}` writes one from "
                        "its test files (then --data-dir OUT)")
    download(family, path.parent.parent)
    return path


# ---------------------------------------------------------------------------------------------
# Replay (METHOD.md §10): tool calls answered from the gold dialog
# ---------------------------------------------------------------------------------------------

def cache_key(name: str, arguments) -> tuple[str, str]:
    return name, json.dumps(arguments, sort_keys=True)


def simulator_miss(name: str, arguments) -> str:
    return (f"[Simulator] Tool '{name}' with args {json.dumps(arguments, ensure_ascii=False)} "
            "has no cached response.")


class ReplayCache:
    """(tool name, canonical args) -> the responses recorded for that call, in dialog order."""

    def __init__(self, dialog: list[dict]):
        self.entries: dict[tuple[str, str], list[str]] = {}
        self.served: dict[tuple[str, str], int] = {}
        call = None
        for m in dialog:
            if m["role"] == "assistant":
                _, call, _ = assistant_parts(m)
            elif m["role"] == "tool" and call is not None:
                key = cache_key(written_tool_name(call), call.get("arguments") or {})
                self.entries.setdefault(key, []).append(tool_result_text(m))
                call = None

    def lookup(self, name: str, arguments) -> str | None:
        return self._serve(cache_key(name, arguments))

    def nearest(self, name: str, arguments) -> str | None:
        """Fuzzy fallback: the same tool's entry whose argument tokens have the highest Jaccard
        overlap with this call's (lowercased word tokens of the canonical JSON, keys included);
        ties go to the entry recorded first."""
        tokens = _arg_tokens(cache_key(name, arguments)[1])
        best, best_sim = None, -1.0
        for key in self.entries:
            if key[0] != name:
                continue
            other = _arg_tokens(key[1])
            union = tokens | other
            sim = len(tokens & other) / len(union) if union else 1.0
            if sim > best_sim:
                best, best_sim = key, sim
        return self._serve(best) if best is not None else None

    def _serve(self, key) -> str | None:
        responses = self.entries.get(key)
        if not responses:
            return None
        n = self.served.get(key, 0)
        self.served[key] = n + 1
        return responses[min(n, len(responses) - 1)]


def written_tool_name(call: dict) -> str:
    """The tool name a policy writes to repeat a released call: what parse_react reads back
    from the call's METHOD.md §2 text. It differs from the stored name for 54 released ToolBench
    calls whose name carries a ToolLLaMA parsing artifact ('Call the function "f".\n\n\nAction:
    f'), which no policy could reproduce."""
    parsed = parse_react(render_action(None, call["name"], call.get("arguments") or {}))
    return parsed.name if isinstance(parsed, Action) else call["name"]


def _arg_tokens(canonical: str) -> set[str]:
    return set(re.findall(r"\w+", canonical.lower()))


# ---- GTA -------------------------------------------------------------------------------------

GTA_UNAVAILABLE = ("FastOCR", "FastCalculator", "ImageDescriptor", "WebSearch")
UNAVAILABLE_MESSAGE = "This tool is not available now. Consider other tools."
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


GTA_IMAGE_REPLY = "The image is saved."     # GTA's final reply when the answer is an image


def gta_skip_reason(gt, dialog: list[dict] = ()) -> str | None:
    """Why an episode cannot be scored by answer matching, or None (METHOD.md §10).

    image_answer also covers a gold dialog that answers with an image - it ends on an image tool
    result, bare or followed only by "The image is saved." (test episode 211: "circle it in the
    image") - so its whitelist cannot be matched against any text, not even the gold one.
    """
    if isinstance(gt, list):
        return "reference_list"     # needs a sentence-embedding model the project does not ship
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
    """1.0 iff every whitelist group has one of its aliases in the prediction and no blacklist
    alias is in it (GTA's reference rule; see the module docstring), else 0.0.

    strict: case-insensitive, the alias may not touch a letter, digit or _ on either side;
    loose: case-insensitive substring after collapsing whitespace.
    """
    if mode == "strict":
        def found(alias):
            return re.search(r"(?<!\w)" + re.escape(alias.strip()) + r"(?!\w)", prediction,
                             re.IGNORECASE) is not None
    elif mode == "loose":
        text = " ".join(prediction.split()).lower()

        def found(alias):
            return " ".join(alias.split()).lower() in text
    else:
        raise ValueError(f"unknown match mode {mode!r}: choose strict or loose")
    if not all(any(found(a) for a in group) for group in gt["whitelist"]):
        return 0.0
    if any(found(a) for group in gt.get("blacklist") or [] for a in group):
        return 0.0
    return 1.0


class GTAEpisode(Episode):
    def __init__(self, key: str, record: dict, match: str = "strict"):
        super().__init__(key, record["dialogs"][0]["content"], record["tools"], record["files"])
        self.cache = ReplayCache(record["dialogs"])
        self.gt_answer = record["gt_answer"]
        self.match = match
        self.skip_reason = gta_skip_reason(self.gt_answer, record["dialogs"])

    def call_tool(self, name: str, arguments: dict) -> str:
        if name in GTA_UNAVAILABLE:
            return UNAVAILABLE_MESSAGE
        hit = self.cache.lookup(name, arguments)
        if hit is not None:
            return hit
        if name == "Calculator":
            expression = arguments.get("expression")
            if not isinstance(expression, str):
                return 'Error: Calculator takes {"expression": "<arithmetic expression>"}'
            return calculator.calculate(expression)
        return simulator_miss(name, arguments)

    def score(self, match: str | None = None) -> float | None:
        """Task score in [0, 1]; None when skipped (reason in .skip_reason). `match` overrides
        the env's mode: strict for the training reward, loose for evaluation (paper)."""
        if self.skip_reason is not None:
            return None
        if self.final_answer is None:
            return 0.0
        return gta_match(self.final_answer, self.gt_answer, match or self.match)


class GTAEnv(Env):
    def __init__(self, split: str = "test", data_dir=None, match: str = "strict"):
        if match not in ("strict", "loose"):
            raise ValueError(f"match={match!r}: choose strict or loose")
        super().__init__(load_episodes(episode_file("gta", split, data_dir)))
        self.match = match

    def _new_episode(self, key, record):
        return GTAEpisode(key, record, self.match)


# ---- ToolBench (its answers are scored by chat_api's LLM judge) -------------------------------

HISTORY_CHARS = 6000
ELIDED_OBSERVATION = "Observation: [older observation elided]"


class ToolBenchEpisode(Episode):
    """Replay with the optional fuzzy fallback and the history cap.

    History cap (paper Appendix eval, "cap the rollout history at 6,000 characters"), defined
    here as: the history is every message after the first (task) message; after each new
    observation, while the history's total content length exceeds `history_chars`, the oldest
    observation not yet elided - never the newest one - is replaced by ELIDED_OBSERVATION.
    Assistant turns are never changed (they are the policy's own tokens). Messages are rewritten
    in place, so StepResult.rewritten_from tells a caller holding a KV cache to re-render.
    """

    def __init__(self, key: str, record: dict, fuzzy: bool = False,
                 history_chars: int | None = HISTORY_CHARS,
                 judge: chat_api.ChatClient | None = None):
        super().__init__(key, record["dialogs"][0]["content"], record["tools"], record["files"])
        self.task = record["dialogs"][0]["content"]
        self.cache = ReplayCache(record["dialogs"])
        self.gt_answer = record["gt_answer"]
        self.fuzzy = fuzzy
        self.history_chars = history_chars
        self.judge = judge
        self.skip_reason = toolbench_skip_reason(self.gt_answer)

    def call_tool(self, name: str, arguments: dict) -> str:
        hit = self.cache.lookup(name, arguments)
        if hit is None and self.fuzzy:
            hit = self.cache.nearest(name, arguments)
        return hit if hit is not None else simulator_miss(name, arguments)

    def _after_observation(self) -> int | None:
        if self.history_chars is None:
            return None
        size = sum(len(m["content"]) for m in self.messages[1:])
        first = None
        for i in range(1, len(self.messages) - 1):
            if size <= self.history_chars:
                break
            m = self.messages[i]
            if m["role"] == "user" and len(m["content"]) > len(ELIDED_OBSERVATION):
                size -= len(m["content"]) - len(ELIDED_OBSERVATION)
                self.messages[i] = {"role": "user", "content": ELIDED_OBSERVATION}
                first = i if first is None else first
        return first

    def score(self) -> float | None:
        if self.skip_reason is not None:
            return None
        if self.final_answer is None:
            return 0.0
        if self.judge is None:
            raise chat_api.LLMError("ToolBench scoring needs the LLM judge: make('toolbench', "
                           "judge_model=...)")
        return chat_api.judge_answer(self.judge, self.task, toolbench_reference(self.gt_answer),
                            self.final_answer)


def toolbench_skip_reason(gt) -> str | None:
    return None if toolbench_reference(gt) else "no_answer"


def toolbench_reference(gt) -> str:
    if isinstance(gt, dict):
        return "\n".join(g[0] for g in gt.get("whitelist") or [] if g and g[0].strip())
    if isinstance(gt, list):
        return "\n".join(a for a in gt if a.strip())
    return ""


class ToolBenchEnv(Env):
    def __init__(self, split: str = "test", data_dir=None, fuzzy: bool = False,
                 history_chars: int | None = HISTORY_CHARS,
                 judge_model: str | None = "gpt-4o-mini", judge_cache=None):
        # The judge first: a missing key must fail before any data is read or fetched.
        self.judge = chat_api.ChatClient(judge_model, cache_dir=judge_cache) \
            if judge_model else None
        super().__init__(load_episodes(episode_file("toolbench", split, data_dir)))
        self.fuzzy = fuzzy
        self.history_chars = history_chars

    def _new_episode(self, key, record):
        return ToolBenchEpisode(key, record, self.fuzzy, self.history_chars, self.judge)


# ---------------------------------------------------------------------------------------------
# Contamination of released episodes with an LLM (paper Appendix contam_procedure)
# ---------------------------------------------------------------------------------------------
# For an episode with T assistant turns, turn T is the evaluation turn. Pick j uniformly from
# 1..T-1, a type uniformly among those compatible with turn j (paper Table contam_compat), ask
# the LLM once for a plausible but objectively wrong version of that turn, replace turn j only,
# and log type, dialog index, original turn and raw reply. The choices come from
# random.Random(f"{seed}:{episode id}"), so a run is deterministic given --seed and the reply
# cache, and does not depend on the order of episodes.

def assistant_positions(dialog: list[dict]) -> list[int]:
    return [i for i, m in enumerate(dialog) if m["role"] == "assistant"]


def compatible_types(dialog: list[dict], idx: int) -> list[str]:
    """Contamination types that fit the assistant turn dialog[idx] (paper Table contam_compat)."""
    positions = assistant_positions(dialog)
    prev = max((p for p in positions if p < idx), default=0)
    kinds = ["reasoning_error"]
    if dialog[idx].get("tool_calls"):
        kinds.append("tool_misuse")
    if any(m["role"] == "tool" for m in dialog[prev:idx]):
        kinds.append("observation_misinterpretation")
    if len(positions) >= 3:
        kinds.append("stale_memory")
    return kinds


def contamination_messages(record: dict, idx: int, kind: str) -> list[dict]:
    """The system + user prompt asking to rewrite the assistant turn dialog[idx] as `kind`."""
    dialog = record["dialogs"]
    turn_no = assistant_positions(dialog).index(idx) + 1
    n_turns = len(assistant_positions(dialog))
    tools = "\n".join(f"- {t['name']}: {' '.join((t.get('description') or '').split())}"
                      for t in record["tools"]) or "(none)"
    history = dialog_to_messages(dialog[:idx], record["tools"], record["files"])[1:]
    trajectory = "\n\n".join(("Agent:\n" if m["role"] == "assistant" else "") + m["content"]
                             for m in history) or "(the target step is the first step)"
    parts = [f"Task given to the agent:\n{render_task(dialog[0]['content'], record['files'])}",
             f"Available tools:\n{tools}",
             f"Trajectory before the target step:\n{trajectory}"]
    if kind == "observation_misinterpretation":
        obs = next(m for m in reversed(dialog[:idx]) if m["role"] == "tool")
        parts.append("The observation immediately before the target step:\n"
                     + render_observation(tool_result_text(obs)))
    parts.append(f"Target step (step {turn_no} of {n_turns}), to rewrite with a "
                 f"{kind.replace('_', ' ')} error:\n{render_assistant(dialog[idx])}")
    parts.append("Reply with the JSON object described in your instructions.")
    return [{"role": "system", "content": chat_api.CONTAMINATION_SYSTEM[kind]},
            {"role": "user", "content": "\n\n".join(parts)}]


def _reply_fields(kind: str, has_call: bool) -> tuple[bool, bool]:
    """(rewrites the thought, rewrites the tool call) for a contamination type."""
    return kind != "tool_misuse", kind == "tool_misuse" or (kind == "stale_memory" and has_call)


def contaminated_turn(message: dict, kind: str, reply: dict) -> dict:
    """The assistant turn with the fields `kind` rewrites replaced by the LLM's reply."""
    has_call = bool(message.get("tool_calls"))
    new_thought, new_call = _reply_fields(kind, has_call)
    new = dict(message)
    if new_thought:
        for key in ("explanation",) + (("content",) if has_call else ()):
            new.pop(key, None)      # those keys are read as thought (assistant_parts)
        new["thought"] = reply["thought"]
    if new_call:
        new["tool_calls"] = [{"type": "function", "function": {
            "name": reply["action"], "arguments": reply["action_input"]}}]
    return new


def contaminate_record(client: chat_api.ChatClient, key: str, record: dict, seed: int
                       ) -> tuple[dict | None, str]:
    """(contaminated record, "ok") or (None, why it was left out)."""
    dialog = record["dialogs"]
    positions = assistant_positions(dialog)
    rng = random.Random(f"{seed}:{key}")
    j = rng.randrange(1, len(positions))                 # 1..T-1, never the evaluation turn
    idx = positions[j - 1]
    kind = rng.choice(compatible_types(dialog, idx))
    has_call = bool(dialog[idx].get("tool_calls"))
    new_thought, new_call = _reply_fields(kind, has_call)

    def check(obj):
        if new_thought and not (isinstance(obj.get("thought"), str) and obj["thought"].strip()):
            raise ValueError("missing 'thought'")
        if new_call and not (isinstance(obj.get("action"), str) and obj["action"].strip()
                             and isinstance(obj.get("action_input"), dict)):
            raise ValueError("missing 'action' or 'action_input' (a JSON object)")
        if common.holds_lone_surrogate(obj):
            # the contaminated file is written as UTF-8, which cannot hold it
            raise ValueError("a \\ud800-\\udfff escape that is not half of a surrogate pair")
    try:
        reply, raw = client.chat_json(contamination_messages(record, idx, kind), check=check,
                                      max_tokens=1024)
    except chat_api.BadReply as e:  # one call per turn (paper): a bad reply leaves the episode out
        print(f"episode {key}: {e}", file=sys.stderr)
        return None, "bad_reply"
    turn = contaminated_turn(dialog[idx], kind, reply)
    if render_assistant(turn) == render_assistant(dialog[idx]):
        return None, "unchanged"
    out = dict(record)
    out["dialogs"] = dialog[:idx] + [turn] + dialog[idx + 1:]
    out["contaminated_turn_indices"] = [idx]
    out["contamination_types"] = [kind]
    out["original_turn_contents"] = [dialog[idx]]
    out["contamination_responses"] = [raw]
    return out, "ok"


def contaminate_file(data: str | Path, out: str | Path, client: chat_api.ChatClient, seed: int = 42,
                     min_turns: int = 3, max_turns: int = 8) -> dict[str, int]:
    """Contaminate every episode of an episode file whose assistant-turn count T lies in
    [min_turns, max_turns] (the paper's filters); write the released schema atomically."""
    if min_turns < 2:
        raise DataError(f"--min-turns {min_turns}: at least 2 (a turn before the evaluation turn)")
    if min_turns > max_turns:
        raise DataError(f"--min-turns {min_turns} > --max-turns {max_turns}: no episode would do")
    if Path(out).resolve() == Path(data).resolve():
        raise DataError(f"--out {out} is --data: it would replace the episodes it reads")
    episodes = load_episodes(data)
    result, counts = {}, {}
    for key, record in episodes.items():
        if "contaminated_turn_indices" in record:
            raise DataError(f"{data}: record {key}: already contaminated")
        n_turns = len(assistant_positions(record["dialogs"]))
        if not min_turns <= n_turns <= max_turns:
            status = "turns_out_of_range"
        else:
            new, status = contaminate_record(client, key, record, seed)
            if new is not None:
                result[key] = new
        counts[status] = counts.get(status, 0) + 1
    if not result:
        raise DataError(f"{data}: no episode was contaminated ({counts}); {out} not written")
    _check_episode_file(result, out)
    common.write_atomic(Path(out), json.dumps(result, indent=2, ensure_ascii=False).encode("utf-8"))
    return counts


# ---------------------------------------------------------------------------------------------
# make(): the one entry point of grpo.py and pair.py
# ---------------------------------------------------------------------------------------------

def make(name: str, split: str = "test", data_dir=None, **kw) -> Env:
    """A replay environment by name: gta or toolbench (the built-in world is shop.ShopEnv).

    gta: match="strict" | "loose". toolbench: fuzzy=False, history_chars=6000,
    judge_model="gpt-4o-mini" (None: no scoring), judge_cache=None.
    """
    if name == "gta":
        return GTAEnv(split, data_dir, **kw)
    if name == "toolbench":
        return ToolBenchEnv(split, data_dir, **kw)
    raise ValueError(f"unknown environment {name!r}: choose gta or toolbench")


# ---------------------------------------------------------------------------------------------
# Analysis sets made from the released splits, no LLM
# ---------------------------------------------------------------------------------------------

# make-diagnostic gta: the adversarial diagnostic set (paper Appendix diagnostic, METHOD.md §8e).
#   looks-wrong-but-right (label 1): every released matched_contaminated_test record with
#     has_contaminated_prefix and label 1 - the gold evaluation turn after a contaminated prefix.
#   looks-right-but-wrong (label 0), after the gold (clean) prefix, at most one per rule and
#     episode, at a position drawn with the seed among those where the rule applies:
#     repeat_previous_call - the previous assistant message (thought and tool call) verbatim: a
#       redundant retrieval (GTA tools are deterministic, a repeat learns nothing); not used
#       where the gold turn itself makes that call;
#     unused_observation_number - the gold turn with a number it copies from an earlier
#       observation replaced, in its call and its thought, by another number of the earlier
#       observations that no gold assistant turn and no reference answer contains: a fluent call
#       of a task tool on a value the solution never uses. OCR box coordinates "(x1, y1, x2, y2)"
#       are not values a solution copies, so they are not taken.
# The paper built its set with an LLM; these rules need none, and each negative is checked to
# differ from the gold turn at its position.
DIAGNOSTIC_RULES = ("repeat_previous_call", "unused_observation_number")
_NUMBER = re.compile(r"(?<![\w.,])\d+(?:\.\d+)?(?![\w]|[.,]\d)")
_BOX = re.compile(r"\(\d+, \d+, \d+, \d+\)")


def _tool_call(message: dict) -> tuple[str, str] | None:
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    if not calls:
        return None
    fn = calls[0]["function"]
    return fn["name"], json.dumps(fn["arguments"], sort_keys=True)


def _numbers(text: str) -> list[str]:
    return _NUMBER.findall(_BOX.sub(" ", text))


def _swap_number(text: str, old: str, new: str) -> str:
    return re.sub(r"(?<![\w.,])" + re.escape(old) + r"(?![\w]|[.,]\d)", new, text)


def _gold_numbers(record: dict) -> set[str]:
    """Every number a gold assistant turn or a reference answer contains."""
    texts = [json.dumps(m, ensure_ascii=False) for m in record["dialogs"]
             if m["role"] == "assistant"]
    texts.append(json.dumps(record.get("gt_answer"), ensure_ascii=False))
    return {n for text in texts for n in _NUMBER.findall(text)}


def repeat_previous_call(dialog: list[dict], t: int) -> dict | None:
    prev = dialog[t - 2] if t >= 2 else {}
    if _tool_call(prev) is None or _tool_call(dialog[t]) == _tool_call(prev):
        return None
    return json.loads(json.dumps(prev))


def unused_observation_number(record: dict, t: int, rng: random.Random) -> dict | None:
    dialog, gold = record["dialogs"], record["dialogs"][t]
    if _tool_call(gold) is None:
        return None
    seen = {n for m in dialog[:t] if m["role"] == "tool" for n in _numbers(tool_result_text(m))}
    arguments = gold["tool_calls"][0]["function"]["arguments"]
    copied = sorted({n for v in arguments.values() if isinstance(v, str)
                     for n in _numbers(v)} & seen)
    unused = sorted(seen - _gold_numbers(record))
    if not copied or not unused:
        return None
    old, new = rng.choice(copied), rng.choice(unused)
    turn = json.loads(json.dumps(gold))
    fn = turn["tool_calls"][0]["function"]
    fn["arguments"] = {k: _swap_number(v, old, new) if isinstance(v, str) else v
                       for k, v in fn["arguments"].items()}
    if isinstance(turn.get("thought"), str):
        turn["thought"] = _swap_number(turn["thought"], old, new)
    return turn if _tool_call(turn) != _tool_call(gold) else None


def gta_diagnostic(clean: dict[str, dict], contaminated_matched: list[dict],
                   seed: int = 0) -> list[dict]:
    """The diagnostic records of the GTA test split, episode by episode in file order."""
    positives: dict[str, list[dict]] = {}
    for rec in contaminated_matched:
        if rec["has_contaminated_prefix"] and rec["label"] == 1:
            positives.setdefault(rec["episode_id"], []).append(
                {**{k: v for k, v in rec.items() if k != "dialogs"},
                 "diagnostic": "inconsistent_correct",
                 "diagnostic_rule": "gold_after_contaminated_prefix", "dialogs": rec["dialogs"]})
    out = []
    for eid, record in clean.items():
        dialog = record["dialogs"]
        rng = random.Random(f"gta-diagnostic-{seed}-{eid}")
        turns = [t for t in assistant_positions(dialog) if t >= 1]
        for rule in DIAGNOSTIC_RULES:
            made = [(t, repeat_previous_call(dialog, t) if rule == DIAGNOSTIC_RULES[0]
                     else unused_observation_number(record, t, rng)) for t in turns]
            made = [(t, turn) for t, turn in made if turn is not None]
            if made:
                t, turn = rng.choice(made)
                out.append(matched_record(eid, t, False, None, [], "clean",
                                          dialog[:t] + [turn], diagnostic="consistent_incorrect",
                                          diagnostic_rule=rule))
        out += positives.pop(eid, [])
    if positives:
        raise DataError(f"matched_contaminated_test episodes {sorted(positives)} are not in "
                        "clean_test.json")
    return out


def family_folder(data_dir, family: str) -> Path:
    """DATA_DIR/<family>/. A --data-dir that is the family's folder itself (it holds the
    released files) is refused with one line, not answered with a download beside it."""
    root = Path(data_dir or default_data_dir())
    if not (root / family).is_dir() and (root / "matched_clean_test.json").is_file():
        raise DataError(f"--data-dir {root}: holds the {family} files itself; --data-dir is "
                        f"the folder above it ({root.parent}), which holds {family}/")
    return root / family


def make_gta_diagnostic(data_dir=None, out_dir=None, seed: int = 0) -> dict[str, int]:
    """Write matched_diagnostic_test.json and its episode file diagnostic_test.json (the clean
    test episodes, for the tool lists) to out_dir (default: the released gta folder)."""
    folder = family_folder(data_dir, "gta")
    if not (folder / "matched_contaminated_test.json").is_file():
        download("gta", folder.parent)
    clean = load_episodes(folder / "clean_test.json")
    matched = _parse_json((folder / "matched_contaminated_test.json").read_bytes(),
                          folder / "matched_contaminated_test.json")
    _check_matched_file(matched, folder / "matched_contaminated_test.json")
    records = gta_diagnostic(clean, matched, seed)
    _check_matched_file(records, "matched_diagnostic_test.json")
    used = {r["episode_id"] for r in records}
    out_dir = Path(out_dir or folder)
    common.write_atomic(out_dir / "diagnostic_test.json", json.dumps(
        {k: v for k, v in clean.items() if k in used}, indent=2).encode())
    common.write_atomic(out_dir / "matched_diagnostic_test.json", json.dumps(records).encode())
    counts: dict[str, int] = {}
    for r in records:
        counts[r["diagnostic_rule"]] = counts.get(r["diagnostic_rule"], 0) + 1
    return {"records": len(records), "episodes": len(used), **counts}


# split-episodes: a train split from released test files (ToolBench has none, METHOD.md §1).
# The episodes of the test files are drawn into two halves with a seed; each half gets all four
# files (episode and matched, clean and contaminated) named as released. *Departure*: the paper
# trained on ToolBench train episodes, which are not public; probes fitted on half of the test
# episodes and scored on the other half answer the same question on fewer data.
SPLIT_FILES = ("clean", "contaminated", "matched_clean", "matched_contaminated")


def split_episodes(data_dir, family: str, out_dir, seed: int = 0, fraction: float = 0.5,
                   episodes: int | None = None) -> dict[str, int]:
    """Write {clean,contaminated,matched_clean,matched_contaminated}_{train,test}.json of the
    family's test episodes split by episode (`fraction` to train), optionally of a seeded
    subsample of `episodes` episodes first. Returns records per file written."""
    if not 0 < fraction < 1:
        raise DataError(f"--fraction {fraction}: must be strictly between 0 and 1")
    folder = family_folder(data_dir, family)
    if Path(out_dir).resolve() == folder.resolve():
        raise DataError(f"--out {out_dir}: that is where the released files are, and the split "
                        "would overwrite their test files: write it to another folder "
                        f"(e.g. OUT/{family}, then --data-dir OUT)")
    if not all((folder / f"{name}_test.json").is_file() for name in SPLIT_FILES):
        download(family, folder.parent)
    data = {}
    for name in SPLIT_FILES:
        path = folder / f"{name}_test.json"
        data[name] = _parse_json(path.read_bytes(), path)
        (_check_matched_file if name.startswith("matched_") else _check_episode_file)(
            data[name], path)
    ids = sorted(data["clean"])
    rng = random.Random(f"split-{family}-{seed}")
    rng.shuffle(ids)
    if episodes is not None:
        if episodes < 2:
            raise DataError(f"--episodes {episodes}: need at least 2 (one per half)")
        ids = ids[:episodes]
    n_train = max(1, min(len(ids) - 1, round(fraction * len(ids))))
    halves = {"train": set(ids[:n_train]), "test": set(ids[n_train:])}
    counts = {}
    for split, keep in halves.items():
        for name in SPLIT_FILES:
            if name.startswith("matched_"):
                part = [r for r in data[name] if r["episode_id"] in keep]
            else:
                part = {k: v for k, v in data[name].items() if k in keep}
            target = Path(out_dir) / f"{name}_{split}.json"
            common.write_atomic(target, json.dumps(part, indent=None if name.startswith("matched_")
                                            else 2).encode())
            counts[target.name] = len(part)
    return counts


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def replay_report(env: Env, match: str | None = None, score: bool = True) -> dict:
    """Play every gold dialog of a replay env: observation mismatches, mean gold score, skips."""
    mismatches, scores, skips = 0, [], {}
    for key in env.ids:
        ep = env.episode(key)
        pairs = play_gold(ep, env.records[key]["dialogs"])
        mismatches += sum(recorded != got for recorded, got in pairs)
        if not score:
            continue
        s = ep.score(match) if isinstance(ep, GTAEpisode) else ep.score()
        if s is None:
            skips[ep.skip_reason] = skips.get(ep.skip_reason, 0) + 1
        else:
            scores.append(s)
    report = {"episodes": len(env), "observation_mismatches": mismatches}
    if score:
        report.update(scored=len(scores), skipped=skips,
                      mean_gold_score=sum(scores) / len(scores) if scores else None)
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("download", help="fetch the released splits from the authors' repository")
    p.add_argument("family", choices=sorted(RELEASE_FILES), help="which benchmark's files")
    p.add_argument("--data-dir", default=None,
                   help="root folder (files go to DIR/<family>/); default $PAIR_DATA or "
                        "~/.cache/pair/data")
    p.add_argument("--ref", default=RELEASE_REF, help="git commit or branch of the repository")
    p.add_argument("--force", action="store_true", help="download files that already exist")

    p = sub.add_parser("contaminate", help="rewrite one turn per episode with an LLM (paper "
                                           "Appendix contam_procedure)")
    p.add_argument("--data", required=True, help="episode file to contaminate "
                                                 "(clean_<split>.json schema)")
    p.add_argument("--out", required=True, help="output episode file (contaminated schema)")
    p.add_argument("--seed", type=int, default=42, help="seed of the turn and type choices")
    p.add_argument("--model", default="gpt-4o-mini", help="chat model name at the endpoint "
                   "($OPENAI_BASE_URL, key in $OPENAI_API_KEY)")
    p.add_argument("--cache-dir", default=None, help="LLM reply cache (default "
                                                     "~/.cache/pair/llm)")
    p.add_argument("--min-turns", type=int, default=3,
                   help="skip episodes with fewer assistant turns (paper: 3)")
    p.add_argument("--max-turns", type=int, default=8,
                   help="skip episodes with more assistant turns (paper: 8)")

    p = sub.add_parser("make-diagnostic", help="write the adversarial diagnostic set of a "
                                               "released benchmark from its data (no LLM)")
    p.add_argument("family", choices=["gta"], help="which benchmark (GTA: the rules in envs.py)")
    p.add_argument("--data-dir", default=None,
                   help="root folder of the released files (DIR/<family>/); default $PAIR_DATA "
                        "or ~/.cache/pair/data")
    p.add_argument("--out", default=None, help="output folder (default: DIR/<family>/)")
    p.add_argument("--seed", type=int, default=0, help="seed of the positions drawn (default 0)")

    p = sub.add_parser("split-episodes", help="split a benchmark's released test files by "
                                              "episode into train and test halves")
    p.add_argument("family", choices=sorted(RELEASE_FILES), help="which benchmark")
    p.add_argument("--data-dir", default=None,
                   help="root folder of the released files (DIR/<family>/)")
    p.add_argument("--out", required=True, help="output folder for the eight files")
    p.add_argument("--seed", type=int, default=0, help="seed of the episode draw (default 0)")
    p.add_argument("--fraction", type=float, default=0.5,
                   help="fraction of the episodes that go to train (default 0.5)")
    p.add_argument("--episodes", type=int, default=None,
                   help="first draw this many episodes (a seeded subsample; default: all)")

    p = sub.add_parser("replay", help="play the gold dialogs through a replay env and report")
    p.add_argument("family", choices=["gta", "toolbench"], help="which benchmark")
    p.add_argument("--split", default="test", choices=["train", "test"], help="released split")
    p.add_argument("--data-dir", default=None, help="root folder of the released files")
    p.add_argument("--match", default="strict", choices=["strict", "loose"],
                   help="GTA answer matching mode")
    p.add_argument("--judge-model", default=None,
                   help="ToolBench: score gold answers with this judge model (default: no "
                        "scoring)")
    args = ap.parse_args(argv)
    try:
        _run(args)
    except (DataError, chat_api.LLMError, OSError) as e:    # expected failures (an --out under
        sys.exit(f"error: {e}")                             # a file too): one line


def _run(args):
    if args.command == "download":
        print(download(args.family, args.data_dir, args.ref, args.force))
    elif args.command == "contaminate":
        client = chat_api.ChatClient(args.model, cache_dir=args.cache_dir)
        counts = contaminate_file(args.data, args.out, client, args.seed, args.min_turns,
                                  args.max_turns)
        print(json.dumps({"out": args.out, "counts": counts,
                          "requests": client.requests_made}))
    elif args.command == "make-diagnostic":
        print(json.dumps(make_gta_diagnostic(args.data_dir, args.out, args.seed)))
    elif args.command == "split-episodes":
        print(json.dumps(split_episodes(args.data_dir, args.family, args.out, args.seed,
                                        args.fraction, args.episodes)))
    elif args.command == "replay":
        if args.family == "gta":
            env = make("gta", args.split, args.data_dir, match=args.match)
        else:
            env = make("toolbench", args.split, args.data_dir, judge_model=args.judge_model)
        score = args.family == "gta" or args.judge_model is not None
        print(json.dumps(replay_report(env, args.match, score)))


if __name__ == "__main__":
    main()
