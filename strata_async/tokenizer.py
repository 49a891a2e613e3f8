"""The tokenizer of a GGUF model: byte-level BPE as llama.cpp runs it, streaming detokenization, chat templates.

Built from the vocabulary a GGUF file carries (tokenizer.ggml.tokens / merges / token_type). The pre-tokenizer
(how text is cut into words before BPE) is chosen from tokenizer.ggml.pre the way llama.cpp chooses it; the
regular expressions are the ones the models' own tokenizer.json files declare. BPE itself runs in the
`tokenizers` library. Control and user-defined tokens are cut out of the text before BPE, as llama.cpp does:
user-defined tokens always, control tokens only when parse_special is set.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import numpy as np
from gguf.constants import Keys, TokenType
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models, pre_tokenizers

if TYPE_CHECKING:
    from strata_async.io import GGUFFile

__all__ = ["StreamDecoder", "Tokenizer", "TokenizerError"]

K = Keys.Tokenizer


class TokenizerError(ValueError):
    """The model's tokenizer cannot be built or used as asked; the message says why."""


# ---------------------------------------------------------------------------------------------------------------
# Pre-tokenizers: tokenizer.ggml.pre -> the regexes that split text into words (applied in sequence, each one
# splitting the pieces the previous left, keeping the text between matches as pieces too)
# ---------------------------------------------------------------------------------------------------------------

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _cased_words(suffix: str) -> str:
    """Words split at lower->upper case changes (GPT-4o style), each optionally followed by `suffix`."""
    upper, lower = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
    lead = r"[^\r\n\p{L}\p{N}]?"
    return f"{lead}{upper}*{lower}+{suffix}|{lead}{upper}+{lower}*{suffix}"


_GPT4O = _cased_words(_CONTRACTIONS + "?") + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TEKKEN = _cased_words("") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SEED_CODER = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377"
    "\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556"
    "\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_LLM_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_DEEPSEEK_V3_WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is not split by the merges (llama3 and kin)
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


