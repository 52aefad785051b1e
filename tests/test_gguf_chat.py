"""`run --chat`: a GGUF file's `tokenizer.chat_template` (Jinja) applied to the --prompt text as one user message, as
transformers' apply_chat_template renders it (add_generation_prompt, the file's bos/eos tokens as text), then
tokenized with its control tokens as themselves and no BOS added; a file without a template, a missing jinja2, and
--chat without text each end in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("tokenizers")

import gguf_files as gf  # noqa: E402
from lanefuse.engine.errors import UserError  # noqa: E402
from lanefuse.engine.front.gguf import open_reader  # noqa: E402
from lanefuse.engine.front.gguf_vocab import chat_text, tokenizer_from_gguf  # noqa: E402

# ChatML as SmolLM's instruct files hold it: a system turn when none is given, the generation prompt at the end
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# a Llama 3 style template: the BOS token written by the template, a raise_exception on a bad role
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{% if message['role'] not in ['user', 'assistant'] %}"
          "{{ raise_exception('roles are user and assistant') }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n\n' + message['content'] | trim + eos_token }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n\n' }}{% endif %}")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>")  # ids 0..3: eos 0, bos 3


def _file(tmp_path, template, name="chat.gguf"):
    _, *tokenizer = gf.bpe_tokenizer(400, "smollm", specials=SPECIALS)
    return gf.write_vocab_gguf(tmp_path / name, tokenizer, "smollm", bos=3, eos=0, chat_template=template)


@pytest.mark.parametrize("template,want", [  # the trailing space: trimmed by LLAMA3's `trim` alone
    (CHATML, "<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n"
             "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"),
    (LLAMA3, "<s><|im_start|>user\n\nhello there<|endoftext|><|im_start|>assistant\n\n")])
def test_chat_template_renders_a_user_message(tmp_path, template, want):
    pytest.importorskip("jinja2")
    path = _file(tmp_path, template)
    text = chat_text(open_reader(path), str(path), "hello there ")
    assert text == (want.replace("there<", "there <") if template is CHATML else want)


def test_chat_template_as_transformers_renders_it(tmp_path):
    pytest.importorskip("jinja2")
    transformers = pytest.importorskip("transformers")
    path = _file(tmp_path, CHATML)
    tok = tokenizer_from_gguf(open_reader(path), str(path))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="<|endoftext|>")
    msgs = [{"role": "user", "content": "What is 2+2?  Ünïcödé 中文"}]
    want = fast.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, chat_template=CHATML)
    assert chat_text(open_reader(path), str(path), msgs[0]["content"]) == want


def test_chat_refusals(tmp_path, monkeypatch):
    pytest.importorskip("jinja2")
    bare = _file(tmp_path, None, "bare.gguf")
    with pytest.raises(UserError, match=r"holds no chat template \(`tokenizer.chat_template`\)"):
        chat_text(open_reader(bare), str(bare), "hi")
    bad = _file(tmp_path, "{{ raise_exception('no system role here') }}", "bad.gguf")
    with pytest.raises(UserError, match="its chat template .* fails: no system role here"):
        chat_text(open_reader(bad), str(bad), "hi")
    path = _file(tmp_path, CHATML)
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(UserError, match=r"--chat needs the `jinja2` package"):
        chat_text(open_reader(path), str(path), "hi")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_run_chat_on_a_gguf_file(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("jinja2")
    tok, tokens, merges, types = gf.bpe_tokenizer(400, "smollm", specials=SPECIALS)
    model = gf.tiny_model("llama", hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=96, vocab_size=400)
    path = gf.write_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=(tokens, merges, types), pre="smollm", bos=3,
                         chat_template=CHATML)
    c = _cli("run", str(path), "--prompt", "hello", "--chat", "--tokens", "2", "--json", "-", "--reference")
    assert c.returncode == 0, c.stderr
    got = json.loads(c.stdout)["prompt_ids"]
    mine = tokenizer_from_gguf(open_reader(path), str(path))
    want = mine.encode(chat_text(open_reader(path), str(path), "hello"), add_special_tokens=False).ids
    assert got == want and got[0] == 1 and got.count(1) == 3  # <|im_start|> three times, as itself
    for args, msg in ((("--prompt-ids", "1,2", "--chat"), "--chat puts --prompt TEXT through the chat template"),):
        c = _cli("run", str(path), *args, "--tokens", "1")
        err = [ln for ln in c.stderr.splitlines() if ln.startswith("lanefuse: error:")]
        assert c.returncode == 2 and len(err) == 1 and msg in err[0], c.stderr
    bare = gf.write_gguf(model, tmp_path / "bare.gguf", "f32", tokenizer=(tokens, merges, types), pre="smollm")
    c = _cli("run", str(bare), "--prompt", "hello", "--chat", "--tokens", "1")
    err = [ln for ln in c.stderr.splitlines() if ln.startswith("lanefuse: error:")]
    assert c.returncode == 2 and err == [f"lanefuse: error: {bare}: the file holds no chat template "
                                         f"(`tokenizer.chat_template`); give the prompt without --chat"], c.stderr
