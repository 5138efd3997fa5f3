"""Every ```python block of README.md runs as written, so the README cannot drift from the API.

A block may use a batch it does not define (dense, offsets, indices, labels): the test supplies a
small one (13 dense features, 3 tables of at least 10 rows). Any other undefined name fails.
"""
import ast
import builtins
import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = [(README.read_text()[:m.start()].count("\n") + 1, m.group(1))
          for m in re.finditer(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)]


def _batch() -> dict:
    from jitkern.dlrm import SyntheticData
    b = SyntheticData([10, 10, 10], 13, batch_size=8, num_batches=1).batch(0, 0)
    return {"dense": b.dense, "offsets": b.offsets, "indices": b.indices, "labels": b.labels}


def _free_names(code: str) -> set:
    """Names the block reads but neither assigns, imports nor gets from builtins."""
    tree = ast.parse(code)
    bound, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound - set(dir(builtins))


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_python_block_runs(line, code):
    free = _free_names(code)
    supplied = _batch() if free else {}
    unknown = free - set(supplied)
    assert not unknown, f"README.md:{line} uses {sorted(unknown)} without defining them"
    namespace = {k: v for k, v in supplied.items() if k in free}
    exec(compile(code, f"README.md:{line}", "exec"), namespace)
    for value in namespace.values():            # whatever the block computed is finite
        if isinstance(value, np.ndarray) and value.dtype.kind == "f":
            assert np.isfinite(value).all()
