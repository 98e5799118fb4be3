"""envs.py: METHOD.md §2 rendering, the ReAct parser, the calculator, GTA/ToolBench replay,
scoring, the loaders, and the OpenAI-compatible client (judge, contamination) against a local fake
server."""
import functools
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import envs
from envs import Action, Final, ParseError
from lab import data as data_command
from lab.methods import baselines
from lab.worlds import released, toolbench

ROOT = Path(__file__).resolve().parents[1]


def _dialogs(path):
    data = json.loads(Path(path).read_text())
    return [r["dialogs"] for r in (data.values() if isinstance(data, dict) else data)]


# ---- GTA replay and scoring (the issue's check) ----------------------------------------------

def test_gta_gold_replay_returns_recorded_observations_and_scores_one(release_dir):
    env = envs.make("gta", split="test", data_dir=release_dir)
    assert len(env) == 53
    answered, scored = 0, 0
    for key in env.ids:
        record = env.records[key]
        ep = env.episode(key)
        assert ep.messages == released.record_messages(record)[:1]
        pairs = released.play_gold(ep, record["dialogs"])
        n_calls = sum(1 for m in record["dialogs"] if m["role"] == "tool")
        assert len(pairs) == n_calls
        for recorded, got in pairs:
            assert got == recorded, key
        answered += len(pairs)
        for mode in ("strict", "loose"):
            s = ep.score(mode)
            assert (s is None) == (ep.skip_reason is not None)
            if s is not None:
                assert s == 1.0, (key, mode, ep.final_answer, record["gt_answer"])
        scored += ep.skip_reason is None
    counts: dict[str, int] = {}
    for rec in env.records.values():
        reason = envs.gta_skip_reason(rec["gt_answer"], rec["dialogs"]) or "scored"
        counts[reason] = counts.get(reason, 0) + 1
    print(f"\nGTA clean_test: {answered} gold tool calls replayed; skip counts {counts}")
    assert answered == 127 and scored == counts["scored"] == 33
    assert counts == {"scored": 33, "no_answer": 14, "reference_list": 5, "image_answer": 1}


def test_gta_tool_routing_and_episode_rules(release_dir):
    env = envs.make("gta", split="test", data_dir=release_dir)
    ep = env.episode("1")           # PS5 task: OCR, CountGivenObject, Calculator ...
    r = ep.step(envs.render_action("look", "WebSearch", {"query": "ps5"}))
    assert r.observation == "Observation: " + envs.UNAVAILABLE_MESSAGE and not r.done
    r = ep.step('Thought: add\nAction: Calculator\nAction Input: {"expression": "2 * (3 + 4)"}')
    assert r.observation == "Observation: 14"                  # a miss: computed locally
    r = ep.step(envs.render_action(None, "OCR", {"image": "image/nope.jpg"}))
    assert r.observation == ('Observation: [Simulator] Tool \'OCR\' with args '
                             '{"image": "image/nope.jpg"} has no cached response.')
    r = ep.step("Action: OCR\nAction Input: {image: 1}")
    assert r.observation.startswith("Observation: Invalid reply: Invalid JSON in Action Input")
    for _ in range(5):
        r = ep.step("I am not sure.")
    assert len(ep.steps) == 9 and not ep.done
    r = ep.step("still thinking")
    assert r == envs.StepResult(None, True) and ep.done and ep.final_answer is None
    assert ep.score() == 0.0                # out of turns without an answer
    assert len([m for m in ep.messages if m["role"] == "assistant"]) == envs.MAX_TURNS
    with pytest.raises(RuntimeError, match="done"):
        ep.step("Final Answer: 1")

    ep = env.episode("1")
    r = ep.step("Thought: easy\nFinal Answer: I need $1919.96 in total.")
    assert r.done and r.observation is None
    assert ep.score() == 1.0 and ep.score("loose") == 1.0
    ep = env.episode("1")
    ep.step("Final Answer: 11919.96")
    assert ep.score("strict") == 0.0 and ep.score("loose") == 1.0   # substring vs whole word


def test_gta_match_rules():
    gt = {"whitelist": [["iPhone 15 128G", "iPhone 15 128GB"], ["Plus"]],
          "blacklist": [["Pro"], ["256"]]}
    assert envs.gta_match("the iphone 15 128gb and the Plus", gt) == 1.0
    assert envs.gta_match("the iPhone 15 128GB", gt) == 0.0             # a group unmatched
    assert envs.gta_match("iPhone 15 128G Plus, not the Pro", gt) == 0.0   # blacklisted
    assert envs.gta_match("iPhone 15 128G Plus Promax", gt, "strict") == 1.0
    assert envs.gta_match("iPhone 15 128G Plus Promax", gt, "loose") == 0.0
    neg = {"whitelist": [["-2"], ["4"]], "blacklist": None}
    assert envs.gta_match("-2 or 4", neg) == 1.0       # \b-based matching would miss "-2"
    assert envs.gta_match("5-2 or 4", neg) == 0.0
    assert envs.gta_match("x = 24", neg, "strict") == 0.0
    assert envs.gta_match("x = -24", neg, "loose") == 1.0
    with pytest.raises(ValueError, match="match mode"):
        envs.gta_match("1", neg, "fuzzy")
    assert envs.gta_skip_reason(None) == "no_answer"
    assert envs.gta_skip_reason(["a reference sentence"]) == "reference_list"
    assert envs.gta_skip_reason({"whitelist": [["image/out.jpg"]]}) == "image_answer"


# ---- METHOD.md §2 rendering ---------------------------------------------------------------------

