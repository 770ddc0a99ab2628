"""Draft-head configs in the formats heads are published in, read as the SGLang / SpecForge config they equal (the
one fastspec.models.model_config reads). vLLM's `speculators` format (`Eagle3DraftModel`, older `Eagle3Speculator`):

  geometry nested in `transformer_layer_config` (a Llama config)       -> the top level, with its model_type
                                                                          (transformers' AutoConfig needs it)
  `eagle_aux_hidden_state_layer_ids` naming the layer whose INPUT is   -> ids - 1 in `eagle_config` (SGLang's ids
    captured (vLLM's convention)                                           name the layer whose output is)
  `norm_before_residual`, `norm_before_fc`, `draft_vocab_size`,         -> kept
    `target_hidden_size` (null: the hidden size)
  fc: a bias only in the old `Eagle3Speculator` (or where the weights   -> `bias`
    hold one)
Its weights name the midlayer `layers.0.*` (renamed by the loader). Torch-free; reads no weights itself.
"""

from __future__ import annotations

from fastspec.errors import FastspecError

SPECULATORS_ARCHITECTURES = ("Eagle3DraftModel", "Eagle3Speculator")


def is_speculators(raw: dict) -> bool:
    archs = raw.get("architectures") or [None]
    return "speculators_model_type" in raw or archs[0] in SPECULATORS_ARCHITECTURES


def from_speculators(raw: dict, source: str, fc_bias: bool | None = None) -> dict:
    """The SGLang-format EAGLE-3 config a speculators config describes (see the module docstring); `fc_bias`:
    whether its weights hold fc.bias (None: unknown, e.g. a config fetched alone)."""
    kind = raw.get("speculators_model_type", "eagle3")
    if kind != "eagle3":
        raise FastspecError(f"{source}: speculators model type {kind!r} is not supported (eagle3)")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise FastspecError(f"{source}: a speculators config without its transformer_layer_config")
    if layer.get("model_type", "llama") != "llama":
        raise FastspecError(f"{source}: a speculators head with {layer.get('model_type')} layers is not supported "
                            "(llama layers)")
    arch = (raw.get("architectures") or ["Eagle3DraftModel"])[0]
    out = {k: v for k, v in layer.items() if k not in ("architectures", "model_type", "auto_map")}
    out |= {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "draft_vocab_size": raw.get("draft_vocab_size"),
            "target_hidden_size": raw.get("target_hidden_size") or layer.get("hidden_size"),
            "bias": fc_bias if fc_bias is not None else arch == "Eagle3Speculator",
            "norm_before_residual": bool(raw.get("norm_before_residual", False)),
            "norm_before_fc": bool(raw.get("norm_before_fc", False))}
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise FastspecError(f"{source}: eagle_aux_hidden_state_layer_ids {ids!r} is not a list of layer ids")
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids]}
    return out


SGLANG_ONLY = ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_config", "bias",
               "norm_before_residual", "norm_before_fc", "num_hidden_layers")


def to_speculators(raw: dict, state: dict, verifier: dict, source: str) -> tuple[dict, dict]:
    """(config, state dict) of an SGLang-format EAGLE-3 head (`raw` its config, `state` its tensors named as
    fastspec names them: midlayer.*) in the speculators format vLLM loads (see the module docstring); `verifier`:
    the target as speculators records it ({"name_or_path", "architectures"}). An fc bias has no speculators form:
    refused."""
    import torch

    if (raw.get("architectures") or [None])[0] not in ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"):
        raise FastspecError(f"{source}: only EAGLE-3 heads have a speculators form (this is "
                            f"{(raw.get('architectures') or ['?'])[0]})")
    if "fc.bias" in state:
        raise FastspecError(f"{source}: this head's fc has a bias, which speculators' Eagle3DraftModel has not")
    layer = {k: v for k, v in raw.items() if k not in SGLANG_ONLY} | {"model_type": "llama", "num_hidden_layers": 1}
    vocab = int(raw["vocab_size"])
    draft_vocab = int(raw.get("draft_vocab_size") or vocab)
    config = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
              "transformer_layer_config": layer, "draft_vocab_size": draft_vocab,
              "target_hidden_size": raw.get("target_hidden_size"),
              "norm_before_residual": bool(raw.get("norm_before_residual", False)),
              "norm_before_fc": bool(raw.get("norm_before_fc", False)),
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                           "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                     "verifier": verifier}}
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = [int(i) + 1 for i in ids]
    out = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
           for k, v in state.items() if k != "t2d"}
    if draft_vocab != vocab:  # both maps, as speculators keeps them (draft id -> target offset, target id -> kept)
        d2t = state.get("d2t", torch.zeros(draft_vocab, dtype=torch.int64)).long()
        out["d2t"] = d2t
        out["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, d2t + torch.arange(draft_vocab), True)
    else:
        out.pop("d2t", None)
    return config, out
