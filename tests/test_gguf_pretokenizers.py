"""The pre-tokenizers llama.cpp builds for byte-level BPE GGUF files (`tokenizer.ggml.pre`), restated for the
`tokenizers` package in engine/front/gguf_vocab.py: each one's words pinned on two strings (CPU, no llama.cpp), every name
building a tokenizer that round-trips a corpus of code, digits, whitespace runs, accents and CJK, the names it refuses
said in one line; and, with llama-cpp-python, token ids equal to llama.cpp's on that corpus for every name (a
vocabulary trained on the corpus with that pre-tokenizer, so the merges meet every kind of word)."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

import gguf_files as gf  # noqa: E402
from lanefuse.engine.errors import UserError  # noqa: E402
from lanefuse.engine.front.gguf import open_reader  # noqa: E402
from lanefuse.engine.front.gguf_vocab import NOT_BUILT, PRES, tokenizer_from_gguf, words  # noqa: E402

CORPUS = [
    "def area(r):\n    return 3.14159 * r ** 2  # a circle's\n\n\tprint(f\"{area(2):>10.3f}\")\n",
    "Numbers: 1234567, 12, 123, 1,000,000 and 2024-12-04T23:59:59Z; x1 = y22 + 333z.",
    "   leading spaces, trailing ones   \n\n\n  \t mixed\r\nruns      of\u00a0blanks \u3000 wide",
    "Ünïcödé naïve café résumé — ΣΊΣΥΦΟΣ Ωmega Ελληνικά, Привет мир, ﬁne ligatures",
    "中文文本和日本語のテキスト，한국어 텍스트。混合mixed文字123と数字",
    "HelloWorld camelCase snake_case URLs like https://example.com/a?b=c&d=e#frag",
    "I'll say it's done: we've tested 'RE, 'Ve, DON'T and 'd contractions.",
    "emoji 🦙🚀 and symbols ±×÷ → ∞ … «quotes» ¿qué? ¡sí! ١٢٣ ²³",
    "<|im_start|>user\nhi there<|endoftext|> after",
]
REPS = list({p.regexes: n for n, p in reversed(list(PRES.items()))}.values())  # a name for each set of regexes

# the words each set of regexes gives two strings (checked against llama.cpp's token ids by the test below it)
PINNED = {
    'default': (['x', '=', '123', '456', '7', ';', '\n\n ', ' y', '(', 'it', "'", 's', ')', ' naïve'],
                ['HelloWorld', ' 中文のテキスト', '，', '한국어']),
    'llama3': (['x', '=', '123', '456', '7', ';\n\n', ' ', ' y', '(it', "'s", ')', ' naïve'],
               ['HelloWorld', ' 中文のテキスト', '，한국어']),
    'jais-2': (['x', '=', '123', '456', '7', ';\n\n', ' ', ' y', '(it', "'s", ')', ' naïve'],
               ['HelloWorld', ' 中文のテキスト', '，한국어']),
    'deepseek-llm': (['x', '=', '1234567', ';', '\n', '\n', ' ', ' y', '(', 'it', "'", 's', ')', ' na', 'ï', 've'],
                     ['HelloWorld', ' ', '中文のテキスト', '，', '한국어']),
    'deepseek-v3': (['x', '=', '123', '456', '7', ';\n\n', ' ', ' y', '(it', "'s", ')', ' naïve'],
                    ['HelloWorld', ' ', '中文のテキスト', '，', '한국어']),
    'spark2_5': (['x', '=', '1', '2', '3', '4', '5', '6', '7', ';', '\n', '\n', ' ', ' y', '(it', "'s", ')', ' naïve'],
                 ['HelloWorld', ' ', '中文のテキスト', '，', '한국어']),
    'youtu': (['x', '=', '1', '2', '3', '4', '5', '6', '7', ';\n\n', ' ', ' y', "(it's", ')', ' naïve'],
              ['HelloWorld', ' ', '中文のテキスト', '，', '한국어']),
    'deepseek-coder': (['x', '=', '1', '2', '3', '4', '5', '6', '7', ';', '\n', '\n', ' ', ' y', '(', 'it', "'",
                        's', ')', ' naïve'],
                       ['HelloWorld', ' ', '中文のテキスト', '，', '한국어']),
    'falcon': (['x', '=', '123', '456', '7', ';', '\n\n ', ' y', '(', 'it', "'", 's', ')', ' naïve'],
               ['HelloWorld', ' 中文のテキスト', '，', '한국어']),
    'starcoder': (['x', '=', '1', '2', '3', '4', '5', '6', '7', ';', '\n\n ', ' y', '(', 'it', "'s", ')', ' naïve'],
                  ['HelloWorld', ' 中文のテキスト', '，', '한국어']),
    'gpt-2': (['x', '=', '1234567', ';', '\n\n ', ' y', '(', 'it', "'s", ')', ' naïve'],
              ['HelloWorld', ' 中文のテキスト', '，', '한국어']),
    'qwen2': (['x', '=', '1', '2', '3', '4', '5', '6', '7', ';\n\n', ' ', ' y', '(it', "'s", ')', ' naïve'],
              ['HelloWorld', ' 中文のテキスト', '，한국어']),
    'qwen35': (['x', '=', '1', '2', '3', '4', '5', '6', '7', ';\n\n', ' ', ' y', '(it', "'s", ')', ' naïve'],
               ['HelloWorld', ' 中文のテキスト', '，한국어']),
    'poro-chat': (['x=1234567;', '\n\n ', ' y', '(', "it's", ')', ' naïve'],
                  ['HelloWorld', ' 中文のテキスト', '，', '한국어']),
    'viking': (['x=', '1', '2', '3', '4', '5', '6', '7', ';', '\n\n ', ' y', '(', "it's", ')', ' naïve'],
               ['HelloWorld', ' 中文のテキスト', '，', '한국어']),
    'tekken': (['x', '=', '1', '2', '3', '4', '5', '6', '7', ';\n\n', ' ', ' y', '(it', "'s", ')', ' naïve'],
               ['Hello', 'World', ' 中文のテキスト', '，한국어']),
    'chameleon': (['x', '=', '1', '2', '3', '4', '5', '6', '7', ';', '\n', '\n', '  ', 'y', '(', 'it', "'", 's',
                   ')', ' naïve'],
                  ['HelloWorld', ' 中文のテキスト', '，', '한국어']),
    'gpt-4o': (['x', '=', '123', '456', '7', ';\n\n', ' ', ' y', "(it's", ')', ' naïve'],
               ['Hello', 'World', ' 中文のテキスト', '，한국어']),
    'granite-embed-multi-97m': (['x', '=', '123', '456', '7', ';\n\n', ' ', ' y', "(it's", ')', ' naïve'],
                                ['Hello', 'World', ' 中文のテキスト', '，한국어']),
    'tiny_aya': (['x', '=', '1', '234', '567', ';\n\n', ' ', ' y', "(it's", ')', ' naïve'],
                 ['HelloWorld', ' 中文のテキスト', '，한국어']),
    'kimi-k2': (['x', '=', '123', '456', '7', ';\n\n', ' ', ' y', "(it's", ')', ' naïve'],
                ['HelloWorld', ' ', '中文', 'のテキスト', '，한국어']),
    'superbpe': (['x=', '1', '234', '567', ";\n\n  y(it's) naïve"],
                 ['HelloWorld 中文のテキスト，한국어']),
    'bailingmoe': (['x', '=', '1', '2', '3', '4', '5', '6', '7', ';\n\n', ' ', ' y', '(it', "'s", ')', ' naïve'],
                   ['HelloWorld', ' 中文のテキスト', '，한국어']),
    'seed-coder': (['x', '=', '1', '2', '3', '4', '5', '6', '7', ';', '\n\n', ' ', ' y', '(it', "'s", ')', ' naïve'],
                   ['HelloWorld', ' 中文のテキスト', '，한국어']),
    'ufakzeka': (['x', '=', '1', '2', '3', '4', '5', '6', '7', ';\n\n', ' ', ' y', '(it', "'s", ')', ' naïve'],
                 ['HelloWorld', ' 中文のテキスト', '，한국어']),
    'afmoe': (['x', '=', '1', '234', '567', ';\n\n', ' ', ' y', '(it', "'s", ')', ' naïve'],
              ['HelloWorld', ' ', '中文のテキスト', '，', '한국어']),
    'laguna': (['x', '=', '1', '2', '3', '4', '5', '6', '7', ';', '\n\n', ' ', ' y', '(it', "'s", ')', ' naïve'],
               ['HelloWorld', ' 中文のテキスト', '，한국어']),
    'exaone-moe': (['x', '=', '1', '2', '3', '4', '5', '6', '7', ';\n', '\n', ' ', ' y', '(it', "'s", ')', ' naïve'],
                   ['HelloWorld 中文のテキスト', '，한국어']),
    'minicpm5': (['x', '=', '123', '456', '7', ';\n\n', ' ', ' y', '(it', "'s", ')', ' naïve'],
                 ['HelloWorld', ' 中文のテキスト', '，한국어']),
}


def test_every_set_of_regexes_is_pinned():
    assert {PRES[n].regexes for n in PINNED} == {p.regexes for p in PRES.values()}


@pytest.mark.parametrize("pre", list(PINNED))
def test_words_of_each_pre_tokenizer(pre):
    for text, want in zip(("x=1234567;\n\n  y(it's) naïve", "HelloWorld 中文のテキスト，한국어"), PINNED[pre]):
        assert words(pre, text) == want, (pre, text)


# llama.cpp's own code and its regex engine where the plain regexes would part (found by a random sweep against it):
# afmoe's and tiny_aya's digit groups take the text before a run into its first group; a regex of literal code points
# never matches a non-ASCII space (llama.cpp turns those into U+000B first)
QUIRKS = [("tiny_aya", "Z  ²9\t,", ["Z", " ", " ", "²9", "\t", ","]),
          ("afmoe", "ab1234567cd 12 x", ["ab", "1", "234", "567", "cd", " ", "12", " x"]),
          ("deepseek-llm", "。  \u3000ㄱ", ["。", "  \u3000", "ㄱ"]),
          ("deepseek-coder", "a \u3000中", ["a", " ", "\u3000", "中"])]


@pytest.mark.parametrize("pre,text,want", QUIRKS)
def test_words_where_llama_cpp_departs_from_the_regexes(pre, text, want):
    assert words(pre, text) == want


def _vocab_file(tmp_path, pre: str, vocab: int = 700, **kw):
    _, *tokenizer = gf.bpe_tokenizer(vocab, pre, texts=gf.SENTENCES + CORPUS)
    return gf.write_vocab_gguf(tmp_path / f"{pre}.gguf", tokenizer, pre, bos=1, **kw)


@pytest.mark.parametrize("pre", REPS)
def test_tokenizer_of_each_pre_tokenizer_round_trips(pre, tmp_path):
    """Each set of regexes builds a tokenizer from a file that encodes the corpus and decodes it back, its control
    tokens matched as themselves; a llama3-style name (ignore_merges) takes a word that is a token whole."""
    path = _vocab_file(tmp_path, pre)
    tok = tokenizer_from_gguf(open_reader(path), str(path))
    for s in CORPUS:
        ids = tok.encode(s, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == s
    assert tok.encode("<|im_start|>", add_special_tokens=False).ids == [1]


def test_names_llama_cpp_knows_but_lanefuse_does_not_build(tmp_path):
    for pre, why in (("gemma4", "raw UTF-8"), ("roberta-bpe", "separator"), ("smolm", "did you mean `smollm`")):
        path = gf.write_vocab_gguf(tmp_path / "x.gguf", gf.bpe_tokenizer(300, "gpt-2")[1:], pre)
        with pytest.raises(UserError) as e:
            tokenizer_from_gguf(open_reader(path), str(path))
        msg = str(e.value)
        assert "\n" not in msg and f"`{pre}`" in msg and why in msg and "--prompt-ids" in msg
    assert not set(NOT_BUILT) & set(PRES)


def test_bos_as_llama_cpp_adds_it(tmp_path):
    """llama3-style names add BOS where the file does not say; gpt-2 does not; the file's key wins; ChatGLM has no
    BOS to add."""
    cases = [("llama-bpe", None, True), ("gpt-2", None, False), ("gpt-2", True, True), ("llama-bpe", False, False),
             ("chatglm-bpe", True, False), ("tekken", None, True), ("chameleon", None, True)]
    for pre, add_bos, want in cases:
        path = _vocab_file(tmp_path, pre, 300, add_bos=add_bos)
        ids = tokenizer_from_gguf(open_reader(path), str(path)).encode("hi").ids
        assert (ids[0] == 1) == want, (pre, add_bos)


@pytest.mark.llamacpp
@pytest.mark.parametrize("pre", list(PRES))
def test_token_ids_equal_llama_cpp(pre, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = _vocab_file(tmp_path, pre)
    ref = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    mine = tokenizer_from_gguf(open_reader(path), str(path))
    for s in CORPUS + ["x=1234567;\n\n  y(it's) naïve", "HelloWorld 中文のテキスト，한국어"] + [t for _, t, _ in QUIRKS]:
        assert mine.encode(s).ids == ref.tokenize(s.encode(), add_bos=True, special=True), (pre, s)


# what the sweep draws from: letters of every case and script nearby, marks, digits of other scripts, every kind of
# space and line break, punctuation ASCII and wide, symbols, emoji, joiners
SWEEP = (list("aZé 中\n\t\r'sS1٣²_-.,!?…。，、") + ["\u00a0", "\u2009", "\u3000", "\u200b", "\u0301", "\u1680", "\u0085",
         "ǅ", "ꙮ", "😀", "\u2028", "ℌ", "Ⅻ", "ß", "İ", "ﬁ", "ـ", "ๆ", "\u0e31", "가", "ㄱ", "ー", "々", "〇", "\u200d",
         "\ufeff", "€", "$", "+", "<", "^", "`", "|", "~", "@", "#", "0", "9", "x", "X", '"', "  "])


@pytest.mark.llamacpp
@pytest.mark.parametrize("pre", REPS)
def test_random_strings_equal_llama_cpp(pre, tmp_path):
    """200 seeded random strings over SWEEP: token ids equal to llama.cpp's for each set of regexes."""
    import random

    llama_cpp = pytest.importorskip("llama_cpp")
    path = _vocab_file(tmp_path, pre)
    ref = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    mine = tokenizer_from_gguf(open_reader(path), str(path))
    rng = random.Random(pre)
    for _ in range(200):
        s = "".join(rng.choice(SWEEP) for _ in range(rng.randint(1, 30)))
        assert mine.encode(s, add_special_tokens=False).ids == ref.tokenize(s.encode(), add_bos=False,
                                                                             special=True), (pre, s)
