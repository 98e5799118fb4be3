"""An OpenAI-compatible chat client, and every prompt this project sends through it.

Three uses, all optional (nothing else in the project calls a model over the network):
  * the ToolBench answer judge (paper Appendix eval): yes 1 / partial 0.5 / no 0 for a final
    answer against the reference (`judge_answer`);
  * the LLM-as-a-judge baseline reward (paper §4, Appendix prompts): a 1-10 score of each step
    (`judge_step`);
  * the contamination of released episodes (paper Appendix contam_procedure): the system prompt
    of each error type (`CONTAMINATION_SYSTEM`; envs.py builds the user prompt and applies the
    reply).
Any server that speaks POST /chat/completions works: OPENAI_BASE_URL and OPENAI_API_KEY.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

import requests

import common


class LLMError(RuntimeError):
    pass


class AuthError(LLMError):
    pass


class BadReply(LLMError):
    """The endpoint answered, but not with the JSON object asked for."""


class ChatClient:
    """POST {OPENAI_BASE_URL}/chat/completions with requests, JSON-object replies only.

    Replies are cached on disk under the SHA-256 of the request body (model, messages,
    temperature, max_tokens, response format), so a repeated call makes no request and an
    interrupted run resumes. 429, 5xx and connection errors are retried with exponential backoff
    (Retry-After honoured); 401 fails at once. A missing key fails in the constructor, before
    any work starts.
    """

    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None,
                 cache_dir: str | Path | None = None, max_retries: int = 6,
                 backoff: float = 1.0, timeout: float = 120.0):
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY")
        if not self.api_key:
            raise LLMError("OPENAI_API_KEY is not set: the LLM judge and the contamination "
                           "generator need an OpenAI-compatible endpoint (OPENAI_API_KEY, and "
                           "OPENAI_BASE_URL for a server other than api.openai.com)")
        self.model = model
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL")
                         or "https://api.openai.com/v1").rstrip("/")
        self.cache_dir = Path(cache_dir) if cache_dir else common.cache_root() / "llm"
        self.max_retries = max_retries
        self.backoff = backoff
        self.timeout = timeout
        self.session = requests.Session()
        self.requests_made = 0          # HTTP requests sent (cache hits send none)

    def chat_json(self, messages: list[dict], check=None, temperature: float = 0.0,
                  max_tokens: int = 512) -> tuple[dict, str]:
        """(parsed JSON object, raw reply). `check(obj)` may raise ValueError to reject a reply;
        a rejected or unparsable reply raises BadReply and is not cached."""
        body = {"model": self.model, "messages": messages, "temperature": temperature,
                "max_tokens": max_tokens, "response_format": {"type": "json_object"}}
        digest = hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False)
                                .encode("utf-8")).hexdigest()
        path = self.cache_dir / digest[:2] / f"{digest}.json"
        if path.is_file():
            try:
                raw = json.loads(path.read_text(encoding="utf-8"))["reply"]
                return _checked_json(raw, check), raw
            except (ValueError, KeyError, TypeError):
                pass                        # unreadable entry: ask again and overwrite it
        raw = self._post(body)
        try:
            obj = _checked_json(raw, check)
        except ValueError as e:
            raise BadReply(f"{self.model} replied with an unusable answer ({e}): "
                           f"{raw[:300]!r}") from e
        common.write_atomic(path, json.dumps({"request": body, "reply": raw},
                                      ensure_ascii=False).encode("utf-8"))
        return obj, raw

    def _post(self, body: dict) -> str:
        url = f"{self.base_url}/chat/completions"
        headers = {"Authorization": f"Bearer {self.api_key}"}
        for attempt in range(self.max_retries + 1):
            wait = self.backoff * 2 ** attempt
            try:
                self.requests_made += 1
                r = self.session.post(url, json=body, headers=headers, timeout=self.timeout)
            except (requests.ConnectionError, requests.Timeout) as e:
                problem = f"connection error: {e}"
            else:
                if r.status_code == 200:
                    try:
                        return r.json()["choices"][0]["message"]["content"]
                    except (ValueError, KeyError, IndexError, TypeError) as e:
                        raise LLMError(f"{url}: unexpected reply {r.text[:300]!r}") from e
                if r.status_code == 401:
                    raise AuthError(f"{url} answered 401 Unauthorized: the key in "
                                    "OPENAI_API_KEY was rejected")
                if r.status_code != 429 and r.status_code < 500:
                    raise LLMError(f"{url} answered HTTP {r.status_code}: {r.text[:300]}")
                problem = f"HTTP {r.status_code}"
                try:
                    wait = max(wait, float(r.headers.get("Retry-After", 0)))
                except ValueError:
                    pass
            if attempt == self.max_retries:
                raise LLMError(f"{url}: giving up after {attempt + 1} attempts ({problem})")
            time.sleep(min(wait, 60.0))
        raise AssertionError("unreachable")


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


# ---- the ToolBench answer judge (paper Appendix eval) -----------------------------------------

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


# ---- the per-step LLM-as-a-judge baseline reward (paper §4, Appendix prompts) -----------------

STEP_JUDGE_SYSTEM = """\
You are an expert evaluator of tool-using AI agents. You see a task (with the agent's tools and
reply format), the agent's trajectory so far, and its latest step. Rate the quality of the latest
step alone, on a scale from 1 to 10:
- 9-10: correct and necessary; it clearly advances the task. Its reasoning is faithful to the
  observations and its tool call and arguments are right (or it is a correct final answer).