def _family(names: str, pre: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), pre)


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_family("default", PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))),
    **_family("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert mpt olmo "
              "jais trillion granite-docling exaone4", PreTokenizer((_GPT2,))),
    **_family("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
              PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    **_family("dbrx smaug-bpe chatglm-bpe", PreTokenizer((_LLAMA3,))),
    **_family("glm4 glm5", PreTokenizer((_LLAMA3,), ignore_merges=True)),
    **_family("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2",
              PreTokenizer((_QWEN2,))),
    **_family("qwen35", PreTokenizer((_QWEN35,))),
    **_family("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2",
              PreTokenizer((r"\p{N}", _GPT2))),
    **_family("falcon", PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"))),
    **_family("deepseek-llm", PreTokenizer(
        (r"[\r\n]", _DEEPSEEK_LLM_LETTERS, _DEEPSEEK_LLM_PUNCT, r"\s+$", _CJK, r"\p{N}+"))),
    **_family("deepseek-coder", PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"))),
    **_family("deepseek-v3 hunyuan-dense joyai-llm hy_v4", PreTokenizer(
        (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", _DEEPSEEK_V3_WORDS))),
    **_family("gpt-4o llama4 kanana2 talkie minimax-m2", PreTokenizer((_GPT4O,))),
    **_family("tekken", PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)),
    **_family("seed-coder", PreTokenizer((_SEED_CODER,))),
    **_family("bloom gpt3-finnish poro-chat", PreTokenizer((_BLOOM,))),
    **_family("viking", PreTokenizer((_BLOOM, r"\p{N}"))),
}

# Tokens that end generation, recognised by their text as llama.cpp recognises them.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
})


# ---------------------------------------------------------------------------------------------------------------
# Byte-level alphabet: GPT-2 stores each byte of a token as one printable character
# ---------------------------------------------------------------------------------------------------------------


def _byte_level_chars() -> dict[int, int]:
    """Code point of each byte's character -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    mapping = {b: b for b in printable}
    mapping.update({256 + i: b for i, b in enumerate(shifted)})
    return mapping


# str.translate table turning a byte-level token into latin-1 text whose encoding is the token's bytes.
_BYTE_LEVEL_TO_LATIN1 = {cp: chr(b) for cp, b in _byte_level_chars().items()}


def _byte_level_bytes(token: str) -> bytes:
    try:
        return token.translate(_BYTE_LEVEL_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:  # not byte-level text: the token stands for its own UTF-8 bytes
        return token.encode("utf-8")


# ---------------------------------------------------------------------------------------------------------------
# Chat templates (the Jinja environment Hugging Face renders them in)
# ---------------------------------------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# ---------------------------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------------------------

# Attribute -> metadata key of the token ids a model may name (None when absent or out of range).
_SPECIAL_ID_KEYS = {
    "bos_id": K.BOS_ID, "eos_id": K.EOS_ID, "eot_id": K.EOT_ID, "eom_id": K.EOM_ID, "unk_id": K.UNK_ID,
    "pad_id": K.PAD_ID, "fim_pre_id": K.FIM_PRE_ID, "fim_suf_id": K.FIM_SUF_ID, "fim_mid_id": K.FIM_MID_ID,
    "fim_pad_id": K.FIM_PAD_ID, "fim_rep_id": K.FIM_REP_ID, "fim_sep_id": K.FIM_SEP_ID,
}
_DEPRECATED_FIM_KEYS = {"fim_pre_id": K.PREFIX_ID, "fim_suf_id": K.SUFFIX_ID, "fim_mid_id": K.MIDDLE_ID}
# Fill-in-the-middle tokens found by their text when the metadata names none, as llama.cpp does: real
# Qwen GGUFs carry no fim ids, yet their vocabularies hold <|fim_prefix|> and friends.
_FIM_TEXTS = {
    "fim_pre_id": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                   "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf_id": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                   "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid_id": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                   "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep_id": ("<|file_sep|>",),
}


def _literal_alternation(texts: Iterable[str]) -> re.Pattern[str] | None:
    # Longest first, so that of two tokens starting at the same place the longer wins (as in llama.cpp).
    ordered = sorted({t for t in texts if t}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


class Tokenizer:
    """Byte-level BPE tokenizer of a GGUF model (tokenizer.ggml.model "gpt2").

    Token ids a model may name are attributes (None when the model names none): bos_id, eos_id, eot_id,
    eom_id, unk_id, pad_id, fim_pre_id, fim_suf_id, fim_mid_id, fim_pad_id, fim_rep_id, fim_sep_id.
    eog_ids holds every token that ends generation (eos, eot, eom and the end-of-turn tokens llama.cpp
    recognises by their text).
    """

    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    unk_id: int | None
    pad_id: int | None
    fim_pre_id: int | None
    fim_suf_id: int | None
    fim_mid_id: int | None
    fim_pad_id: int | None
    fim_rep_id: int | None
    fim_sep_id: int | None

    def __init__(self, metadata: Mapping[str, Any]):
        model = metadata.get(K.MODEL)
        if model != "gpt2":
            raise TokenizerError(
                f"tokenizer model {model!r} ({K.MODEL}) is not supported: only byte-level BPE ('gpt2') is"
            )
        pre_name = metadata.get(K.PRE) or "default"  # llama.cpp's fallback (with a quality warning)
        if pre_name not in PRE_TOKENIZERS:
            raise TokenizerError(
                f"pre-tokenizer {pre_name!r} ({K.PRE}) is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
            )
        pre = PRE_TOKENIZERS[pre_name]
        self.pre_type = pre_name
        tokens: list[str] = metadata.get(K.LIST) or []
        if not tokens:
            raise TokenizerError(f"the model has no vocabulary ({K.LIST})")
        if K.MERGES not in metadata:
            raise TokenizerError(f"the BPE model has no merges ({K.MERGES})")
        n = len(tokens)
        types = np.asarray(metadata.get(K.TOKEN_TYPE, np.full(n, TokenType.NORMAL)), dtype=np.int32)
        if types.shape != (n,):
            raise TokenizerError(f"{K.TOKEN_TYPE} has {types.size} entries for {n} tokens")
        self._types = types
        self.vocab_size = n

        special_ids = np.flatnonzero((types == TokenType.CONTROL) | (types == TokenType.USER_DEFINED)).tolist()
        self._special_ids = {tokens[i]: i for i in special_ids}
        self._control_ids = frozenset(np.flatnonzero(types == TokenType.CONTROL).tolist())
        self._all_special_re = _literal_alternation(self._special_ids)
        self._user_defined_re = _literal_alternation(
            tokens[i] for i in np.flatnonzero(types == TokenType.USER_DEFINED).tolist()
        )
        try:
            bpe = models.BPE(
                vocab=self._bpe_vocab(tokens, types, special_ids),
                merges=self._merge_pairs(metadata[K.MERGES]),
                ignore_merges=pre.ignore_merges,
            )
        except Exception as e:  # the tokenizers library reports inconsistent merges with a bare Exception
            raise TokenizerError(f"cannot build the BPE model from {K.LIST} and {K.MERGES}: {e}") from e
        self._hf = _HFTokenizer(bpe)
        self._hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in pre.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        self._tokens = tokens
        # Bytes of each token, filled in on first use (decoding all 150k up front would cost more than
        # building the BPE model).
        self._token_bytes: list[bytes | None] = [None] * n

        for attr, key in _SPECIAL_ID_KEYS.items():
            value = metadata.get(key, metadata.get(_DEPRECATED_FIM_KEYS.get(attr, ""), None))
            setattr(self, attr, int(value) if value is not None and 0 <= int(value) < n else None)
        self._find_fim_tokens_by_text(tokens)
        self.add_bos = bool(metadata.get(K.ADD_BOS, pre.add_bos))
        self.add_eos = bool(metadata.get(K.ADD_EOS, False))
        if self.add_bos and self.bos_id is None:
            raise TokenizerError(f"{K.ADD_BOS} is set but the model names no BOS token ({K.BOS_ID})")
        if self.add_eos and self.eos_id is None:
            raise TokenizerError(f"{K.ADD_EOS} is set but the model names no EOS token ({K.EOS_ID})")
        named_ends = {self.eos_id, self.eot_id, self.eom_id, self.fim_pad_id, self.fim_rep_id, self.fim_sep_id}
        by_text = {i for text, i in self._special_ids.items() if text in _EOG_TEXTS}
        self.eog_ids: frozenset[int] = frozenset((named_ends | by_text) - {None})

        self.chat_template: str | None = metadata.get(K.CHAT_TEMPLATE)
        self._compiled_template: tuple[str, jinja2.Template] | None = None

    def _find_fim_tokens_by_text(self, tokens: list[str]) -> None:
        missing = {attr: texts for attr, texts in _FIM_TEXTS.items() if getattr(self, attr) is None}
        wanted = {t for texts in missing.values() for t in texts}
        if not wanted:
            return
        found = {t: i for i, t in enumerate(tokens) if t in wanted}
        for attr, texts in missing.items():
            # The first name in llama.cpp's order that the vocabulary holds.
            setattr(self, attr, next((found[t] for t in texts if t in found), None))

    @staticmethod
    def _bpe_vocab(tokens: list[str], types: np.ndarray, special_ids: list[int]) -> dict[str, int]:
        """Text -> id of the tokens BPE may produce: all but the control and user-defined ones, which are cut
        out of the text beforehand. A user-defined token may share its text with an ordinary one (deepseek-llm's
        "ø" does); BPE needs the ordinary one."""
        vocab = dict(zip(tokens, range(len(tokens))))  # the last of equal texts wins, as in llama.cpp
        shadowed = set()
        for i in special_ids:
            if vocab.get(tokens[i]) == i:
                del vocab[tokens[i]]
                shadowed.add(tokens[i])
        if shadowed:
            for i in np.flatnonzero(np.isin(types, (TokenType.CONTROL, TokenType.USER_DEFINED), invert=True)):
                if tokens[i] in shadowed:
                    vocab[tokens[i]] = int(i)
        return vocab

    @staticmethod
    def _merge_pairs(merges: Sequence[str]) -> list[tuple[str, str]]:
        # Byte-level tokens never contain a space, so each merge is exactly "left right": one split of the
        # joined list is much faster than splitting 150k strings one by one.
        if not merges:
            return []
        parts = " ".join(merges).split(" ")
        if len(parts) != 2 * len(merges):
            bad = next(m for m in merges if m.count(" ") != 1)
            raise TokenizerError(f"merge {bad!r} ({K.MERGES}) is not two tokens separated by one space")
        return list(zip(parts[0::2], parts[1::2]))

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        return cls(metadata)

    @classmethod
    def from_gguf(cls, gguf_file: GGUFFile) -> Tokenizer:
        """From an opened GGUF file."""
        return cls(gguf_file.metadata)

    # -- token properties -----------------------------------------------------------------------------------

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        return token_id

    def is_special(self, token_id: int) -> bool:
        """True for control tokens (<|im_start|>, <|endoftext|>...): the ones decode(skip_special=True) drops."""
        return self._check_id(token_id) in self._control_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a token may hold part of a UTF-8 character)."""
        return self._bytes_of(self._check_id(token_id))

    def _bytes_of(self, token_id: int) -> bytes:
        # As llama.cpp renders tokens: ordinary ones through the byte-level alphabet, control and user-defined
        # ones as their text, other kinds (unknown, unused, byte) as nothing.
        cached = self._token_bytes[token_id]
        if cached is None:
            kind = self._types[token_id]
            text = self._tokens[token_id]
            if kind == TokenType.NORMAL:
                cached = _byte_level_bytes(text)
            elif kind in (TokenType.CONTROL, TokenType.USER_DEFINED):
                cached = text.encode("utf-8")
            else:
                cached = b""
            self._token_bytes[token_id] = cached
        return cached

    # -- text <-> tokens ------------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of text. add_special: add BOS/EOS where the model asks for them. parse_special: control
        tokens written in the text (e.g. "<|im_start|>") become those tokens; otherwise they are plain text."""
        ids: list[int] = [self.bos_id] if add_special and self.add_bos else []
        pattern = self._all_special_re if parse_special else self._user_defined_re
        start = 0
        if pattern is not None:
            for match in pattern.finditer(text):
                if match.start() > start:
                    ids += self._hf.encode(text[start : match.start()], add_special_tokens=False).ids
                ids.append(self._special_ids[match.group()])
                start = match.end()
        if start < len(text):
            ids += self._hf.encode(text[start:], add_special_tokens=False).ids
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def _ids_bytes(self, ids: Iterable[int], skip_special: bool) -> bytes:
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            self._check_id(bad)
        if skip_special:
            ids = [i for i in ids if i not in self._control_ids]
        return b"".join(map(self._bytes_of, ids))

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of token ids, exactly as their bytes spell it (invalid UTF-8 becomes U+FFFD)."""
        return self._ids_bytes(ids, skip_special).decode("utf-8", errors="replace")

    # -- chat -----------------------------------------------------------------------------------------------

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render a conversation with the model's chat template (tokenizer.chat_template).

        The template sees messages, add_generation_prompt, bos_token, eos_token and any keyword arguments
        (tools=..., enable_thinking=...). Encode the result with parse_special=True.
        """
        if not self.chat_template:
            raise TokenizerError(
                f"the model has no chat template ({K.CHAT_TEMPLATE}); set Tokenizer.chat_template to a Jinja "
                "template or build the prompt text yourself"
            )
        if self._compiled_template is None or self._compiled_template[0] != self.chat_template:
            self._compiled_template = (self.chat_template, _compile_chat_template(self.chat_template))
        context = {
            "bos_token": self._token_text(self.bos_id),
            "eos_token": self._token_text(self.eos_id),
            "tools": None,  # always defined, as Hugging Face renders templates
            "documents": None,
            **kwargs,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        return self._compiled_template[1].render(**context)

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._bytes_of(token_id).decode("utf-8", errors="replace")


class StreamDecoder:
    """Turns generated tokens into text as they come, never splitting a UTF-8 character.

    push() returns the text that became complete with this token; bytes of a character still being spelled
    are held back. The concatenation of every push() and the final flush() equals tokenizer.decode(all ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        # Holds the bytes of an incomplete trailing character between calls.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Text of whatever is held back (an incomplete character at the very end becomes U+FFFD)."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