def test_render_format_and_parse_roundtrip_on_released_turns(release_dir):
    assert envs.render_action("t", "f", {"a": "é"}) == \
        'Thought: t\nAction: f\nAction Input: {"a": "é"}'
    assert envs.render_action(None, "f", {}) == "Action: f\nAction Input: {}"
    assert envs.render_final(None, "42") == "Final Answer: 42"
    assert envs.render_final("so", "42") == "Thought: so\nFinal Answer: 42"
    n = 0
    for path in sorted(release_dir.glob("*/*.json")):
        for dialog in _dialogs(path):
            for m in dialog:
                if m["role"] != "assistant":
                    continue
                thought, call, final = envs.assistant_parts(m)
                parsed = envs.parse_react(envs.render_assistant(m))
                if call is None:
                    assert parsed == Final(thought, final)
                elif "\n" not in call["name"]:
                    assert parsed == Action(thought, call["name"], call["arguments"])
                else:       # the 54 ToolLLaMA name artifacts: the tool name is recovered
                    assert isinstance(parsed, Action)
                    assert parsed.name in call["name"] and "\n" not in parsed.name
                n += 1
    assert n > 10000


def test_dialog_to_messages_shape(release_dir):
    eps = envs.load_episodes(release_dir / "gta" / "clean_train.json")
    rec = eps["37"]         # a tool call with `content` and no thought
    msgs = released.record_messages(rec)
    task = rec["dialogs"][0]["content"]
    files = "\n".join(f"- {f['path']} ({f['type']})" for f in rec["files"])
    assert msgs[0] == {"role": "user", "content": f"{task}\n\nFiles:\n{files}\n\n"
                                                  + envs.tool_instructions(rec["tools"])}
    assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(msgs) // 2)
    assert msgs[3]["content"].startswith("Thought: The CPU, AMD Ryzen 7950X, has 16 cores.\n"
                                         "Action: GoogleSearch\nAction Input: {")
    assert msgs[-1]["content"] == "Final Answer: 16"
    raw = envs.tool_result_text(rec["dialogs"][4])
    assert len(raw) < 1000 and msgs[4]["content"] == "Observation: " + raw
    key, i = next((k, i) for k, r in eps.items() for i, m in enumerate(r["dialogs"])
                  if m["role"] == "tool" and len(envs.tool_result_text(m)) > 1000)
    long = envs.tool_result_text(eps[key]["dialogs"][i])
    assert envs.dialog_to_messages(eps[key]["dialogs"][:i + 1], [])[-1]["content"] == \
        "Observation: " + long[:1000] + "..."
    tool_text = envs.tool_instructions(rec["tools"])
    assert "- GoogleSearch: " in tool_text and "    k (int, optional): Select the first k" \
        in tool_text and "Final Answer: <the answer only>" in tool_text
    # the contaminated turn stored under `explanation` is rendered as the thought
    bad = released.load_released_episodes(release_dir / "gta" / "contaminated_train.json")["162"]
    assert released.record_messages(bad)[1]["content"].startswith(
        "Thought: Since the image depicts a historical battle")
    # ToolBench: a user message after a tool result is merged into the observation message
    tb = envs.load_episodes(release_dir / "toolbench" / "clean_test.json")["toolbench_85752"]
    msgs = released.record_messages(tb)
    assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(msgs) // 2)
    merged = [m for m in msgs if m["role"] == "user" and "\n\nThis is not the first time"
              in m["content"]]
    assert len(merged) == 1 and merged[0]["content"].startswith("Observation: ")


def test_matched_records_get_their_episode_tools(release_dir, tmp_path):
    recs = released.load_matched(release_dir / "gta" / "matched_contaminated_test.json")
    eps = released.load_released_episodes(release_dir / "gta" / "contaminated_test.json")
    assert len(recs) == 177
    for r in recs[:20]:
        assert r["tools"] == eps[r["episode_id"]]["tools"]
        msgs = released.record_messages(r)
        assert msgs[-1]["role"] == "assistant"
        assert msgs[0]["content"] == released.record_messages(eps[r["episode_id"]])[0]["content"]
    lone = tmp_path / "matched_clean_test.json"
    lone.write_bytes((release_dir / "gta" / "matched_clean_test.json").read_bytes())
    with pytest.raises(envs.DataError, match="clean_test.json: no such file"):
        released.load_matched(lone)


# ---- parser ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ('Thought: t\nAction: OCR\nAction Input: {"image": "a.jpg"}',
     Action("t", "OCR", {"image": "a.jpg"})),
    ('thought:  t \naction:`OCR`\naction input: ```json\n{"image": "a.jpg"}\n```\nObservation: x',
     Action("t", "OCR", {"image": "a.jpg"})),
    ('I will look.\nAction: OCR\nAction Input: {}\nObservation: made up\nFinal Answer: 3',
     Action("I will look.", "OCR", {})),
    ("Thought: so\nFinal Answer: 3 apples\nand 2 pears\nObservation: z",
     Final("so", "3 apples\nand 2 pears")),
    ("Thought: plan\nAction: do the thing\n\nAction: OCR\nAction Input: {}",
     Action("plan\nAction: do the thing", "OCR", {})),
    ("Final Answer: 7", Final(None, "7")),
])
def test_parse_react_cases(text, expected):
    assert envs.parse_react(text) == expected


@pytest.mark.parametrize("text, message", [
    ("just chatting", "No 'Action:' or 'Final Answer:' line"),
    ("Action: OCR", "must be followed by an 'Action Input:'"),
    ("Action: OCR\nAction Input:", "'Action Input:' is empty"),
    ("Action: OCR\nAction Input: {'image': 1}", "Invalid JSON in Action Input"),
    ("Action: OCR\nAction Input: [1, 2]", "must be a JSON object"),
    ("Action:\nAction Input: {}", "names no tool"),
    ("Final Answer:   ", "'Final Answer:' is empty"),
    ("Action: OCR\nAction Input: " + "[" * 100000, "Invalid JSON"),
    ('Action: OCR\nAction Input: {"n": ' + "9" * 5000 + "}", "Exceeds the limit"),
    # parses, but json.dumps (the tool cache's key) would overflow the stack on it
    ("Action: OCR\nAction Input: " + '{"a":' * 950 + "1" + "}" * 950, "nested deeper than 64"),
])
def test_parse_react_errors_tell_what_is_wrong(text, message):
    parsed = envs.parse_react(text)
    assert isinstance(parsed, ParseError) and message in parsed.message


