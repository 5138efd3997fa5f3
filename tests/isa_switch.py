"""Test helper: generate code for another ISA inside a block (JITKERN_ISA is read per call)."""
import contextlib
import os


@contextlib.contextmanager
def isa(name):
    """Kernels called inside the block are built for `name` ("host": the detected ISA)."""
    before = os.environ.get("JITKERN_ISA")
    if name != "host":
        os.environ["JITKERN_ISA"] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("JITKERN_ISA", None)
        else:
            os.environ["JITKERN_ISA"] = before
