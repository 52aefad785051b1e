"""The tokenizer a GGUF file holds in its metadata (`tokenizer.ggml.*`), built with the `tokenizers` package as
llama.cpp tokenizes: byte-level BPE (`gpt2`, with the pre-tokenizer regexes `tokenizer.ggml.pre` names, from llama.cpp's
src/llama-vocab.cpp) and SentencePiece (`llama`: pieces merged by score, unknown bytes as <0xXX> tokens). Control
tokens in the text are matched as themselves (llama.cpp's parse_special), BOS added where the file says."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.gguf import shown

# The pre-tokenizers llama.cpp builds (src/llama-vocab.cpp, llm_tokenizer_bpe): the regexes each splits the text by, in
# order, restated for the `tokenizers` package's Oniguruma. Where llama.cpp runs a regex through std::regex on its
# "collapsed" text (every non-ASCII code point one byte of its category), \p{Lu}, \p{Ll}, \p{Lt}, \p{Lm} and \p{Lo} all
# mean a letter (no case), so they are written \p{L} here; where it runs its own code (kimi-k2's, the digit groups of
# afmoe and tiny_aya) the regex here says what that code does.
_C = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"  # English contractions, either case
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_JAIS2 = (_C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          + "|".join(rf"\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4)) + r"|\s{1,2}(?!\S)|\s{1}")
_QWEN35 = _C + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CASED = (  # DeepSeek LLM's cased letters (Lu, Ll, Lt as its tokenizer.json lists them)
    r"A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}\x{370}-\x{373}"
    r"\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}"
    r"\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}"
    r"\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}"
    r"\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}"
    r"\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}"
    r"\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}"
    r"\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}"
    r"\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}"
    r"\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}"
    r"\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}"
    r"\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}")
# llama.cpp matches a regex without \p{..} on the text with every non-ASCII space made U+000B: a class of literal code
# points never matches one (U+3000 in these ranges), hence the `&&\S`
_CJK_HANGUL = r"[\x{4E00}-\x{9FA5}\x{0800}-\x{4E00}\x{AC00}-\x{D7FF}&&\S]+"  # DeepSeek's "[一-龥ࠀ-一가-퟿]+"
_CJK_KANA = r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+"  # Han (to 龥), hiragana, katakana
_ASCII_PUNCT = r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]"
_DEEPSEEK3 = (_ASCII_PUNCT + r"[A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
_SPARK = _ASCII_PUNCT + r"[A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"
_CASE_WORDS = (  # a word of upper-then-lower letters (ASCII case only: llama.cpp's collapsed text has no other case)
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+{c}"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*{c}")
_TEKKEN = _CASE_WORDS.replace("{c}", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = _CASE_WORDS.replace("{c}", _C + "?") + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GRANITE_MULTI = (_CASE_WORDS.replace(r"(?=[\p{L}])", r"(?=[\p{L}\p{M}])").replace("{c}", _C + "?")
                  + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LM = r"[\p{L}\p{M}]"  # \p{Lu}/\p{Ll}/... collapse to letters in llama.cpp
_YOUTU = [r"[\x{AC00}-\x{D7A3}\x{3131}-\x{318E}]+|[\x{FF01}\x{2026}\x{201C}\x{201D}\x{2018}\x{2019}\x{2014}\x{FF1A}"
          r"\x{FF1B}\x{FF0C}\x{3001}-\x{303F}\x{FE30}-\x{FE4F}]+|[\x{3105}-\x{312F}]+|" + _CJK_KANA,
          rf"[^\r\n\p{{L}}\p{{N}}]?{_LM}*{_LM}+{_C}?|[^\r\n\p{{L}}\p{{N}}]?{_LM}+{_LM}*{_C}?|\p{{N}}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
# llama.cpp's own code for afmoe's and tiny_aya's digits: a run of digits in threes from its end, the text before the
# run joined to its first group ("ab1234567cd 12 x": ab1 234 567 | cd 12 | " x"); the lookbehind keeps it linear
_DIGIT_GROUPS = r"(?<!\P{N})\P{N}*\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
_TINY_AYA = [_DIGIT_GROUPS, rf"[^\r\n\p{{L}}\p{{N}}]?{_LM}*{_LM}+{_C}?|[^\r\n\p{{L}}\p{{N}}]?{_LM}+{_LM}*{_C}?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
_HAN = (r"\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2B73F}\x{2B740}-\x{2B81F}"
        r"\x{2B820}-\x{2CEAF}\x{2CEB0}-\x{2EBEF}\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}")  # llama.cpp's unicode_cpt_is_han
_KIMI_K2 = (rf"[{_HAN}]+|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}&&[^{_HAN}]]+{_C}?|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # llama.cpp's own code for it: letter runs without case, Han apart
_AFMOE = [_DIGIT_GROUPS, r"[\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{8C48}-\x{FAFF}\x{3040}-\x{309F}\x{30A0}-\x{30FF}"
          r"\x{FF65}-\x{FF9F}\x{2F00}-\x{2FDF}\x{0E40}-\x{0E7F}\x{0E80}-\x{0EFF}\x{1780}-\x{17FF}\x{1000}-\x{109F}"
          r"\x{AA60}-\x{AA7F}\x{A9E0}-\x{A9FF}\x{AC00}-\x{D7AF}\x{1100}-\x{11FF}]+",
          _DEEPSEEK3]  # its words as deepseek-v3's
_BLOOM = r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{0964}\x{06D4}\x{060C})]+"
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]


@dataclass(frozen=True)
class Pre:
    """A pre-tokenizer as llama.cpp builds it: its regexes, whether a word that is itself a token is that token
    (`ignore_merges`), whether BOS is added where the file has no `tokenizer.ggml.add_bos_token` (`add_bos`), and
    whether it has a BOS token at all (`bos`: ChatGLM's has none)."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False
    bos: bool = True


def _pres() -> dict[str, Pre]:
    groups: list[tuple[tuple[str, ...], Pre]] = [
        (("default",), Pre(tuple(_DEFAULT))),
        (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
         Pre((_LLAMA3,), ignore_merges=True, add_bos=True)),
        (("dbrx", "smaug-bpe"), Pre((_LLAMA3,))),
        (("chatglm-bpe",), Pre((_LLAMA3,), bos=False)),
        (("glm4", "glm5"), Pre((_LLAMA3,), ignore_merges=True, bos=False)),
        (("jais-2",), Pre((_JAIS2,))),
        (("deepseek-llm",), Pre((r"[\r\n]", rf"\s?[{_CASED}]+", r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}"
                                 r"\x{2018}-\x{201F}\x{3000}-\x{3002}&&\S]+", r"\s+\z", _CJK_HANGUL, r"\p{N}+"))),
        (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), Pre((r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3))),
        (("spark2_5",), Pre((r"\p{N}{1,3}", _CJK_KANA, _SPARK, r"\p{N}"))),
        (("youtu",), Pre(tuple(_YOUTU), ignore_merges=True)),
        (("deepseek-coder",), Pre((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"))),
        (("falcon",), Pre((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"))),
        (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
         Pre((r"\p{N}", _GPT2))),
        (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
          "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"), Pre((_GPT2,))),
        (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"),
         Pre((_QWEN2,))),
        (("qwen35",), Pre((_QWEN35,))),
        (("poro-chat", "bloom", "gpt3-finnish"), Pre((_BLOOM,))),
        (("viking",), Pre((_BLOOM, r"\p{N}"))),
        (("tekken",), Pre((_TEKKEN,), ignore_merges=True, add_bos=True)),
        (("chameleon",), Pre((r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )",
                              r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2), add_bos=True)),
        (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), Pre((_GPT4O,))),
        (("granite-embed-multi-97m",), Pre((_GRANITE_MULTI,), ignore_merges=True)),
        (("tiny_aya", "cohere2moe"), Pre(tuple(_TINY_AYA))),
        (("kimi-k2",), Pre((_KIMI_K2,))),
        (("superbpe",), Pre((r"\p{N}+", r"[0-9]{1,3}(?=(?:[0-9]{3})*(?![0-9]))"))),
        (("bailingmoe", "bailingmoe2", "llada-moe"),
         Pre((r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]|\s+(?!\S)|\s+",))),
        (("seed-coder",), Pre((_C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)"
                               r"|\s+",))),
        (("ufakzeka",), Pre((_QWEN2[len(_C) + 1:],))),
        (("afmoe",), Pre(tuple(_AFMOE))),
        (("laguna",), Pre((r"[^\n]+|[\n]+", _QWEN2))),
        (("exaone-moe",), Pre((_C + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                               r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",))),
        (("minicpm5",), Pre((r"\p{N}{1,3}", _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                             r"|\s*[\r\n]+|\s+(?!\S)|\s+"), ignore_merges=True)),
    ]
    return {name: pre for names, pre in groups for name in names}


PRES = _pres()
# names llama.cpp knows that lanefuse does not build, and why
NOT_BUILT = {**{n: "its BPE runs on raw UTF-8 with spaces as ▁ (no byte-level encoding)"
                for n in ("gemma4", "granite-embed-multi-311m", "sarvam-moe", "whitespace")},
             **{n: "it adds a separator token (a BERT-style encoder's tokenizer)"
                for n in ("jina-v1-en", "jina-v2-code", "roberta-bpe")}}
CONTROL, USER_DEFINED, BYTE = 3, 4, 6  # gguf.TokenType


def _field(reader, key: str, where: str, default: Any = None, required: bool = False) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise UserError(f"{where}: missing `{key}` (the file's tokenizer)")
        return default
    return f.contents()


def tokenizer_from_gguf(reader, where: str):
    """A `tokenizers.Tokenizer` of the file's vocabulary (`reader`: its gguf.GGUFReader)."""
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise UserError("--prompt needs the `tokenizers` package (pip install tokenizers)") from None
    model = _field(reader, "tokenizer.ggml.model", where)
    if model is None:
        raise UserError(f"{where}: the file holds no tokenizer (`tokenizer.ggml.model`); give --prompt-ids")
    tokens = _field(reader, "tokenizer.ggml.tokens", where, required=True)
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens) or not tokens:
        raise UserError(f"{where}: `tokenizer.ggml.tokens` is not a list of strings")
    types = _field(reader, "tokenizer.ggml.token_type", where, [1] * len(tokens))
    if not isinstance(types, list) or len(types) != len(tokens):
        raise UserError(f"{where}: `tokenizer.ggml.token_type` holds {len(types) if isinstance(types, list) else '?'}"
                        f" entries for {len(tokens)} tokens")
    if model == "gpt2":
        tok, spec = _bpe(reader, where, tokens)
        add_bos_default, has_bos = spec.add_bos, spec.bos
    elif model == "llama":
        tok, add_bos_default, has_bos = _spm(reader, where, tokens, types), True, True
    else:
        raise UserError(f"{where}: `tokenizer.ggml.model` is `{shown(model)}`; lanefuse builds gpt2 (byte-level "
                        f"BPE) and llama (SentencePiece) tokenizers")
    _specials(tok, tokens, types, byte_level=model == "gpt2")
    _bos(tok, reader, where, tokens, add_bos_default, has_bos)
    return tok


def _bpe(reader, where: str, tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pre = _field(reader, "tokenizer.ggml.pre", where, "default")
    if pre not in PRES:
        why = NOT_BUILT.get(pre) if isinstance(pre, str) else None
        known = f"{why}" if why else "not one llama.cpp names"
        near = difflib.get_close_matches(str(pre), list(PRES), n=1)
        hint = f" (did you mean `{near[0]}`?)" if near and not why else ""
        raise UserError(f"{where}: `tokenizer.ggml.pre` is `{shown(pre)}`, a pre-tokenizer lanefuse does not build "
                        f"({known}){hint}; give --prompt-ids")
    spec = PRES[pre]
    merges = _field(reader, "tokenizer.ggml.merges", where, [], required=pre != "kimi-k2")  # llama.cpp: kimi-k2 may
    # have none
    pairs = []
    for m in merges:
        pos = m.find(" ", 1) if isinstance(m, str) else -1  # as llama.cpp splits it: the first space after the start
        if pos < 0:
            raise UserError(f"{where}: `tokenizer.ggml.merges` entry {m[:40]!r} is not two tokens and a space")
        pairs.append((m[:pos], m[pos + 1:]))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=spec.ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splits(spec) + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, spec


def splits(spec: Pre) -> list:
    """The pre-tokenizer's regexes as `tokenizers` Split steps, in order: each splits every piece the ones before it
    left, keeping both what it matches and what lies between (llama.cpp's unicode_regex_split)."""
    from tokenizers import Regex, pre_tokenizers

    return [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]


def words(pre: str, text: str) -> list[str]:
    """`text` split into the words pre-tokenizer `pre` gives BPE (before the byte-level mapping)."""
    from tokenizers import pre_tokenizers

    return [w for w, _ in pre_tokenizers.Sequence(splits(PRES[pre])).pre_tokenize_str(text)]


def _spm(reader, where: str, tokens: list[str], types: list[int]):
    """SentencePiece as llama.cpp runs it: spaces as ▁ (one prepended), adjacent pieces merged while the merged piece
    is a token, the highest score first; a character no token holds as its UTF-8 byte tokens <0xXX>."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = _field(reader, "tokenizer.ggml.scores", where, [0.0] * len(tokens))
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise UserError(f"{where}: `tokenizer.ggml.scores` does not hold one score a token")
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    score_of = {t: scores[i] for t, i in vocab.items()}
    # the merges that make each piece, ranked by the piece's score (llama.cpp's bigram queue), then its id
    merges = []
    for t, i in vocab.items():
        if types[i] != 1 or len(t) < 2:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                merges.append((-score_of[t], i, k, a, b))
    merges.sort()
    unk = _field(reader, "tokenizer.ggml.unknown_token_id", where, 0)
    tok = Tokenizer(models.BPE(vocab, [(a, b) for *_, a, b in merges], unk_token=tokens[unk] if 0 <= unk < len(tokens)
                               else None, byte_fallback=True, fuse_unk=True))
    norm = [normalizers.Replace(" ", "▁")]
    if _field(reader, "tokenizer.ggml.add_space_prefix", where, True):
        norm.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def _specials(tok, tokens: list[str], types: list[int], byte_level: bool) -> None:
    """Control tokens matched in the text as themselves (special: left out of decoded text), user-defined ones too."""
    from tokenizers import AddedToken

    ctrl = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL and t]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED and t]
    if ctrl:
        tok.add_special_tokens(ctrl)
    if user:
        tok.add_tokens(user)


def _bos(tok, reader, where: str, tokens: list[str], default: bool, has_bos: bool = True) -> None:
    """BOS / EOS added as the file says (`tokenizer.ggml.add_bos_token`; else llama.cpp's default for the
    tokenizer, `default`); a pre-tokenizer without a BOS token (`has_bos` False: ChatGLM's) adds none."""
    from tokenizers import processors

    add_bos = _field(reader, "tokenizer.ggml.add_bos_token", where, default) and has_bos
    add_eos = _field(reader, "tokenizer.ggml.add_eos_token", where, False)
    parts, specials = ["$A"], []
    for flag, key, front in ((add_bos, "tokenizer.ggml.bos_token_id", True),
                             (add_eos, "tokenizer.ggml.eos_token_id", False)):
        if not flag:
            continue
        i = _field(reader, key, where)
        if not isinstance(i, int) or not 0 <= i < len(tokens):
            raise UserError(f"{where}: the tokenizer adds a {key.split('.')[-1][:3]} token, but `{key}` is "
                            f"{i!r} (expected a token id below {len(tokens)})")
        parts.insert(0 if front else len(parts), tokens[i])
        specials.append((tokens[i], i))
    if specials:
        tok.post_processor = processors.TemplateProcessing(single=parts, special_tokens=specials)


# -- the chat template (`--chat`) --------------------------------------------------------------------------------------

def chat_text(reader, where: str, user: str) -> str:
    """`user` as one user message put through the file's `tokenizer.chat_template` (Jinja), as transformers'
    apply_chat_template renders it: messages=[{"role": "user", "content": user}], add_generation_prompt=True, the
    file's bos_token and eos_token as text; a sandboxed environment with trim_blocks and lstrip_blocks, loop controls,
    tojson and raise_exception. The text it gives is tokenized with its control tokens as themselves and no BOS added
    (the template writes what the model expects)."""
    template = _field(reader, "tokenizer.chat_template", where)
    if template is None:
        raise UserError(f"{where}: the file holds no chat template (`tokenizer.chat_template`); give the prompt "
                        f"without --chat")
    if not isinstance(template, str):
        raise UserError(f"{where}: `tokenizer.chat_template` is not text")
    try:
        import jinja2  # noqa: F401
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise UserError("--chat needs the `jinja2` package to apply the file's chat template (pip install jinja2)") \
            from None
    import json
    from datetime import datetime

    from jinja2.ext import loopcontrols

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    tokens = _field(reader, "tokenizer.ggml.tokens", where, [])

    def token(key: str) -> str:
        i = _field(reader, key, where)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""

    try:
        return env.from_string(template).render(
            messages=[{"role": "user", "content": user}], add_generation_prompt=True,
            bos_token=token("tokenizer.ggml.bos_token_id"), eos_token=token("tokenizer.ggml.eos_token_id"))
    except jinja2.exceptions.TemplateError as e:
        raise UserError(f"{where}: its chat template (`tokenizer.chat_template`) fails: {str(e).splitlines()[0]}") \
            from None