def test_a_deep_action_input_is_an_observation_not_a_crash():
    ep = envs.ShopEnv("train").episode(0)
    r = ep.step("Action: Lookup\nAction Input: " + '{"a":' * 950 + "1" + "}" * 950)
    assert not r.done and "nested deeper than 64" in r.observation
    assert envs.parse_react("Action: L\nAction Input: " + '{"a":' * 63 + "1" + "}" * 63).name == "L"


def test_lone_surrogate_escape_in_action_input_is_an_error_observation():
    # Plain ASCII JSON whose "\\ud800" escape decodes to half a UTF-16 pair: the observation
    # must still be valid Unicode (the tokenizer refuses anything else), and the episode goes on.
    reply = 'Thought: x\nAction: Lookup\nAction Input: {"store": "\\ud800", "item": "tea"}'
    assert reply.isascii()
    parsed = envs.parse_react(reply)
    assert isinstance(parsed, ParseError) and "surrogate pair" in parsed.message
    ep = envs.ShopEnv("train").episode(0)
    r = ep.step(reply)
    assert not r.done and r.observation.startswith("Observation: Invalid reply")
    r.observation.encode("utf-8")
    key = 'Action: Lookup\nAction Input: {"\\udfff": "a"}'
    assert isinstance(envs.parse_react(key), ParseError)
    pair = envs.parse_react('Action: Lookup\nAction Input: {"store": "\\ud83d\\ude00"}')
    assert pair == Action(None, "Lookup", {"store": "\U0001F600"})      # a real pair is fine
    assert envs.render_observation("a\udc80b") == "Observation: a\ufffdb"


def _random_text(rng, pieces, templates=()):
    """Random pieces and characters, or a valid template with a few random edits."""
    if templates and rng.random() < 0.5:
        text = list(rng.choice(templates))
        for _ in range(rng.randrange(0, 4)):
            at = rng.randrange(0, len(text) + 1)
            edit = rng.random()
            if edit < 0.4 and at < len(text):
                del text[at]
            elif edit < 0.7:
                text.insert(at, rng.choice(pieces))
            elif at < len(text):
                text[at] = chr(rng.randrange(0, 0x3000))
        return "".join(text)
    return "".join(rng.choice(pieces) if rng.random() < 0.6 else chr(rng.randrange(0, 0x3000))
                   for _ in range(rng.randrange(0, 40)))


def test_parser_survives_fuzz():
    rng = random.Random(0)
    pieces = ["Thought:", "Action:", "Action Input:", "Final Answer:", "Observation:", "\n",
              " ", "{", "}", "[", "]", '"', ":", ",", "```", "json", "1", "x", "\\", "null"]
    templates = [envs.render_action("I need the total.", "Calculator", {"expression": "2*3"}),
                 envs.render_final("Done.", "6"), "Action: OCR\nAction Input: {}\nObservation: 1"]
    kinds = {Action: 0, Final: 0, ParseError: 0}
    for _ in range(4000):
        parsed = envs.parse_react(_random_text(rng, pieces, templates))
        kinds[type(parsed)] += 1
    assert all(kinds.values()), kinds       # the generator reaches all three outcomes
    assert isinstance(envs.parse_react(None), ParseError)


# ---- calculator --------------------------------------------------------------------------------

@pytest.mark.parametrize("expr, out", [
    ("479.99 * 4", "1919.96"), ("13.95*3", "41.849999999999994"), ("5 / 9", "0.5555555555555556"),
    ("(5/4) * (8/21) - (1/28)", "0.44047619047619047"), ("round(75 / 59 * 100)", "127"),
    ("7 // 2 + 7 % 2", "4"), ("-2 ** 2", "-4"), ("2 ** -1", "0.5"), ("+3", "3"),
    ("sqrt(16)", "4.0"), ("math.sqrt(2) ** 2", "2.0000000000000004"), ("max(1, 5, 3)", "5"),
    ("factorial(5)", "120"), ("math.pi", "3.141592653589793"), ("log(e)", "1.0"),
    ("2 ** 100", "1267650600228229401496703205376"), ("abs(-3.5)", "3.5"), (" 1 + 1 ", "2"),
])
def test_calculator_values(expr, out):
    assert envs.calculate(expr) == out


@pytest.mark.parametrize("expr, message", [
    ("__import__('os')", "unknown function"),
    ("__import__('os').system('echo hi')", "attribute access"),
    ("os", "unknown name"), ("open", "unknown name"), ("x + 1", "unknown name"),
    ("(1).__class__", "attribute access"), ("math.__dict__", "unknown name"),
    ("().__class__.__bases__", "attribute access"), ("[1, 2]", "unsupported syntax"),
    ("'a' * 3", "unsupported literal"), ("lambda: 1", "unsupported syntax"),
    ("9 ** 9 ** 9", "the result is too large"), ("2 ** 100000", "the result is too large"),
    ("pow(10, 5000)", "the result is too large"), ("factorial(100000)", "argument too large"),
    ("10 ** 2000 * 10 ** 2000", "the result is too large"),
    ("1 / 0", "division by zero"), ("sqrt(-1)", "math domain error"), ("29,000 + 1", "comma"),
    ("(-8) ** (1/3)", "not a real number"), ("1 +", "invalid expression"), ("1" * 2000, "longer"),
    ("round(x=1)", "positional arguments"), ("max(*[1])", "positional arguments"),
    ("True + 1", "unsupported literal"), ("1 < 2", "unsupported syntax"),
])
def test_calculator_rejects(expr, message):
    out = envs.calculate(expr)
    assert out.startswith("Error: ") and message in out


