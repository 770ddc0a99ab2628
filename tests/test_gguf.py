"""GGUF conversion: weights, tokenizer and refusals (the conversion cache and the embedded model: test_shared_dirs).

Oracles: a tiny random LlamaForCausalLM written to GGUF the way llama.cpp lays it out (logits must survive the
round trip), the two RoPE conventions written from their definitions (attention scores must agree) and hand-worked
BPE tokenizations.
"""

import json

import gguf
import pytest
import torch
from gguf_writers import TOKENS, tiny_llama, write_gguf
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, LlamaForCausalLM

from fastspec.errors import FastspecError
from fastspec.models.gguf import convert_gguf
from fastspec.models.gguf_read import unpermute_rope_rows
from fastspec.models.reference import transformers_model

# ---- rope layout: the oracle for unpermute_rope_rows ----

def rope_half(q: torch.Tensor, pos: int, base: float = 10000.0) -> torch.Tensor:  # q: [n_head, d]
    """HF: pairs (j, j + d/2) rotated by pos * base^(-2j/d)."""
    d = q.shape[-1]
    angle = pos * base ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    x1, x2 = q[:, : d // 2], q[:, d // 2:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], dim=-1)


def rope_adjacent(q: torch.Tensor, pos: int, base: float = 10000.0) -> torch.Tensor:  # q: [n_head, d]
    """ggml normal mode: pairs (2j, 2j + 1) rotated by pos * base^(-2j/d)."""
    d = q.shape[-1]
    angle = pos * base ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    x1, x2 = q[:, 0::2], q[:, 1::2]
    return torch.stack([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], -1).flatten(1)


@settings(max_examples=40, deadline=None)
@given(n_head=st.integers(1, 4), half=st.integers(1, 8), m=st.integers(0, 50), n=st.integers(0, 50),
       seed=st.integers(0, 1000))
def test_unpermuted_rows_give_llamacpp_attention_scores(n_head, half, m, n, seed):
    g = torch.Generator().manual_seed(seed)
    d, hidden = 2 * half, 8
    wq_gguf = torch.randn(n_head * d, hidden, generator=g, dtype=torch.float64)
    wk_gguf = torch.randn(n_head * d, hidden, generator=g, dtype=torch.float64)
    x_m, x_n = torch.randn(2, hidden, generator=g, dtype=torch.float64)
    scores_llamacpp = (rope_adjacent((wq_gguf @ x_m).view(n_head, d), m)
                       * rope_adjacent((wk_gguf @ x_n).view(n_head, d), n)).sum(-1)
    wq_hf, wk_hf = unpermute_rope_rows(wq_gguf, n_head), unpermute_rope_rows(wk_gguf, n_head)
    scores_hf = (rope_half((wq_hf @ x_m).view(n_head, d), m) * rope_half((wk_hf @ x_n).view(n_head, d), n)).sum(-1)
    torch.testing.assert_close(scores_hf, scores_llamacpp)


def test_unpermute_worked_example():
    w = torch.arange(8.0).view(8, 1)  # 2 heads of d=4; GGUF rows [a0, b0, a1, b1] per head
    assert unpermute_rope_rows(w, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


# ---- tiny round trip ----

@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gguf_round_trip_logits(tmp_path, tied):
    model = tiny_llama(tied)
    out = convert_gguf(write_gguf(tmp_path / "tiny.gguf", model), tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied and config["num_key_value_heads"] == 2
    assert (config["head_dim"], config["rms_norm_eps"], config["rope_theta"]) == (16, 1e-5, 10000.0)
    loaded = LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, len(TOKENS), (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
    assert not list(tmp_path.glob(".hf.*")), "temp directories left behind"


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0])
def test_tiny_gguf_quantized_weights_dequantize_in_place(tmp_path, qtype):
    model = tiny_llama(tied=False)
    out = convert_gguf(write_gguf(tmp_path / "q.gguf", model, qtype=qtype), tmp_path / "hf", dtype=torch.float16)
    loaded = transformers_model(out)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    for name, p in model.state_dict().items():  # Q8_0: error <= half a step of max|block| / 127
        torch.testing.assert_close(loaded.state_dict()[name], p, atol=0.3 * 4 / 127, rtol=0.01)


def test_tiny_tokenizer(tmp_path):
    out = convert_gguf(write_gguf(tmp_path / "tiny.gguf", tiny_llama(True)), tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(out)
    ids = TOKENS.index
    # digits are split one by one before BPE, so the "1 2" merge never fires; add_bos_token prepends bos
    assert tok.encode(" the 12") == [1, ids("Ġthe"), ids("Ġ"), ids("1"), ids("2")]
    assert tok.encode("hello", add_special_tokens=False) == [ids("he"), ids("ll"), ids("o")]
    assert tok.encode("<|im_end|>x<custom>", add_special_tokens=False) == [2, ids("x"), ids("<custom>")]
    assert tok.decode(tok.encode("<|im_start|> the<custom>"), skip_special_tokens=True) == " the<custom>"
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<|im_start|>", "<|im_end|>",
                                                                           "<|endoftext|>", "<|endoftext|>")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 0]  # (llama.cpp's ends)


@pytest.mark.parametrize("add_bos, add_eos", [(False, False), (False, True), (True, True)])
def test_tiny_tokenizer_bos_eos_flags(tmp_path, add_bos, add_eos):
    path = write_gguf(tmp_path / "t.gguf", tiny_llama(True), add_bos=add_bos, add_eos=add_eos)
    tok = AutoTokenizer.from_pretrained(convert_gguf(path, tmp_path / "hf"))
    h, ll = TOKENS.index("he"), TOKENS.index("ll")
    assert tok.encode("hell") == [1] * add_bos + [h, ll] + [2] * add_eos
    bos, eos = [1] * add_bos, [2] * add_eos
    assert tok("hell", "he")["input_ids"] == bos + [h, ll] + eos + bos + [h] + eos


def test_a_continued_final_message_gets_no_end_token_after_it(tmp_path):
    """A converted GGUF whose tokenizer adds an end token (add_eos_token) ends a chat prompt with it, as llama.cpp
    tokenizes any prompt; a continued final message does not get it: the prompt ends inside that message, at its
    content, for the answer to continue it (an end token there would end the turn being continued)."""
    from fastspec.text.tokenizer import Tokenizer

    path = write_gguf(tmp_path / "t.gguf", tiny_llama(True), add_bos=True, add_eos=True)
    tok = Tokenizer(convert_gguf(path, tmp_path / "hf"))
    chat = [{"role": "user", "content": "hell"}, {"role": "assistant", "content": "the"}]
    body = tok.encode("user\nhell<|im_end|>\n<|im_start|>assistant\nthe", add_special_tokens=False)
    assert tok.encode_chat(chat, continue_final_message=True) == [1, *body]  # (bos: <|im_start|>, eos: <|im_end|>)
    assert tok.encode_chat(chat, add_generation_prompt=False) == [1, *body, 2, *tok.encode("\n", False), 2]


# ---- errors and atomicity ----

@settings(max_examples=25, deadline=None)
@given(fraction=st.floats(0.0, 0.999))
def test_truncated_gguf_is_rejected(tmp_path_factory, fraction):
    tmp = tmp_path_factory.mktemp("trunc")
    data = write_gguf(tmp / "full.gguf", tiny_llama(True)).read_bytes()
    (tmp / "cut.gguf").write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(FastspecError, match="not a valid GGUF file"):
        convert_gguf(tmp / "cut.gguf", tmp / "hf")
    assert not (tmp / "hf").exists()


def test_a_tensor_type_the_gguf_package_does_not_know_is_refused_by_its_id(tmp_path):
    """A valid file holding a type newer than the gguf package (llama.cpp's quantiser writes Q2_0, GGML type 42, that
    gguf 0.19 cannot name): one line naming the tensor and the type id, not 'not a valid GGUF file'."""
    path = write_gguf(tmp_path / "t.gguf", tiny_llama(True))
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # after the name: n_dims (u32), two dims (u64), then the type (u32)
    data[at:at + 4] = (42).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(FastspecError, match=r"tensor blk.0.attn_q.weight has GGML type 42, which gguf \d"):
        convert_gguf(path, tmp_path / "hf")


@pytest.mark.parametrize("kind", ["Q8_1", "I8"])
def test_a_tensor_type_the_gguf_package_cannot_dequantise_is_refused_by_the_tensors_name(tmp_path, kind):
    """A type the gguf package knows but cannot dequantise (Q8_1, the integer types, Q1_0): one line naming the
    tensor and its type."""
    qtype = gguf.GGMLQuantizationType[kind]
    path = write_gguf(tmp_path / "t.gguf", tiny_llama(True), raw_kinds={"blk.1.ffn_up.weight": qtype})
    with pytest.raises(FastspecError, match=f"tensor blk.1.ffn_up.weight has type {kind}, which gguf \\d.* cannot "
                                            "dequantise: not supported"):
        convert_gguf(path, tmp_path / "hf")


def test_other_architecture_is_rejected(tmp_path):
    with pytest.raises(FastspecError, match="architecture 'gemma' is not supported .supported: llama, qwen2, qwen3"):
        convert_gguf(write_gguf(tmp_path / "g.gguf", tiny_llama(True), arch="gemma"), tmp_path / "hf")
