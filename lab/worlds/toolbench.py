"""ToolBench (METHOD.md §10): its replay with the paper's history cap, answers scored by an LLM
judge at any OpenAI-compatible endpoint, and that endpoint's client (also the lab's contamination
generator and step judge). ToolBench releases no training split and its scorer is a paid API, so
it is the lab's: `python -m lab.train --env toolbench` (REPLAYS below adds it to the core's).

    env = envs.make("toolbench", split="test", data_dir=..., judge_model="gpt-4o-mini")
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

import requests

import envs
import model

HISTORY_CHARS = 6000
ELIDED_OBSERVATION = "Observation: [older observation elided]"


class ToolBenchEpisode(envs.ReplayEpisode):
    """Replay with the paper's history cap: after each observation, while the messages after the
    task exceed `history_chars`, the oldest observation but the newest becomes
    ELIDED_OBSERVATION. The policy's own turns are never changed."""

    def __init__(self, key: str, record: dict, history_chars: int | None = HISTORY_CHARS,
                 judge: ChatClient | None = None):
        super().__init__(key, record)
        self.history_chars, self.judge = history_chars, judge
        self.skip_reason = None if toolbench_reference(self.gt_answer) else "no_answer"

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

    def answer_score(self) -> float:
        if self.judge is None:
            raise LLMError("ToolBench scoring needs the LLM judge: make('toolbench', "
                           "judge_model=...)")
        return judge_answer(self.judge, self.task, toolbench_reference(self.gt_answer),
                            self.final_answer)


def toolbench_reference(gt) -> str:
    if isinstance(gt, dict):
        return "\n".join(g[0] for g in gt.get("whitelist") or [] if g and g[0].strip())
    if isinstance(gt, list):
        return "\n".join(a for a in gt if a.strip())
    return ""


class ToolBenchEnv(envs.Env):
    """A released ToolBench split: the history cap `history_chars`; `judge_model` scores answers,
    None plays without scoring."""

    def __init__(self, split: str = "test", data_dir=None,
                 history_chars: int | None = HISTORY_CHARS,
                 judge_model: str | None = "gpt-4o-mini", judge_cache=None):
        # The judge first: a missing key must fail before any data is read or fetched.
        self.judge = ChatClient(judge_model, judge_cache) if judge_model else None
        super().__init__(envs.load_episodes(envs.episode_file("toolbench", split, data_dir)))
        self.history_chars = history_chars

    def _new_episode(self, key: str, record: dict) -> ToolBenchEpisode:
        return ToolBenchEpisode(key, record, self.history_chars, self.judge)


# The lab's table of replayed families: the core's, with ToolBench (`--env toolbench` in
# `python -m lab.train`; envs.make("toolbench", ..., replays=REPLAYS))
REPLAYS = {**envs.REPLAYS, "toolbench": ToolBenchEnv}


# ---- An LLM at an OpenAI-compatible endpoint ----------------------------------------------------

class LLMError(RuntimeError):
    """An LLM endpoint failed, or none can be used (no key, no judge given)."""


class BadReply(LLMError):
    """The endpoint answered, but not with the JSON object asked for."""


