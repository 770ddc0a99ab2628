"""A GGUF file's tokenizer rebuilt as a Hugging Face `tokenizers` one, from llama.cpp's metadata keys.

Owns: byte-level BPE (`tokenizer.ggml.model` "gpt2") with the pre-tokenizers llama.cpp names (`tokenizer.ggml.pre`:
llama.cpp's default, GPT-2, SmolLM, Llama 3, Smaug, Qwen2, Tekken), SentencePiece BPE ("llama": Llama 2, Mistral,
TinyLlama vocabularies) with its merges recovered from the pieces' scores, the added (control and user-defined) tokens
and bos / eos framing.
Does not own: the model's weights (gguf.py) or config (gguf_config.py), nor the chat template (written beside it as
it is stored).
"""

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from fastspec.errors import FastspecError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4  # tokenizer.ggml.token_type values (gguf.TokenType)
SPACE = "\u2581"  # SentencePiece's visible space

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (  # Llama 3's, but digits one at a time
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (  # Mistral NeMo's: words split at case changes
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")  # each splits the last's
SPLITS = {"default": _DEFAULT_SPLITS, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
          "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
          "tekken": _TEKKEN_SPLIT}  # tokenizer.ggml.pre -> the regex split(s) before BPE (llama.cpp's)
IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3", "tekken")  # a whole word in the vocabulary wins
ADDS_BOS = ("llama-bpe", "llama3", "llama-v3", "tekken")  # llama.cpp adds bos where the file does not say
PRE_TOKENIZERS = tuple(dict.fromkeys(("default", "gpt-2", "gpt2", "smollm", *SPLITS)))  # (none in the file: default)


def build_tokenizer(meta) -> Tokenizer:
    """The tokenizer the GGUF metadata describes; `meta(key, default)` reads one key (gguf._meta)."""
    model = meta("tokenizer.ggml.model")
    if model == "gpt2":
        tokenizer = _byte_level(meta)
    elif model == "llama":
        tokenizer = _sentencepiece(meta)
    else:
        raise FastspecError(f"GGUF tokenizer model '{model}' is not supported (supported: gpt2 byte-level BPE, "
                            "llama SentencePiece BPE)")
    tokens = meta("tokenizer.ggml.tokens")
    types = meta("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    tokenizer.add_tokens([AddedToken(tokens[i], special=types[i] != USER_DEFINED, normalized=False)
                          for i in range(len(tokens)) if types[i] in (UNKNOWN, CONTROL, USER_DEFINED)])
    tokenizer.post_processor = _post_processor(meta, tokens, byte_level=model == "gpt2")
    return tokenizer


def adds_bos(meta) -> bool:
    """llama.cpp prepends bos to a SentencePiece vocabulary, and a Llama 3 or Tekken one, whose file does not say
    otherwise."""
    default = meta("tokenizer.ggml.model") == "llama" or meta("tokenizer.ggml.pre", "default") in ADDS_BOS
    return bool(meta("tokenizer.ggml.add_bos_token", default))


def special_id(meta, key: str) -> int | None:
    """Id of the bos / eos / pad / unk token, or None when the GGUF does not name one."""
    long_name = {"pad": "padding", "unk": "unknown"}.get(key, key)
    return meta(f"tokenizer.ggml.{long_name}_token_id", None)


def _byte_level(meta) -> Tokenizer:
    tokens = meta("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta("tokenizer.ggml.merges")]
    pre = meta("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise FastspecError(f"GGUF tokenizer pre-tokenizer '{pre}' is not supported "
                            f"(supported: {', '.join(PRE_TOKENIZERS)})")
    tokenizer = Tokenizer(models.BPE(vocab={tok: i for i, tok in enumerate(tokens)}, merges=merges,
                                     ignore_merges=pre in IGNORE_MERGES))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in SPLITS)
    if pre == "smollm":  # digits split one by one, then the GPT-2 regex
        byte_level = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in SPLITS:
        regexes = SPLITS[pre] if isinstance(SPLITS[pre], tuple) else (SPLITS[pre],)
        byte_level = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
                                             + [byte_level])
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(meta) -> Tokenizer:
    """SentencePiece BPE: spaces as SPACE (and one before each stretch of text between added tokens unless
    add_space_prefix is false), then pieces merged best score first; a character no piece spells falls back to its
    UTF-8 bytes (<0x..> pieces)."""
    tokens = meta("tokenizer.ggml.tokens")
    scores = meta("tokenizer.ggml.scores", None)
    if scores is None:
        raise FastspecError("GGUF SentencePiece tokenizer is missing 'tokenizer.ggml.scores'")
    types = meta("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    unk = special_id(meta, "unk")
    tokenizer = Tokenizer(models.BPE(vocab={tok: i for i, tok in enumerate(tokens)},
                                     merges=sentencepiece_merges(tokens, scores, types),
                                     unk_token=None if unk is None else tokens[unk], fuse_unk=True, byte_fallback=True))
    prefix = bool(meta("tokenizer.ggml.add_space_prefix", True))
    # a normalizer sees each stretch of text between added tokens: llama.cpp prefixes every one of them (after a
    # special token too) and whatever it starts with, " hi" -> "▁▁hi" (Metaspace's "first" only the first, only once)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE)] * prefix
                                                + [normalizers.Replace(" ", SPACE)])
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                          + [decoders.Strip(" ", 1, 0)] * prefix)
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE joins the adjacent pair whose joined piece scores highest; as ranked merges: every cut of a
    normal piece into two normal pieces, best piece score first (ties: vocabulary order, then the cut).
    E.g. pieces a, b, c, ab (score -1), abc (score -2): [(a, b), (ab, c)] (bc is no piece, so a + bc is no merge)."""
    normal = {tok for tok, kind in zip(tokens, types) if kind == NORMAL}
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != NORMAL:
            continue
        for cut in range(1, len(piece)):
            if piece[:cut] in normal and piece[cut:] in normal:
                ranked.append((-scores[i], i, cut))
    ranked.sort()
    return [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in ranked]


def _post_processor(meta, tokens: list[str], byte_level: bool):
    """Prepend bos / append eos when the GGUF asks for it (e.g. "<s> $A" for add_bos_token)."""
    edges = {}
    for key in ("bos", "eos"):
        token_id = special_id(meta, key)
        wanted = adds_bos(meta) if key == "bos" else meta("tokenizer.ggml.add_eos_token", False)
        if wanted and token_id is not None:
            edges[key] = (tokens[token_id], token_id)
    if not edges:
        return processors.ByteLevel(trim_offsets=False) if byte_level else None
    bos, eos = ([edges[k][0]] if k in edges else [] for k in ("bos", "eos"))
    single = bos + ["$A"] + eos
    pair = single + [f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos]
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                         special_tokens=list(set(edges.values())))