# Past the largest float (about 1.8e308): an OverflowError ("(34, 'Numerical result out of
# range')", "math range error", "int too large to convert to float"), or an operation that
# overflows to inf without an error.
@pytest.mark.parametrize("expr", [
    "10.0 ** 400", "pow(10.0, 400)", "2.0 ** 1024", "(-2.0) ** 1025", "exp(1000)", "cosh(1000)",
    "10 ** 400 - 1.5", "sqrt(10 ** 400)", "float(10 ** 400)", "3 ** 1000 / 3",
    "round(1.7e308, -308)", "1e308 * 10", "-1e308 * 10", "1e308 + 1e308", "1e308 / 0.1",
    "degrees(1e308)", "1e308 * 10 - 1e308 * 10",
])
def test_calculator_answers_a_float_overflow_with_a_sentence(expr):
    assert envs.calculate(expr) == "Error: the result is too large"


@pytest.mark.parametrize("expr", ["1e309", "-1e309", "1e400 * 0", "1e309 - 1e309", "sqrt(1e999)"])
def test_calculator_refuses_an_infinite_literal(expr):
    assert envs.calculate(expr) == "Error: a number in the expression is too large"


@pytest.mark.parametrize("expr", ["inf", "-inf", "nan", "math.inf", "math.nan", "inf - inf",
                                  "nan + 1", "float('nan')", "float('inf')", "max(1, inf)"])
def test_calculator_knows_no_inf_or_nan(expr):
    assert envs.calculate(expr).startswith("Error: ")       # not "inf" or "nan"


def test_calculator_answers_finite_numbers_or_sentences():
    rng = random.Random(3)
    pieces = ["1e308", "1e307", "9", "0.5", "2", "*", "+", "-", "/", "**", "(", ")", "exp(",
              "degrees(", "pow(", ",", "1e309", "inf", "nan", "10 ** 400", "hypot("]
    for _ in range(3000):
        out = envs.calculate(" ".join(rng.choice(pieces) for _ in range(rng.randint(1, 8))))
        if out.startswith("Error: "):
            assert not out.startswith("Error: ("), out        # no raw (errno, message) tuple
        else:
            assert math.isfinite(float(out)) or out.lstrip("-").isdigit(), out


def test_shop_calculator_never_answers_inf():
    task = envs.shop_task(1)
    # an integer past 1.8e308 is exact: the shop tool shows it, not float()'s inf
    res = envs.shop_execute(task, "Calculator", {"expression": "2 ** 1100"})
    assert res.text == str(2 ** 1100) and res.number is None
    res = envs.shop_execute(task, "Calculator", {"expression": "1e308 * 10"})
    assert res.text == "Error: the result is too large" and res.number is None


HOSTILE = ["round(1, -10**8)", "round(1, -10**7)", "round(2**3999, -10**8)", "round(1.5, -10**8)",
           "round(1, 10**8)", "round(1, -2**3999)", "2**3999 * 2**3999", "gcd(*[1])",
           "gcd(2**3999 - 1, 2**3998 - 1)", "factorial(1000)", "factorial(1000) * factorial(1000)",
           "pow(3, 2**3999)", "(-1) ** (2**3999)"]