class ChatClient:
    """POST {OPENAI_BASE_URL}/chat/completions for a JSON object, the reply cached on disk under
    the SHA-256 of the request (a repeated call sends nothing, a stopped run resumes)."""

    def __init__(self, model_name: str, cache_dir: str | Path | None = None,
                 retry_wait: float = 5.0):
        self.api_key = os.environ.get("OPENAI_API_KEY")
        if not self.api_key:
            raise LLMError("OPENAI_API_KEY is not set: the LLM judge and the contamination "
                           "generator need an OpenAI-compatible endpoint (OPENAI_API_KEY, and "
                           "OPENAI_BASE_URL for a server other than api.openai.com)")
        base = os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"
        self.url = base.rstrip("/") + "/chat/completions"
        self.model, self.retry_wait, self.requests_made = model_name, retry_wait, 0
        self.cache_dir = Path(cache_dir) if cache_dir else model.cache_root() / "llm"

    def chat_json(self, messages: list[dict], check=None, max_tokens: int = 512
                  ) -> tuple[dict, str]:
        """(JSON object, raw reply) at temperature 0. A reply that is no JSON object or that
        `check(obj)` rejects (ValueError) is a BadReply, not cached; a 429, a 5xx or a
        connection error is retried once."""
        body = {"model": self.model, "messages": messages, "temperature": 0.0,
                "max_tokens": max_tokens, "response_format": {"type": "json_object"}}
        digest = hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False)
                                .encode("utf-8")).hexdigest()
        path = self.cache_dir / digest[:2] / f"{digest}.json"
        try:            # an unreadable entry, or one `check` rejects, is asked again
            raw = json.loads(path.read_text(encoding="utf-8"))["reply"]
            return _checked_json(raw, check), raw
        except (OSError, ValueError, KeyError, TypeError):
            pass
        for attempt in (1, 2):
            self.requests_made += 1
            try:
                r = requests.post(self.url, json=body, timeout=120,
                                  headers={"Authorization": f"Bearer {self.api_key}"})
                problem = f"HTTP {r.status_code}"
                if r.status_code != 429 and r.status_code < 500:
                    break
            except (requests.ConnectionError, requests.Timeout) as e:
                problem = f"connection error: {e}"
            if attempt == 1:
                time.sleep(self.retry_wait)
        else:
            raise LLMError(f"{self.url}: giving up after 2 attempts ({problem})")
        if r.status_code != 200:
            raise LLMError(f"{self.url} answered {problem}: {r.text[:300]}" + (
                " (the key in OPENAI_API_KEY was rejected)" if r.status_code == 401 else ""))
        try:
            raw = r.json()["choices"][0]["message"]["content"]
            obj = _checked_json(raw, check)
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise BadReply(f"{self.model} replied with an unusable answer ({e}): "
                           f"{r.text[:300]!r}") from e
        model.write_atomic(path, json.dumps({"request": body, "reply": raw},
                                            ensure_ascii=False).encode("utf-8"))
        return obj, raw


def _checked_json(raw: str, check) -> dict:
    text = raw.strip()
    if text.startswith("```"):      # tolerate a fenced reply from servers without JSON mode
        text = re.sub(r"^```[A-Za-z]*\s*|\s*```$", "", text)
    obj = json.loads(text)
    if not isinstance(obj, dict):
        raise ValueError("the reply is not a JSON object")
    if check is not None:
        check(obj)
    return obj


ANSWER_JUDGE_SYSTEM = """\
You grade the final answer of a tool-using assistant against a reference answer.
The reference was written from the tool outputs recorded when the task was collected; judge the
answer against the reference's key facts - named entities, numbers, dates and stated relations -
not against your own knowledge. Wording, order and formatting differences do not matter.
Labels:
- "yes": the answer captures most of the reference's key facts.
- "partial": it captures some key facts, with minor omissions or local errors.
- "no": a refusal, an empty or off-topic answer, or most key facts missing or wrong.
Reply with a JSON object only: {"label": "yes" | "partial" | "no", "reason": "<one sentence>"}"""
ANSWER_LABELS = {"yes": 1.0, "partial": 0.5, "no": 0.0}


def judge_answer(client: ChatClient, task: str, reference: str, answer: str) -> float:
    """yes 1.0 / partial 0.5 / no 0.0 for `answer` against `reference` (temperature 0)."""
    def check(obj):
        if obj.get("label") not in ANSWER_LABELS:
            raise ValueError(f"label must be one of {', '.join(ANSWER_LABELS)}")
    user = (f"Task:\n{task.strip()}\n\nReference answer:\n{reference.strip()}\n\n"
            f"Assistant's final answer:\n{answer.strip()}")
    obj, _ = client.chat_json([{"role": "system", "content": ANSWER_JUDGE_SYSTEM},
                               {"role": "user", "content": user}], check=check)
    return ANSWER_LABELS[obj["label"]]
