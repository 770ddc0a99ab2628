"""bench/mutants.py plants each bug by an exact edit: every mutant's text must still occur once in its file, and the
tests it names must exist, or a refactor silently retires the check (the script stops at the first stale mutant)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_mutants():
    spec = importlib.util.spec_from_file_location("bench_mutants", ROOT / "bench" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are built
    spec.loader.exec_module(module)
    return module.MUTANTS


def test_every_mutant_edits_text_that_occurs_once_and_names_tests_that_exist():
    stale = []
    for m in load_mutants():
        count = (ROOT / m.path).read_text().count(m.old)
        if count != 1:
            stale.append(f"{m.name}: its text occurs {count} times in {m.path}")
        for test in m.tests:
            path, _, name = test.partition("::")
            if not (ROOT / path).is_file() or (name and f"def {name}(" not in (ROOT / path).read_text()):
                stale.append(f"{m.name}: no test {test}")
    assert stale == []