def test_calculator_bounds_every_operation_before_running_it():
    # In a child process with a deadline: an unbounded operation (round(1, -10**8) builds
    # 10**(10**8), minutes of work) must not hang the test either.
    code = ("import json, sys, time, envs\n"
            "out = []\n"
            "for e in json.loads(sys.argv[1]):\n"
            "    t = time.perf_counter(); r = envs.calculate(e)\n"
            "    out.append([e, r[:60], time.perf_counter() - t])\n"
            "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code, json.dumps(HOSTILE)], cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr[-2000:]
    for expr, out, seconds in json.loads(r.stdout):
        assert seconds < 0.5, (expr, out, seconds)
    results = {e: out for e, out, _ in json.loads(r.stdout)}
    assert results["round(1, -10**8)"] == "Error: round() digits out of range (limit 1000)"
    assert results["round(1, 10**8)"].startswith("Error")
    assert results["2**3999 * 2**3999"] == "Error: the result is too large"
    assert results["(-1) ** (2**3999)"] == "1"
    assert envs.calculate("round(1234, -2)") == "1200"
    assert envs.calculate("round(2.675, 2.0)") == "2.67"


def test_calculator_survives_fuzz():
    rng = random.Random(1)
    pieces = ["1", "9", "0", ".", "e", "+", "-", "*", "/", "//", "%", "**", "(", ")", ",", " ",
              "sqrt", "math.", "pi", "factorial", "pow", "__", "class", "'", "[", "]", "lambda",
              "999999", "=", "j"]
    templates = ["479.99 * 4", "round(75 / 59 * 100)", "math.sqrt(2) ** 2", "2 ** 3 ** 2"]
    results = set()
    for _ in range(4000):
        out = envs.calculate(_random_text(rng, pieces, templates))
        assert isinstance(out, str)
        results.add(out.startswith("Error"))
    assert results == {True, False}
    assert envs.calculate(None).startswith("Error")


# ---- ToolBench replay ----------------------------------------------------------------------------

def _toolbench_record(observations):
    dialog = [{"role": "user", "content": "Find the weather."}]
    for i, text in enumerate(observations):
        dialog.append({"role": "assistant", "thought": f"step {i}", "tool_calls": [
            {"type": "function", "function": {"name": "weather_for_api",
                                              "arguments": {"city": "Paris", "day": i}}}]})
        dialog.append({"role": "tool", "name": "weather_for_api",
                       "content": {"type": "text", "content": text}})
    dialog.append({"role": "assistant", "content": "Sunny."})
    return {"dialogs": dialog, "tools": [{"name": "weather_for_api", "inputs": []}],
            "files": [], "gt_answer": {"whitelist": [["Sunny."]], "blacklist": None}}


def test_toolbench_cache_repeats_and_fuzzy_fallback():
    rec = _toolbench_record(["rain", "sun"])
    rec["dialogs"].insert(5, dict(rec["dialogs"][1]))          # the day-0 call again ...
    rec["dialogs"].insert(6, {"role": "tool", "name": "weather_for_api", "content": "retry"})
    exact = toolbench.ToolBenchEpisode("x", rec)
    call = envs.render_action(None, "weather_for_api", {"day": 0, "city": "Paris"})
    assert exact.step(call).observation == "Observation: rain"      # key order does not matter
    assert exact.step(call).observation == "Observation: retry"     # ... replayed in order
    assert exact.step(call).observation == "Observation: retry"
    near = envs.render_action(None, "weather_for_api", {"city": "paris", "day": 1, "unit": "C"})
    assert "[Simulator] Tool 'weather_for_api'" in exact.step(near).observation
    fuzzy = released.FuzzyToolBenchEpisode("x", rec)
    assert fuzzy.step(near).observation == "Observation: sun"       # highest Jaccard overlap
    other = envs.render_action(None, "other_tool", {"city": "Paris", "day": 1})
    assert "[Simulator] Tool 'other_tool'" in fuzzy.step(other).observation


def test_toolbench_history_cap_elides_oldest_observations():
    rec = _toolbench_record(["a" * 900, "b" * 900, "c" * 900, "d" * 900, "e" * 900, "f" * 900])
    ep = toolbench.ToolBenchEpisode("x", rec, history_chars=3000)
    results = [ep.step(envs.render_assistant(m)) for m in rec["dialogs"] if m["role"] ==
               "assistant" and m.get("tool_calls")]
    history = ep.messages[1:]
    assert sum(len(m["content"]) for m in history) <= 3000
    obs = [m["content"] for m in history if m["role"] == "user"]
    assert obs[-1] == "Observation: " + "f" * 900                  # the newest is kept
    assert obs[0] == toolbench.ELIDED_OBSERVATION and obs[-2] == "Observation: " + "e" * 900
    kept = [o for o in obs if o != toolbench.ELIDED_OBSERVATION]
    assert obs == [toolbench.ELIDED_OBSERVATION] * (len(obs) - len(kept)) + kept   # oldest first
    assert [m["content"] for m in history if m["role"] == "assistant"] == [
        envs.render_assistant(m) for m in rec["dialogs"] if m.get("tool_calls")]
    assert results[0].rewritten_from is None and results[-1].rewritten_from is not None
    assert ep.messages[results[-1].rewritten_from]["content"] == toolbench.ELIDED_OBSERVATION
    uncapped = toolbench.ToolBenchEpisode("x", rec, history_chars=None)
    for m in rec["dialogs"][1::2][:6]:
        assert uncapped.step(envs.render_assistant(m)).rewritten_from is None
    assert toolbench.ELIDED_OBSERVATION not in [m["content"] for m in uncapped.messages]


# ---- loaders -------------------------------------------------------------------------------------

def _bad_file(tmp_path, release_dir, mutate):
    data = json.loads((release_dir / "gta" / "clean_test.json").read_text())
    data = {k: data[k] for k in list(data)[:3]}
    key = list(data)[1]
    mutate(data[key])
    path = tmp_path / "clean_test.json"
    path.write_text(json.dumps(data))
    return path, key


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.pop("tools"), "missing 'tools'"),
    (lambda r: r["dialogs"][1]["tool_calls"].append(r["dialogs"][1]["tool_calls"][0]),
     "dialogs[1]: at most one tool call"),
    (lambda r: r["dialogs"][1]["tool_calls"][0]["function"].update(arguments="{}"),
     "dialogs[1]: tool call arguments must be a JSON object"),
    (lambda r: r["dialogs"].insert(1, {"role": "tool", "name": "OCR", "content": "x"}),
     "dialogs[1]: a tool result must follow an assistant tool call"),
    (lambda r: r["dialogs"][0].update(role="system"), "dialogs[0]"),
    (lambda r: r.update(gt_answer={"whitelist": "1919.96"}), "'gt_answer' must be"),
    (lambda r: r.update(contaminated_turn_indices=[0], contamination_types=["reasoning_error"],
                        original_turn_contents=[{}]), "index 0 is not an assistant turn"),
    (lambda r: r.update(contaminated_turn_indices=[1], contamination_types=["typo"],
                        original_turn_contents=[{}]), "unknown contamination type 'typo'"),
    (lambda r: r.update(contaminated_turn_indices=[1], contamination_types=[]),
     "must be lists of one length"),
])
def test_loader_errors_name_file_and_record(tmp_path, release_dir, mutate, message):
    """The core's loader checks what it plays; the lab's adds a contaminated file's fields."""
    path, key = _bad_file(tmp_path, release_dir, mutate)
    contamination = "contaminated_turn_indices" in json.loads(path.read_text())[key]
    loaders = [released.load_released_episodes] + ([] if contamination else [envs.load_episodes])
    for load in loaders:
        with pytest.raises(envs.DataError) as err:
            load(path)
        assert str(path) in str(err.value) and f"record {key}" in str(err.value)
        assert message in str(err.value)
    if contamination:
        assert envs.load_episodes(path)[key]["contaminated_turn_indices"]


