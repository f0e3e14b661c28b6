"""lq_lock_layers (lq_admit_decide's step 3) is written twice: it waits for its
locks, or, after the fast path, takes them SKIP LOCKED (sql/admission.sql says
why). The two statements stay alike but for that clause;
tests/integration/test_lock_order.py shows the order it keeps.
"""

from __future__ import annotations

from llmquota.store.sqlfiles import script

FUNCTION = "CREATE OR REPLACE FUNCTION lq_lock_layers("
WAITING = "    IF p_wait THEN\n"
SKIPPING = "    ELSE\n"
END = "    END IF;\n"


def _code(text: str) -> str:
    """The statement without its comment lines."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))


def test_step_three_locks_alike_with_and_without_waiting() -> None:
    text = script("admission.sql")
    start = text.index(WAITING, text.index(FUNCTION))
    middle = text.index(SKIPPING, start)
    end = text.index(END, middle)
    waiting = _code(text[start + len(WAITING) : middle])
    skipping = _code(text[middle + len(SKIPPING) : end])
    assert waiting.startswith("    RETURN (SELECT array_agg(lq_locked_layer_of(x.row))")
    assert waiting.count("FOR UPDATE") == 1
    assert "SKIP LOCKED" not in waiting
    assert skipping == waiting.replace("FOR UPDATE)", "FOR UPDATE SKIP LOCKED)")
