"""GGUF files read as llama.cpp reads them: metadata and tokenization worked by hand from llama.cpp's rules
(hermetic), and, where llama-cpp-python is importable, llama.cpp itself as the oracle on the same tiny files (skipped
cleanly without it).

Oracles: llama.cpp's `tokenize` on tricky strings (leading spaces, unicode, digits, special tokens) for every
vocabulary form the converter accepts; llama.cpp's logits and greedy tokens on files of each architecture (tied and
untied, F32 / BF16 / block types, a rope base and norm eps of their own, YaRN's attn_factor).
"""

import json
import math
import re

import gguf
import numpy as np
import pytest
import torch
from gguf_writers import SPLIT_TOKENS, SPM_TOKENS, TOKENS, bpe_vocab, split_bpe_vocab, spm_vocab, tiny_model, write_gguf
from transformers import AutoTokenizer

import fastspec
from fastspec.errors import FastspecError
from fastspec.models.gguf import convert_gguf
from fastspec.models.reference import transformers_model
from fastspec.sampling import SamplingParams


def llama_cpp_or_skip():
    """The llama_cpp module, or a skip: it is optional (an ImportError, or a built library that fails to load)."""
    try:
        import llama_cpp
        import llama_cpp._logger
    except Exception as e:
        pytest.skip(f"llama-cpp-python is unavailable ({type(e).__name__})")
    llama_cpp._logger.set_verbose(False)
    return llama_cpp


def converted_tokenizer(tmp_path, vocab, name="m"):
    model = tiny_model("llama", vocab_size=max(len(SPM_TOKENS), len(SPLIT_TOKENS)))  # (wide enough for any vocabulary)
    path = write_gguf(tmp_path / f"{name}.gguf", model, vocab=vocab)
    return path, AutoTokenizer.from_pretrained(convert_gguf(path, tmp_path / f"{name}-hf"))


# ---- metadata ----