- 7-8: correct and useful, with a minor inefficiency or imprecision.
- 5-6: partly useful: plausible but redundant, vague, or weakly justified.
- 3-4: mostly wrong: it misreads an observation, picks a wrong tool or wrong arguments, or
  reasons in a flawed way.
- 1-2: harmful or invalid: invented facts, a contradiction of the observations, a malformed
  action, or a wrong final answer.
Do not reward length or confident tone. Reply with a JSON object only: {"score": <integer 1-10>}"""


def judge_step(client: ChatClient, messages: list[dict]) -> float:
    """The LLM-as-a-judge step reward in [0, 1]: (score - 1) / 9 for a 1-10 judgment of the last
    message of `messages` (METHOD.md §2 chat: task first, the assistant turn to rate last)."""
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        raise ValueError("judge_step needs a chat ending with the assistant turn to rate")

    def check(obj):
        s = obj.get("score")
        if type(s) is not int or not 1 <= s <= 10:
            raise ValueError("score must be an integer from 1 to 10")
    history = "\n\n".join(("Agent:\n" if m["role"] == "assistant" else "") + m["content"]
                          for m in messages[1:-1]) or "(no earlier steps)"
    user = (f"Task:\n{messages[0]['content']}\n\nTrajectory so far:\n{history}\n\n"
            f"Latest step to rate:\n{messages[-1]['content']}")
    obj, _ = client.chat_json([{"role": "system", "content": STEP_JUDGE_SYSTEM},
                               {"role": "user", "content": user}], check=check)
    return (obj["score"] - 1) / 9


# ---- contamination of released episodes (paper Appendix contam_procedure): one system prompt
# per error type; envs.contaminate_record writes the user prompt and applies the reply ----------

_CONTAMINATION_PREAMBLE = """\
You help build a benchmark of errors made by tool-using AI agents. You receive an agent's task,
its trajectory so far, and one target step. Rewrite the target step so that it stays fluent,
confident, and consistent in style and length with the original, yet is objectively incorrect in
the specific way described below - the kind of mistake a reasonable but mistaken agent could
make. Never hint that the step is wrong: no disclaimers, apologies, or meta comments.
"""


CONTAMINATION_SYSTEM = {
    "reasoning_error": _CONTAMINATION_PREAMBLE + """
Error type: reasoning error. Rewrite the step's Thought so that it contains a logically flawed
inference - for example a wrong calculation or comparison, an unjustified conclusion, a mistaken
plan, or two entities confused - while reading as coherent with the conversation. The tool call
(if any) stays as it is and is not part of your reply.
Reply with a JSON object only: {"thought": "<the rewritten thought>"}""",
    "tool_misuse": _CONTAMINATION_PREAMBLE + """
Error type: tool misuse. Rewrite the step's tool call: call an inappropriate tool from the
available list, supply a malformed argument, or call the right tool with semantically wrong
parameters (a wrong value, entity, file, date or unit). The call must stay syntactically valid: a
tool name and a JSON object of arguments. The thought stays as it is.
Reply with a JSON object only: {"action": "<tool name>", "action_input": {<arguments>}}""",
    "observation_misinterpretation": _CONTAMINATION_PREAMBLE + """
Error type: observation misinterpretation. Rewrite the step's Thought so that it reaches a
conclusion inconsistent with the immediately preceding observation - for example claiming a call
succeeded when it failed, reading the wrong field or number, or misreporting a value. The tool
call (if any) stays as it is and is not part of your reply.
Reply with a JSON object only: {"thought": "<the rewritten thought>"}""",
    "stale_memory": _CONTAMINATION_PREAMBLE + """
Error type: stale memory. Rewrite the step so that it relies on information from earlier in the
trajectory in a way that contradicts later evidence - for example it carries an outdated value,
a superseded plan, or an earlier result that a later observation corrected, as if it were
current. Rewrite the Thought and, if the step calls a tool, the call consistently with the stale
belief (keep the call unchanged if the stale belief does not affect it).
Reply with a JSON object only: {"thought": "<the rewritten thought>"} for a step without a tool
call, else {"thought": "...", "action": "<tool name>", "action_input": {<arguments>}}""",
}
