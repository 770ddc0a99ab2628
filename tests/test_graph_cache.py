"""`--graphs compile` across processes: a second process with the same model and tree shape compiles nothing
(Inductor's on-disk cache serves every graph, though its KV pool has another size), a changed tree shape misses
the cache (the key is not too loose), and all of them decode exactly what eager decoding does.

Each run is a fresh Python process over a fresh Inductor cache of this test's own (the suite's shared one may
already hold these graphs). Buckets are prepared lazily: one prompt compiles bucket 1 only.
"""

import json
import os
import subprocess
import sys

from test_speculative import PROMPTS, spec_llm

from fastspec.sampling import SamplingParams

RUN = """
import json, sys
from torch._dynamo.utils import counters
import fastspec
from fastspec.sampling import SamplingParams
model, draft, steps, total, prompt = json.loads(sys.argv[1])
prepared = []
llm = fastspec.LLM(model, speculative_algorithm="EAGLE3", draft_model=draft, num_steps=steps, topk=1,
                   max_total_tokens=total, graphs="compile", on_prepare=lambda name, bs: prepared.append([name, bs]))
out = llm.engine.generate([prompt], [SamplingParams(max_new_tokens=12, ignore_eos=True)])[0]
print(json.dumps({"ids": out.output_ids, "prepared": prepared, "miss": counters["inductor"]["fxgraph_cache_miss"],
                  "hit": counters["inductor"]["fxgraph_cache_hit"]}))
"""


def run(tmp_path, model, draft, steps, total):
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)  # vectorized kernels, as a user's run compiles (conftest: scalar)
    args = json.dumps([model, draft, steps, total, PROMPTS[1]])
    done = subprocess.run([sys.executable, "-c", RUN, args], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_compiles_nothing_and_a_new_shape_recompiles(tmp_path, tiny_dirs, draft_dirs):
    model, draft = str(tiny_dirs["llama"][0]), str(draft_dirs["llama"]["eagle3"])
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    eager = {steps: spec_llm(tiny_dirs, draft_dirs, "llama", "EAGLE3", "eagle3", steps, 1, None, 1).engine.generate(
        [PROMPTS[1]], [params])[0].output_ids for steps in (2, 3)}

    cold = run(tmp_path, model, draft, 2, 4096)
    assert cold["ids"] == eager[2]
    assert cold["miss"] >= 3 and cold["hit"] == 0  # draft loop, draft extend, verify: compiled from scratch
    assert {name for name, _ in cold["prepared"]} == {"draft loop", "draft extend", "verify"}
    assert {bs for _, bs in cold["prepared"]} == {1}  # lazily: only the bucket one request needs

    warm = run(tmp_path, model, draft, 2, 3000)  # another KV pool size, as free memory gives a new one each run
    assert warm["ids"] == eager[2]
    assert warm["miss"] == 0 and warm["hit"] >= 3

    changed = run(tmp_path, model, draft, 3, 3000)  # one more draft step: every graph has new shapes
    assert changed["ids"] == eager[3]
    assert changed["miss"] >= 3