def test_per_layer_arrays_of_one_value_read_as_that_value(tmp_path):
    """llama.cpp reads head_count, head_count_kv and feed_forward_length as one value or one per layer."""
    model = tiny_model("llama")
    arrays = {"attention.head_count": [4, 4], "attention.head_count_kv": [2, 2], "feed_forward_length": [96, 96]}
    out = convert_gguf(write_gguf(tmp_path / "a.gguf", model, per_layer=arrays), tmp_path / "a")
    plain = convert_gguf(write_gguf(tmp_path / "p.gguf", model), tmp_path / "p")
    assert json.loads((out / "config.json").read_text()) == json.loads((plain / "config.json").read_text())
    ids = torch.arange(3, 15)[None]
    with torch.no_grad():
        torch.testing.assert_close(transformers_model(out)(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("key, values", [("attention.head_count", [4, 2]), ("attention.head_count_kv", [2, 1]),
                                         ("feed_forward_length", [96, 64])])
def test_per_layer_values_that_differ_are_refused_in_one_line(tmp_path, key, values):
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"), per_layer={key: values})
    line = f"{path}: llama.{key} differs between layers ({values}): not supported"
    with pytest.raises(FastspecError, match=f"^{re.escape(line)}$"):
        convert_gguf(path, tmp_path / "hf")


def test_a_value_length_other_than_the_key_length_is_refused_in_one_line(tmp_path):
    """llama.cpp reads attention.value_length apart from key_length; fastspec's attention has one head_dim."""
    path = write_gguf(tmp_path / "m.gguf", tiny_model("qwen3"), value_length=16)
    line = f"{path}: qwen3.attention.value_length 16 differs from key_length 32: not supported"
    with pytest.raises(FastspecError, match=f"^{re.escape(line)}$"):
        convert_gguf(path, tmp_path / "hf")
    path = write_gguf(tmp_path / "same.gguf", tiny_model("llama"), value_length=16)  # (both 16: hidden / heads)
    assert json.loads((convert_gguf(path, tmp_path / "same") / "config.json").read_text())["head_dim"] == 16


def end_ids(tmp_path, name="m") -> list[int]:
    stop = json.loads((tmp_path / f"{name}-hf" / "generation_config.json").read_text())["eos_token_id"]
    return sorted(stop if isinstance(stop, list) else [stop])


def test_generation_ends_on_llama_cpps_end_of_generation_tokens(tmp_path):
    """llama.cpp ends generation on eos, eot and the tokens whose text ends a turn or a text (<|endoftext|>,
    <|im_end|>, <|eot_id|>, ...) whatever the file names eos: so does the converted model."""
    converted_tokenizer(tmp_path, bpe_vocab())
    assert end_ids(tmp_path) == [0, 2]  # eos <|im_end|>, and <|endoftext|>
    converted_tokenizer(tmp_path, spm_vocab(), "spm")
    assert end_ids(tmp_path, "spm") == [2]  # </s>


FIM = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
END_VOCABS = {  # name -> (extra control tokens, tokenizer.ggml.<key>_token_id, the ends worked by hand)
    # Qwen2.5-Coder's FIM tokens: llama.cpp guesses its pad / repo / separator tokens by text and ends on them
    "coder": (FIM + ("<|eom_id|>",), {}, [0, 2, 268, 269, 270, 271]),
    "coder-named": (FIM, {"fim_pad": 5, "fim_rep": 6, "fim_sep": 7}, [0, 2, 5, 6, 7]),  # named: no guess by text
    "end": (("<|end|>", "<|return|>"), {}, [0, 2, 265, 266]),
    "harmony": (("<|end|>", "<|return|>", "<|call|>"), {}, [0, 2, 266, 267]),  # gpt-oss's: <|end|> ends no answer
    "harmony-named": (("<|end|>", "<|return|>", "<|call|>"), {"eot": 265}, [0, 2, 266, 267]),  # named: still not
    "solar": (("<|end|>", "<|calls|>", "<|flush|>"), {}, [0, 2, 266, 267]),  # Solar Open's: nor here
    "return-calls": (("<|end|>", "<|return|>", "<|calls|>"), {}, [0, 2, 266, 267]),
    "kimi": (("[EOT]", "[EOS]", "[PAD]", "[e~["), {}, [0, 2, 265, 266, 267, 268]),  # [PAD]: a FIM pad; [e~[: MiniMax
    "gemma4": (("</s>", "<eos>", "<turn|>", "<|tool_response>"), {}, [0, 2, 266, 267, 268]),  # its </s> is text
    "plamo": (("</s>", "<|plamo:eos|>"), {"eot": 266}, [0, 2, 266]),  # so is PLaMo's, beside its end token
    "s": (("</s>",), {}, [0, 2, 265]),
}


@pytest.mark.parametrize("name", END_VOCABS)
def test_fim_and_tool_call_ends_are_llama_cpps(tmp_path, name):
    extra, ids, ends = END_VOCABS[name]
    assert len(TOKENS) == 265
    converted_tokenizer(tmp_path, bpe_vocab(extra=extra, ids=ids))
    assert end_ids(tmp_path) == ends


def test_yarns_attn_factor_scales_its_attention_factor(tmp_path):
    """llama.cpp multiplies YaRN's magnitude scale (1 + 0.1 ln factor) by rope.scaling.attn_factor; HF's
    attention_factor replaces that scale, so it is the product."""
    path = write_gguf(tmp_path / "m.gguf", tiny_model("qwen2"), yarn=(4.0, 32), rope_attn_factor=2.0)
    scaling = json.loads((convert_gguf(path, tmp_path / "hf") / "config.json").read_text())["rope_scaling"]
    assert scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                       "attention_factor": pytest.approx(2 * (1 + 0.1 * math.log(4)), rel=1e-6)}


def test_an_attn_factor_without_yarn_is_refused_in_one_line(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"), rope_attn_factor=2.0)
    with pytest.raises(FastspecError, match=r"^GGUF rope.scaling.attn_factor 2.0 without YaRN is not supported$"):
        convert_gguf(path, tmp_path / "hf")
    path = write_gguf(tmp_path / "one.gguf", tiny_model("llama"), rope_attn_factor=1.0)  # (1: no scaling)
    assert json.loads((convert_gguf(path, tmp_path / "one") / "config.json").read_text())["rope_scaling"] is None


CHAT = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("template, add_bos, bos_count", [
    ("{% for m in messages %}<tool>{{ m['content'] }}{% endfor %}", None, 1),  # (SentencePiece: bos unless told not)
    ("{{ bos_token }}{% for m in messages %}<tool>{{ m['content'] }}{% endfor %}", None, 1),  # not two
    ("{% for m in messages %}<tool>{{ m['content'] }}{% endfor %}", False, 0),
    ("{{ bos_token }}{% for m in messages %}<tool>{{ m['content'] }}{% endfor %}", False, 1),
])
def test_a_chat_prompt_gets_bos_as_llama_cpp_gives_it(tmp_path, template, add_bos, bos_count):
    """llama.cpp renders the template, drops a bos it starts with when the vocabulary adds one, and tokenizes the
    text as any prompt (bos added where add_bos_token, or its SentencePiece default, says): a chat prompt starts
    with one bos whenever the file or the template asks for it (transformers' apply_chat_template adds none of its
    own, so a template without {{ bos_token }} lost the bos the model's raw prompts all get)."""
    from fastspec.text.tokenizer import Tokenizer

    def vocab(w):
        spm_vocab(add_bos=add_bos)(w)
        w.add_chat_template(template)
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama", vocab_size=len(SPM_TOKENS)), vocab=vocab)
    tok = Tokenizer(convert_gguf(path, tmp_path / "hf"))
    body = tok.encode("<tool>hello", add_special_tokens=False)
    assert tok.encode_chat(CHAT) == [1] * bos_count + body
    assert tok.encode("<tool>hello") == [1] * (add_bos is None) + body  # (a raw prompt, as before)


# ---- SentencePiece: llama.cpp's space prefix, worked by hand ----

@pytest.mark.parametrize("text, pieces", [
    (" hello", ["▁", "▁hello"]),  # the prefix is added to text that starts with a space too: "▁▁hello"
    ("  hello world", ["▁▁", "▁hello", "▁world"]),
    ("   ", ["▁▁", "▁▁"]),
    ("<s>hello</s>", ["<s>", "▁hello", "</s>"]),  # and to the text after every special token
    ("<tool>hi", ["<tool>", "▁h", "<0x69>"]),
    ("hello<tool> world", ["▁hello", "<tool>", "▁", "▁world"]),
])
def test_sentencepiece_prefixes_a_space_as_llama_cpp_does(tmp_path, text, pieces):
    """llama.cpp (as SentencePiece and Llama 2's own tokenizer) puts one space before the text and before the text
    that follows each special token, whatever that text starts with."""
    _, tok = converted_tokenizer(tmp_path, spm_vocab())
    assert tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False)) == pieces
    assert tok.encode(text)[0] == 1  # (bos added: the file does not say otherwise)
    if "<" not in text:  # (llama.cpp decodes "<tool>hi" as "<tool> hi" too: only the first space goes)
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


