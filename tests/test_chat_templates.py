"""Chat templates render as transformers' ``apply_chat_template`` renders them: the same ids for templates real
checkpoints ship (their constructs: ``tools is not none``, ``strftime_now``, ``{% generation %}``, ``tojson`` with
keywords, ``namespace``, special tokens kept only in ``special_tokens_map.json``); a template that runs too long or
writes too much is refused by name before the tokenizer sees its text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graphc.chat import ChatTemplateError, render_chat
from graphc.checkpoint import Checkpoint
from graphc.cli import main

from checkpoints import write_tokenizer

MISTRAL_V03 = (  # the tools branch of Mistral-7B-Instruct-v0.3's template, as shipped
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if tools is not none and (message == loop_messages[-1]) %}{{- '[AVAILABLE_TOOLS] [' }}"
    "{%- for tool in tools %}{{- tool|tojson }}{%- endfor %}{{- '][/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}{%- endfor %}"
)
LLAMA_32 = (  # Llama-3.2-Instruct's date header: strftime_now, and date_string when defined
    "{{- bos_token }}{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    '{%- set date_string = strftime_now("%d %b %Y") %}{%- else %}{%- set date_string = "26 Jul 2024" %}{%- endif %}{%- endif %}'
    '{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}'
    "{{- 'system\\n\\n' }}{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}{%- if documents is not none %}docs{%- endif %}"
    "{%- for message in messages %}{{- message['role'] + ': ' + message['content'] | trim + ' ' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}"
)
CONSTRUCTS = (  # {% generation %}, tojson keywords, namespace, a direct strftime_now, loop controls
    "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% if m['role'] == 'user' %}{{ m['content'] }} {% generation %}{{ m | tojson(ensure_ascii=True, sort_keys=True) }}{% endgeneration %}"
    "{% else %}{% continue %}{% endif %}{% endfor %} {{ ns.n }} {{ strftime_now('%Y') }} {{ eos_token }}"
)
MESSAGES = ["the cat sat on", "a big red dog ran to the ü"]


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    """A folder whose tokenizer files transformers wrote; the special tokens live in ``special_tokens_map.json`` only."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("chat")
    write_tokenizer(out / "raw.json")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "raw.json"))
    fast.save_pretrained(out)
    (out / "raw.json").unlink()
    config = json.loads((out / "tokenizer_config.json").read_text())
    config = {k: v for k, v in config.items() if not k.endswith("_token") and k != "added_tokens_decoder"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    (out / "config.json").write_text("{}")
    return out


@pytest.mark.parametrize("template", [MISTRAL_V03, LLAMA_32, CONSTRUCTS], ids=["mistral-v0.3", "llama-3.2", "constructs"])
def test_chat_templates_give_transformers_ids(tokenizer_folder, tmp_path, template):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for p in tokenizer_folder.iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    (folder / "chat_template.jinja").write_text(template)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.bos_token == "<s>"  # from the map alone
    for text in MESSAGES:
        messages = [{"role": "user", "content": text}]
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert Checkpoint(folder).chat_template() == template
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert want.startswith("<s>") and "[AVAILABLE_TOOLS]" not in want and "ipython" not in want
        assert Checkpoint(folder).chat_prompt(text) == list(ids)


def test_a_template_that_loops_without_end_is_stopped_and_named(tmp_path, capsys):
    template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match=r"ran for more than 0.2 s"):
        render_chat(template, [{"role": "user", "content": "x"}], {}, seconds=0.2)


def test_a_template_that_writes_too_much_is_refused_before_the_tokenizer(tmp_path):
    template = "{% for i in range(100000) %}{{ messages[0]['content'] * 1000 }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="wrote more than 1,000,000 characters"):
        render_chat(template, [{"role": "user", "content": "abc"}], {}, max_chars=10**6)


def test_raise_exception_and_a_syntax_error_are_named():
    with pytest.raises(ChatTemplateError, match="refused the conversation: only user turns"):
        render_chat("{{ raise_exception('only user turns') }}", [], {})
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat("{% for %}", [], {})


def test_the_sandbox_still_holds():
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        render_chat("{{ ''.__class__.__mro__[1].__subclasses__() }}", [], {})
    with pytest.raises(ChatTemplateError, match="underscore"):
        render_chat("{% set ns = namespace(_x=1) %}", [], {})


def test_prompts_that_are_not_text_or_too_long_are_named(tmp_path, capsys):
    from graphc.checkpoint import Tokenizer
    from graphc.errors import SerializationError

    write_tokenizer(tmp_path / "tokenizer.json")
    tok = Tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(SerializationError, match="encodes text"):
        tok.encode(None)  # type: ignore[arg-type]
    with pytest.raises(SerializationError, match="not valid Unicode"):
        tok.encode("caf\udce9")  # what a non-UTF-8 argv byte becomes
    with pytest.raises(SerializationError, match="past the"):
        tok.encode("a" * (1 << 23))
    with pytest.raises(SerializationError, match="token id -1 is not in the tokenizer's vocabulary"):
        tok.decode([-1])
    assert tok.decode(tok.encode("the cat")) == "the cat"


def test_a_wordlevel_tokenizer_without_unk_is_named(tmp_path):
    from tokenizers import Tokenizer as RawTokenizer, models, pre_tokenizers

    from graphc.checkpoint import Tokenizer
    from graphc.errors import SerializationError

    raw = RawTokenizer(models.WordLevel({"the": 0, "cat": 1}))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(SerializationError, match="cannot encode the prompt"):
        Tokenizer(tmp_path / "tokenizer.json").encode("the dog")


def test_generate_chat_with_a_hanging_template_exits_in_one_line(tmp_path, capsys, monkeypatch):
    from checkpoints import write_checkpoint

    folder = write_checkpoint(tmp_path / "ckpt")
    (folder / "chat_template.jinja").write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    monkeypatch.setattr("graphc.chat.RENDER_SECONDS", 0.3)
    assert main(["generate", str(folder), "--chat", "--prompt", "the cat", "--max-new-tokens", "1", "--backends", "numpy"]) == 2
    assert "ran for more than 0.3 s" in capsys.readouterr().err