def test_matched_loader_errors(tmp_path, release_dir):
    data = json.loads((release_dir / "gta" / "matched_clean_test.json").read_text())[:4]
    data[2]["turn_idx"] -= 1
    path = tmp_path / "matched_clean_test.json"
    path.write_text(json.dumps(data))
    with pytest.raises(envs.DataError, match=r"matched_clean_test.json: record 2 \(episode "):
        released.load_matched(path)
    path.write_text("{not json")
    with pytest.raises(envs.DataError, match="matched_clean_test.json: not valid JSON"):
        released.load_matched(path)


def test_download_validates_and_writes_atomically(monkeypatch, tmp_path, release_dir):
    served = tmp_path / "served"
    for name in released.ALL_RELEASE_FILES["gta"]:
        (served / "gta").mkdir(parents=True, exist_ok=True)
        (served / "gta" / name).write_bytes((release_dir / "gta" / name).read_bytes())

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 functools.partial(Quiet, directory=str(served)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    monkeypatch.setattr(envs, "RELEASE_URL", f"http://127.0.0.1:{port}/{{family}}/{{name}}")
    try:
        env = envs.make("gta", split="test", data_dir=tmp_path / "data")   # missing: fetched
        assert len(env) == 53       # the core fetches the episode files it plays, no more
        assert sorted(p.name for p in (tmp_path / "data" / "gta").iterdir()) == \
            sorted(envs.RELEASE_FILES["gta"])
        assert released.download("gta", tmp_path / "data") == tmp_path / "data" / "gta"
        for name in released.ALL_RELEASE_FILES["gta"]:                  # the lab's: every file
            assert (tmp_path / "data" / "gta" / name).read_bytes() == \
                (release_dir / "gta" / name).read_bytes()
        matched = json.loads((served / "gta" / "matched_clean_test.json").read_text())
        matched[2]["turn_idx"] -= 1
        (served / "gta" / "matched_clean_test.json").write_text(json.dumps(matched))
        with pytest.raises(envs.DataError, match=r"/gta/matched_clean_test.json: record 2 "
                           r"\(episode .*the dialog must end at turn_idx"):
            released.download("gta", tmp_path / "lab")
        assert (tmp_path / "lab" / "gta" / "matched_clean_train.json").is_file()
        assert not (tmp_path / "lab" / "gta" / "matched_clean_test.json").exists()
        (served / "gta" / "clean_test.json").write_text('{"1": {"dialogs": []}}')
        with pytest.raises(envs.DataError, match=r"/gta/clean_test.json: record 1: missing"):
            envs.make("gta", data_dir=tmp_path / "fresh")
        assert not (tmp_path / "fresh" / "gta" / "clean_test.json").exists()
        assert not list((tmp_path / "fresh" / "gta").glob(".*.tmp"))
        (served / "gta" / "clean_train.json").unlink()
        with pytest.raises(envs.DataError, match="clean_train.json: HTTP 404"):
            released.download("gta", tmp_path / "fresh", force=True)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("field, value, message", [
    ("description", 5, "its tools or files do not render"),
    ("input_type", 3, "its tools or files do not render"),
    ("input_description", ["a"], "its tools or files do not render"),
    ("gt_answer", {"whitelist": [["42"]], "blacklist": [[""]]}, "no empty group or alias"),
    ("gt_answer", {"whitelist": [[]]}, "no empty group or alias"),
    ("gt_answer", {"whitelist": [[" "]]}, "no empty group or alias")])
def test_a_record_the_tools_or_scorer_cannot_use_is_named(field, value, message, release_dir,
                                                          tmp_path):
    records = json.loads((release_dir / "gta" / "clean_test.json").read_text())
    key = next(iter(records))
    tool = next(t for t in records[key]["tools"] if t.get("inputs"))
    if field == "gt_answer":
        records[key]["gt_answer"] = value
    elif field == "description":
        tool["description"] = value
    else:
        tool["inputs"][0][field.removeprefix("input_")] = value
    path = tmp_path / "clean_test.json"
    path.write_text(json.dumps(records))
    with pytest.raises(envs.DataError, match=f"clean_test.json: .*{re.escape(message)}"):
        envs.load_episodes(path)


def test_split_episodes_refuses_to_write_over_the_released_files(release_dir, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(release_dir / "toolbench", data / "toolbench")
    before = (data / "toolbench" / "clean_test.json").read_bytes()
    with pytest.raises(envs.DataError, match="would overwrite their test files"):
        released.split_episodes(data, "toolbench", data / "toolbench", episodes=4)
    assert (data / "toolbench" / "clean_test.json").read_bytes() == before


def test_missing_split_is_a_clear_error(tmp_path):
    with pytest.raises(envs.DataError, match="no released 'train' split .* `python -m lab.data "
                       "split-episodes toolbench --out OUT/toolbench` writes one"):
        envs.make("toolbench", "train", tmp_path, toolbench.REPLAYS, judge_model=None)
    with pytest.raises(ValueError, match="unknown environment"):
        envs.make("webshop")


# ---- the OpenAI-compatible client against a fake server on 127.0.0.1 (conftest.fake_openai)

def _client(tmp_path, **kw):
    return toolbench.ChatClient("judge-model", cache_dir=tmp_path / "llm", retry_wait=0.01, **kw)


def test_judge_request_shape_and_cache(fake_openai, tmp_path):
    client = _client(tmp_path)
    fake_openai.reply = lambda body: {"label": "partial", "reason": "one fact missing"}
    assert toolbench.judge_answer(client, "Task?", "Paris, 21 C", "Paris") == 0.5
    (req,) = fake_openai.requests
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-test"
    body = req["body"]
    assert body["model"] == "judge-model" and body["temperature"] == 0
    assert body["response_format"] == {"type": "json_object"}
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert body["messages"][0]["content"] == toolbench.ANSWER_JUDGE_SYSTEM
    assert "Reference answer:\nParis, 21 C" in body["messages"][1]["content"]
    assert "Assistant's final answer:\nParis" in body["messages"][1]["content"]
    again = _client(tmp_path)                     # a new client reads the same disk cache
    assert toolbench.judge_answer(again, "Task?", "Paris, 21 C", "Paris") == 0.5
    assert len(fake_openai.requests) == 1 and again.requests_made == 0
    assert len(list((tmp_path / "llm").glob("*/*.json"))) == 1
    toolbench.judge_answer(again, "Task?", "Paris, 21 C", "Lyon")       # other content, new request
    assert len(fake_openai.requests) == 2


def test_client_retries_a_429_or_500_once(fake_openai, tmp_path):
    fake_openai.script = [(429, {"error": "slow down"})]
    client = _client(tmp_path)
    assert toolbench.judge_answer(client, "t", "r", "a") == 1.0
    assert len(fake_openai.requests) == 2 and client.requests_made == 2
    fake_openai.script = [(500, {}), (503, {})]
    with pytest.raises(toolbench.LLMError, match=r"giving up after 2 attempts \(HTTP 503\)"):
        toolbench.judge_answer(_client(tmp_path), "t", "r", "other")


def test_client_401_fails_at_once(fake_openai, tmp_path):
    fake_openai.script = [(401, {"error": "bad key"})]
    with pytest.raises(toolbench.LLMError, match="HTTP 401.*OPENAI_API_KEY was rejected"):
        toolbench.judge_answer(_client(tmp_path), "t", "r", "a")
    assert len(fake_openai.requests) == 1


def test_bad_replies_are_rejected_and_not_cached(fake_openai, tmp_path):
    fake_openai.reply = lambda body: {"label": "maybe"}
    with pytest.raises(toolbench.BadReply, match="label must be one of"):
        toolbench.judge_answer(_client(tmp_path), "t", "r", "a")
    fake_openai.reply = lambda body: "not json"
    with pytest.raises(toolbench.BadReply):
        toolbench.judge_answer(_client(tmp_path), "t", "r", "a")
    fake_openai.reply = lambda body: {"label": "no"}
    assert toolbench.judge_answer(_client(tmp_path), "t", "r", "a") == 0.0
    assert len(fake_openai.requests) == 3


def test_missing_key_fails_before_any_work(monkeypatch, tmp_path):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(toolbench.LLMError, match="OPENAI_API_KEY is not set"):
        toolbench.ChatClient("m")
    # the data dir does not exist: the key is checked before any load or download
    with pytest.raises(toolbench.LLMError, match="OPENAI_API_KEY is not set"):
        envs.make("toolbench", data_dir=tmp_path / "nowhere", replays=toolbench.REPLAYS)


def test_toolbench_scored_by_the_judge(fake_openai, tmp_path, release_dir):
    env = envs.make("toolbench", data_dir=release_dir, replays=toolbench.REPLAYS,
                    judge_cache=tmp_path / "llm")
    key = env.ids[0]
    record = env.records[key]
    ep = env.episode(key)
    pairs = released.play_gold(ep, record["dialogs"])
    assert pairs and all(a == b for a, b in pairs) and ep.done
    fake_openai.reply = lambda body: {"label": "yes"}
    assert ep.score() == 1.0
    user = fake_openai.requests[-1]["body"]["messages"][1]["content"]
    assert record["gt_answer"]["whitelist"][0][0] in user and ep.final_answer in user
    ep = env.episode(key)
    for _ in range(envs.MAX_TURNS):
        ep.step("hmm")
    assert ep.done and ep.score() == 0.0 and len(fake_openai.requests) == 1


def test_step_judge(fake_openai, tmp_path):
    fake_openai.reply = lambda body: {"score": 7}
    msgs = [{"role": "user", "content": "Task: add 2 and 3.\n\nTools..."},
            {"role": "assistant", "content": "Action: Calculator\nAction Input: {}"},
            {"role": "user", "content": "Observation: 5"},
            {"role": "assistant", "content": "Final Answer: 5"}]
    assert baselines.judge_step(_client(tmp_path), msgs) == pytest.approx(6 / 9)
    user = fake_openai.requests[0]["body"]["messages"][1]["content"]
    assert user.startswith("Task:\nTask: add 2 and 3.")
    assert user.endswith("Latest step to rate:\nFinal Answer: 5")
    assert "Agent:\nAction: Calculator" in user and "Observation: 5" in user
    fake_openai.reply = lambda body: {"score": 11}
    with pytest.raises(toolbench.BadReply):
        baselines.judge_step(_client(tmp_path), msgs[:2])


# ---- contamination -------------------------------------------------------------------------------

def test_contaminate_rewrites_one_turn_per_episode(fake_openai, tmp_path, release_dir):
    source = envs.load_episodes(release_dir / "gta" / "clean_test.json")
    small = {k: source[k] for k in list(source)[:12]}
    data = tmp_path / "clean_small.json"
    data.write_text(json.dumps(small))
    fake_openai.reply = lambda body: {"thought": "A wrong but fluent thought.",
                                      "action": "OCR", "action_input": {"image": "wrong.jpg"}}
    out = tmp_path / "contaminated_small.json"
    counts = released.contaminate_file(data, out, _client(tmp_path), seed=3)
    n_requests = len(fake_openai.requests)
    result = envs.load_episodes(out)
    eligible = [k for k, r in small.items()
                if 3 <= len(released.assistant_positions(r["dialogs"])) <= 8]
    assert sorted(result) == sorted(eligible) and n_requests == len(eligible) >= 5
    assert counts == {"ok": len(eligible), "turns_out_of_range": len(small) - len(eligible)}
    kinds = set()
    for key, rec in result.items():
        orig = small[key]["dialogs"]
        (idx,), (kind,) = rec["contaminated_turn_indices"], rec["contamination_types"]
        kinds.add(kind)
        assert idx in released.assistant_positions(orig)[:-1]     # never the evaluation turn
        assert kind in released.compatible_types(orig, idx)
        assert rec["original_turn_contents"] == [orig[idx]]
        assert json.loads(rec["contamination_responses"][0])["thought"] == \
            "A wrong but fluent thought."
        assert len(rec["dialogs"]) == len(orig)
        assert [i for i, (a, b) in enumerate(zip(orig, rec["dialogs"])) if a != b] == [idx]
        thought, call, _ = envs.assistant_parts(rec["dialogs"][idx])
        old_thought, old_call, _ = envs.assistant_parts(orig[idx])
        if kind == "tool_misuse":
            assert call == {"name": "OCR", "arguments": {"image": "wrong.jpg"}}
            assert thought == old_thought
        else:
            assert thought == "A wrong but fluent thought."
            assert call == (old_call if kind != "stale_memory" else
                            {"name": "OCR", "arguments": {"image": "wrong.jpg"}})
    assert len(kinds) >= 2
    systems = {r["body"]["messages"][0]["content"] for r in fake_openai.requests}
    assert systems <= set(released.CONTAMINATION_SYSTEM.values()) and len(systems) == len(kinds)
    # deterministic given the seed; the second run is served from the cache
    again = tmp_path / "again.json"
    released.contaminate_file(data, again, _client(tmp_path), seed=3)
    assert again.read_bytes() == out.read_bytes() and len(fake_openai.requests) == n_requests
    released.contaminate_file(data, tmp_path / "other.json", _client(tmp_path), seed=4)
    assert (tmp_path / "other.json").read_bytes() != out.read_bytes()


def test_contaminate_leaves_out_a_reply_utf8_cannot_hold(fake_openai, tmp_path, release_dir):
    source = envs.load_episodes(release_dir / "gta" / "clean_test.json")
    data = tmp_path / "clean_small.json"
    data.write_text(json.dumps({k: source[k] for k in list(source)[:6]}))
    # the JSON escape decodes to half a surrogate pair: no UTF-8 file can hold the thought
    fake_openai.reply = lambda body: {"thought": "wrong \ud800 idea", "action": "OCR",
                                      "action_input": {"image": "x\udc00.jpg"}}
    out = tmp_path / "contaminated_small.json"
    with pytest.raises(envs.DataError, match="no episode was contaminated .*'bad_reply': [1-9]"):
        released.contaminate_file(data, out, _client(tmp_path), seed=3)
    assert not out.exists()


def test_contaminate_refuses_to_replace_its_input_or_to_select_nothing(tmp_path, release_dir):
    data = tmp_path / "clean.json"
    shutil.copy(release_dir / "gta" / "clean_test.json", data)
    before = data.read_bytes()
    for out, lo, hi, why in ((data, 3, 8, "is --data"), (tmp_path / "a.json", 5, 2, "5 > --max"),
                             (tmp_path / "b.json", 1, 8, "--min-turns 1: at least 2")):
        r = subprocess.run([sys.executable, "-m", "lab.data", "contaminate", "--data",
                            str(data), "--out", str(out), "--min-turns", str(lo),
                            "--max-turns", str(hi)], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "OPENAI_API_KEY": "x",
                                "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"})
        assert r.returncode == 1 and r.stderr.startswith("error: ") and why in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    assert data.read_bytes() == before and not list(tmp_path.glob("[ab].json"))


def test_contaminate_prompt_for_observation_misinterpretation(release_dir):
    rec = envs.load_episodes(release_dir / "gta" / "clean_test.json")["1"]
    idx = released.assistant_positions(rec["dialogs"])[1]
    assert released.compatible_types(rec["dialogs"], idx) == [
        "reasoning_error", "tool_misuse", "observation_misinterpretation", "stale_memory"]
    assert released.compatible_types(rec["dialogs"], 1) == ["reasoning_error", "tool_misuse",
                                                            "stale_memory"]
    system, user = released.contamination_messages(rec, idx, "observation_misinterpretation")
    text = user["content"]
    assert "The observation immediately before the target step:\nObservation: The image " \
        "features a group of five people" in text
    assert text.index("Trajectory before the target step:") < text.index("Target step (step 2")
    assert text.split("Target step (step 2 of 6), to rewrite with a observation "
                      "misinterpretation error:\n")[1].startswith(
        envs.render_assistant(rec["dialogs"][idx]))


def test_cli_help():
    for args in ([], ["download"], ["contaminate"], ["make-diagnostic"], ["replay"]):
        out = subprocess.run([sys.executable, "-m", "lab.data", *args, "--help"],
                             capture_output=True, text=True, check=True).stdout
        assert "usage:" in out


def test_a_data_dir_that_is_the_family_folder_itself_is_one_line(release_dir, tmp_path):
    gta = tmp_path / "gta"
    shutil.copytree(release_dir / "gta", gta)
    for run in (lambda: data_command.main(["make-diagnostic", "gta", "--data-dir", str(gta)]),
                lambda: data_command.main(["split-episodes", "gta", "--data-dir", str(gta),
                                       "--out", str(tmp_path / "out")])):
        with pytest.raises(SystemExit, match="--data-dir .*holds the gta files itself"):
            run()
    assert not (gta / "gta").exists()                   # nothing was downloaded beside it