# ---- byte-level BPE: llama.cpp's pre-tokenizer names and rules, worked by hand ----

@pytest.mark.parametrize("pre, text, pieces", [
    # llama.cpp's "default" (and a file without tokenizer.ggml.pre): punctuation runs, then GPT-2's split, then
    # digits in threes
    ("default", "don't", ["d", "o", "n", "'", "t"]),
    (None, "12 123 1234", ["12", "Ġ", "123", "Ġ", "123", "4"]),
    (None, " 6,, ,", ["Ġ", "6", ",,", "Ġ", ","]),
    ("gpt-2", "don't 1234", ["d", "o", "n", "'t", "Ġ", "12", "34"]),  # llama.cpp's name for GPT-2's split
    ("smaug-bpe", "ab ab  ab", ["ab", "Ġ", "ab", "Ġ", "Ġ", "ab"]),  # merges, unlike Llama 3's whole words
    ("llama-bpe", "ab ab  ab", ["ab", "Ġab", "Ġ", "Ġab"]),
])
def test_byte_level_splits_as_llama_cpp_does(tmp_path, pre, text, pieces):
    _, tok = converted_tokenizer(tmp_path, split_bpe_vocab(pre, add_bos=False))
    assert tok.convert_ids_to_tokens(tok.encode(text)) == pieces


