"""METHOD.md §2/§3 end to end: every released GTA dialog, rendered by envs.dialog_to_messages and
model.Tokenizer (as text: lab/sft.py's chat_text), equals Qwen's reference chat template rendered
by jinja2, and the assistant spans cover exactly the assistant contents."""
import pytest

import envs
from lab.policies import sft
from lab.worlds import released as lab_data

jinja2 = pytest.importorskip("jinja2")
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402

GTA_FILES = [f"{kind}{part}_{split}.json" for kind in ("", "matched_")
             for part in ("clean", "contaminated") for split in ("train", "test")]


_TOKENIZERS = {}


@pytest.fixture
def tok(qwen_tokenizer_dir):
    model = pytest.importorskip("model")
    if not hasattr(model, "Tokenizer"):
        pytest.skip("model.Tokenizer is not written yet")
    if qwen_tokenizer_dir not in _TOKENIZERS:       # load once for all parametrized cases
        _TOKENIZERS[qwen_tokenizer_dir] = model.Tokenizer.from_file(qwen_tokenizer_dir)
    return _TOKENIZERS[qwen_tokenizer_dir]


@pytest.fixture
def template(qwen_tokenizer_dir):
    # The jinja2 environment transformers renders chat templates with.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string((qwen_tokenizer_dir / "chat_template.jinja").read_text())


def _records(folder, name):
    if name.startswith("matched_"):
        return lab_data.load_matched(folder / name)
    return list(envs.load_episodes(folder / name).values())


@pytest.mark.parametrize("name", GTA_FILES)
def test_released_gta_dialogs_render_like_the_reference_template(name, release_dir, tok,
                                                                 template):
    records = _records(release_dir / "gta", name)
    assert records
    for i, rec in enumerate(records):
        messages = lab_data.record_messages(rec)
        for gen in (False, True):
            expected = template.render(messages=messages, add_generation_prompt=gen)
            assert sft.chat_text(messages, add_generation_prompt=gen) == expected, (name, i)
        ids, spans = tok.render(messages)
        assistants = [m["content"] for m in messages if m["role"] == "assistant"]
        assert len(spans) == len(assistants), (name, i)
        for (s, e), content in zip(spans, assistants):
            assert tok.decode(ids[s:e]) == content + "<|im_end|>", (name, i)
            assert ids[e - 1] == tok.im_end_id and ids[s - 1] == tok.encode("\n")[0]


def test_env_prompt_renders_like_the_reference_template(release_dir, tok, template):
    env = envs.make("gta", split="test", data_dir=release_dir)
    ep = env.episode(0)
    ep.step("Thought: look first\nAction: OCR\nAction Input: {\"image\": \"image/x.jpg\"}")
    expected = template.render(messages=ep.messages, add_generation_prompt=True)
    assert sft.chat_text(ep.messages, add_generation_prompt=True) == expected
    assert expected.endswith("<|im_end|>\n<|im_start|>assistant\n")
