"""OptionError's words name what the user gave only by placeholders: a value typed with braces (a device, a model
directory's path, an ngram field) is printed verbatim, never read as an option's placeholder, whether LLM names the
options (`str(e)`) or a command names them by its flags (`e.told(flag)`)."""

import json

import pytest

from fastspec.config import check_device
from fastspec.errors import OptionError
from fastspec.models.loader import read_config
from fastspec.models.sources import check_draft, check_int4_rounding, resolve_quantization
from fastspec.spec_config import NgramError, NgramParams, check_spec_flags

FLAGS = {"device": "--device", "quantization": "--quantization", "num_steps": "--speculative-num-steps"}


def flag(name: str) -> str:
    """A command's flag for `name` (ngram's fields: `--speculative-ngram-*`)."""
    return FLAGS.get(name) or f"--speculative-ngram-{name.replace('_', '-')}"


def refusal(call, *args) -> OptionError:
    with pytest.raises(OptionError) as refused:
        call(*args)
    return refused.value


def llama_dir(path, architecture="LlamaForCausalLM"):
    """A model directory holding only a tiny Llama's config.json (hidden size 48: not a multiple of int4's groups)."""
    path.mkdir(exist_ok=True)
    config = dict(architectures=[architecture], model_type="llama", hidden_size=48, intermediate_size=96,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=128, rms_norm_eps=1e-6)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("device", ["{device}", "{device=}", "{device=cpu}"])
def test_a_braced_device_is_quoted_verbatim(device):
    e = refusal(check_device, device)
    assert str(e) == f"device must be auto, cpu or cuda[:N], got {device!r}"
    assert e.told(flag) == f"--device must be auto, cpu or cuda[:N], got {device!r}"


def test_a_braced_model_dir_is_printed_verbatim(tmp_path):
    model_dir = llama_dir(tmp_path / "{quantization=}")
    e = refusal(resolve_quantization, "awq", model_dir, None, "cpu", "auto", None)
    words = f"{model_dir} is a float checkpoint (no quantization_config); fp8, int8 or int4 round one at load"
    assert str(e) == f"quantization='awq': {words}"
    assert e.told(flag) == f"--quantization awq: {words}"
    e = refusal(check_int4_rounding, "int4", read_config(model_dir), model_dir)
    assert str(e).startswith(f"quantization='int4' rounds groups of 32 inputs, but {model_dir}'s hidden size 48 ")
    assert e.told(flag).startswith(f"--quantization int4 rounds groups of 32 inputs, but {model_dir}'s hidden ")


def test_a_braced_draft_dir_is_printed_verbatim(tmp_path):
    target = read_config(llama_dir(tmp_path / "target"))
    draft_dir = llama_dir(tmp_path / "{quantization}", "LlamaForCausalLMEagle")
    e = refusal(check_draft, "EAGLE", read_config(draft_dir), target, draft_dir, "gguf")
    assert str(e).startswith(f"{draft_dir}: an EAGLE-2 head needs the target's float lm_head, which "
                             "quantization='gguf' does not keep")
    assert e.told(flag).startswith(f"{draft_dir}: an EAGLE-2 head needs the target's float lm_head, which "
                                   "--quantization gguf does not keep")


def test_a_braced_ngram_field_is_quoted_verbatim():
    e = refusal(NgramParams, 1, 12, 1, 10, "BFS", 18, "{branch_length=}")
    assert isinstance(e, NgramError)
    assert str(e) == "ngram capacity='{branch_length=}' must be an integer"
    assert e.told(flag) == "--speculative-ngram-capacity {branch_length=} must be an integer"


def test_a_braced_tree_option_is_quoted_verbatim():
    e = refusal(check_spec_flags, "EAGLE3", "{num_steps}")
    assert str(e) == "num_steps must be an integer, got '{num_steps}'"
    assert e.told(flag) == "--speculative-num-steps must be an integer, got '{num_steps}'"