@pytest.mark.parametrize("pre, bos", [("llama-bpe", True), ("llama3", True), ("llama-v3", True), ("tekken", True),
                                      ("smaug-bpe", False), ("qwen2", False), ("smollm", False), (None, False)])
def test_bos_is_added_by_llama_cpps_default_for_the_pre_tokenizer(tmp_path, pre, bos):
    """A file without tokenizer.ggml.add_bos_token: llama.cpp adds bos for Llama 3's and Tekken's vocabularies."""
    _, tok = converted_tokenizer(tmp_path, split_bpe_vocab(pre))
    assert tok.encode("he") == [1] * bos + [SPLIT_TOKENS.index("he")]


# ---- llama.cpp itself ----

TRICKY = ["don't n't", "1234 5678 123456", " 6 66", ",,, ,", "a  \n\n b", "x (( ((", "hi!! !", " ...", "ab ab  ab",
          "it's  'tis", "hello", " hello", "  hello world", "hello  world", "\thello\n\nworld ", "12345 678",
          "the 12the", "héllo wörld", "日本語", "😀 emoji", "<|im_start|>user\nhi<|im_end|>", "x<custom>y",
          " <custom> ", "<|endoftext|>", "ab ab", "Hello World", "don't I'll", "a\r\nb", "   ", "", "é", "▁hello",
          "<s>hello</s>", "<tool>hi", "hello<tool> world", "!!!", "a  b   c"]
VOCABS = {**{f"bpe-{pre}": bpe_vocab(pre) for pre in ("default", "smollm", "llama-bpe", "qwen2", "tekken")},
          "bpe-no-bos": bpe_vocab("smollm", add_bos=False),
          **{f"split-{pre}": split_bpe_vocab(pre) for pre in (None, "default", "gpt-2", "smollm", "llama-bpe", "llama3",
                                                               "llama-v3", "smaug-bpe", "qwen2", "tekken")},
          **{f"spm-{prefix}-{bos}": spm_vocab(prefix, bos) for prefix in (None, True, False) for bos in (None, False)}}


@pytest.mark.parametrize("vocab", VOCABS)
def test_tokenization_equals_llama_cpps(tmp_path, vocab):
    llama_cpp = llama_cpp_or_skip()
    path, tok = converted_tokenizer(tmp_path, VOCABS[vocab])
    theirs = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in TRICKY:
        assert tok.encode(text) == theirs.tokenize(text.encode(), add_bos=True, special=True), text


Q = gguf.GGMLQuantizationType
FILES = {  # name -> (arch, tied, the matrices' type, the model's config beyond tiny_model's, write_gguf's arguments)
    "llama-f32-theta-eps": ("llama", True, Q.F32, {"rope_theta": 500000.0, "rms_norm_eps": 1e-6}, {}),
    "qwen2-tied-q8_0": ("qwen2", True, Q.Q8_0, {}, {}),  # the lm_head from a Q8_0 embedding
    "qwen3-bf16": ("qwen3", False, Q.BF16, {"head_dim": 64}, {}),
    "phi3-q4_1": ("phi3", False, Q.Q4_1, {}, {}),
    "qwen2-yarn-attn-factor": ("qwen2", False, Q.F32, {}, {"yarn": (4.0, 16), "rope_attn_factor": 1.5}),
    "qwen3moe-f32": ("qwen3_moe", False, Q.F32, {"num_experts": 6, "num_experts_per_tok": 3}, {}),  # experts
    "qwen3moe-q8_0": ("qwen3_moe", False, Q.Q8_0, {}, {}),  # stacked [E, ...], routing renormalised
    "mixtral-q4_0": ("mixtral", False, Q.Q4_0, {}, {}),  # a llama with an expert_count
}


