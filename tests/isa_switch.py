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


@contextlib.contextmanager
def bf16_dot(native, tmp_dir):
    """bf16 GEMMs inside the block run the vdpbf16ps tile (native) or the widened fp32 one, through
    a tuning DB in tmp_dir that holds that choice (the gemm.bf16.dot knob)."""
    from jitkern.codegen import tunedb

    before = os.environ.get("JITKERN_TUNE_DB"), os.environ.get("JITKERN_NO_TUNE")
    os.environ["JITKERN_TUNE_DB"] = os.path.join(tmp_dir, f"dot-{int(native)}.json")
    os.environ.pop("JITKERN_NO_TUNE", None)
    try:
        tunedb.store("gemm.bf16.dot", "all", {"native": bool(native)})
        yield
    finally:
        for key, value in zip(("JITKERN_TUNE_DB", "JITKERN_NO_TUNE"), before):
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def bf16_path(name, tmp_dir):
    """A bf16 GEMM path: "host-native" / "host-widened" (the host's ISA, the dot-product knob
    forced), else an ISA name as isa()."""
    if name.startswith("host-"):
        with bf16_dot(name == "host-native", tmp_dir):
            yield
    else:
        with isa(name):
            yield
