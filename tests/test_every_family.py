"""Every causal LM family transformers registers: exact or refused in one line, never silently wrong, never an
error from inside the engine; docs/guide.md's table says which, as this test finds it (tests/every_family.py)."""

import pytest
import transformers
from every_family import classify, guide_table, registered, table

FOUND: dict = {}


@pytest.mark.parametrize("model_type", registered())
def test_family_is_exact_or_refused_in_one_line(model_type):
    outcome = classify(model_type)
    FOUND[model_type] = outcome
    assert outcome.status in ("exact", "refused", "not built"), f"{model_type}: {outcome.status}: {outcome.detail}"


def test_the_guide_lists_every_family_as_this_test_found_it():
    written = guide_table()
    assert written is not None, "docs/guide.md has no every-family table: python tests/every_family.py writes it"
    if f"transformers {transformers.__version__}:" not in written:
        pytest.skip(f"the guide's table was written with another transformers than {transformers.__version__}")
    if set(FOUND) != set(registered()):
        pytest.skip("only some families ran (-k): the table is compared after all of them")
    assert written == table([FOUND[m] for m in registered()]), \
        "docs/guide.md's every-family table differs from this run's: python tests/every_family.py rewrites it"