def llama_cpp_answer(llama_cpp, path, prompt: list[int], new: int):
    """llama.cpp's `new` greedy tokens after `prompt`, and its logits [len(prompt) + new, V] over both."""
    model = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=64, n_batch=64, n_threads=2, verbose=False)
    greedy = []
    for token in model.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        greedy.append(token)
        if len(greedy) == new:
            break
    model.reset()
    model.eval(prompt + greedy)
    logits = torch.from_numpy(np.array(model.scores[:len(prompt) + new], dtype=np.float32))
    model.close()
    return greedy, logits


@pytest.mark.parametrize("name", FILES)
def test_logits_and_greedy_tokens_equal_llama_cpps(tmp_path, monkeypatch, name):
    """fastspec's dequantised model scores the ids as llama.cpp does: within 0.5 % of the logits' spread for F32
    (llama.cpp keeps its KV cache in float16: 0.1-0.3 % measured), 10 % for the others (llama.cpp rounds
    activations to 8 bits or 16 for their dot products, ~4 %); greedy decoding on the file's own blocks gives
    llama.cpp's tokens up to the first near tie of llama.cpp's. (A MoE router at a near tie picks another expert
    under another rounding, which moves that token's whole row: these files' seeds meet none.)"""
    llama_cpp = llama_cpp_or_skip()
    arch, tied, kind, config, written = FILES[name]
    monkeypatch.setenv("FASTSPEC_MODEL_CACHE", str(tmp_path / "cache"))
    model = tiny_model(arch, tied, hidden_size=256, intermediate_size=512, **config)
    torch.manual_seed(1)
    with torch.no_grad():  # a trained model's scales: activations neither grow layer by layer nor saturate
        for p_name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0, 1.0 if "embed" in p_name else p.shape[1] ** -0.5)
    path = write_gguf(tmp_path / f"{name}.gguf", model, qtype=kind, **written)
    prompt = np.random.default_rng(0).integers(3, len(TOKENS), 8).tolist()
    greedy, theirs = llama_cpp_answer(llama_cpp, path, prompt, 12)
    with torch.no_grad():
        ours = transformers_model(convert_gguf(path, tmp_path / "hf"))(torch.tensor([prompt + greedy])).logits[0]
    tolerance = (0.005 if kind == Q.F32 else 0.1) * float(theirs.std())
    assert float((ours - theirs).abs().max()) < tolerance
    llm = fastspec.LLM(str(path), speculative_algorithm="NONE", max_total_tokens=256)
    answer = llm.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].output_ids
    top2 = theirs[len(prompt) - 1:].topk(2, -1).values  # [new, 2]: llama.cpp's best two at each answer position
    near_tie = next((i for i, (a, b) in enumerate(top2.tolist()) if a - b < 2 * tolerance), len(greedy))
    assert list(answer[:near_tie]) == greedy[:near_tie]


@pytest.mark.parametrize("vocab", ["bpe-smollm", "spm-None-None", "split-llama-bpe", *END_VOCABS])
def test_end_of_generation_tokens_equal_llama_cpps(tmp_path, vocab):
    llama_cpp = llama_cpp_or_skip()
    extra, ids, _ = END_VOCABS.get(vocab, ((), {}, None))
    path, tok = converted_tokenizer(tmp_path, VOCABS[vocab] if vocab in VOCABS else bpe_vocab(extra=extra, ids=ids))
    theirs = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocabulary = llama_cpp.llama_model_get_vocab(theirs.model)
    eog = [i for i in range(len(tok)) if llama_cpp.llama_vocab_is_eog(vocabulary, i)]
    assert end_ids(tmp_path) == eog
