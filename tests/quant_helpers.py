"""What the quantised-checkpoint tests share: the prompts, the `quantised` fixture (each method's checkpoint of a
tiny model and its transformers oracle, written on first use), and a prefill's logits / transformers' greedy tokens
to compare against."""

import pytest
import torch

from quant_writers import write_quantised

PROMPTS = [[5, 9, 13, 3, 40], [7, 7, 8, 60, 61, 62, 7, 7]]


def needs(method):
    if method.startswith("ct_"):
        pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="session")  # (test_quantised_checkpoints and test_quant_configs share it)
def quantised(tiny_dirs, tmp_path_factory):
    """method -> (directory, transformers oracle over the dequantised weights), made on first use."""
    made = {}

    def get(method, family="llama"):
        if (method, family) not in made:
            needs(method)
            d = tmp_path_factory.mktemp(f"{method}-{family}")
            made[method, family] = d, write_quantised(tiny_dirs[family][1], d, method)
        return made[method, family]
    return get


def logits(model, ids):
    """A prefill's logits [T, V] through a KV pool (and the recurrent states of a hybrid model)."""
    from conftest import PoolRunner

    with torch.inference_mode():
        return model.compute_logits(PoolRunner(model).extend([0], [ids.tolist()]).final)

