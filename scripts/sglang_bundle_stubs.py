"""Empty stand-in wheels for the packages scripts/sglang_gpu_bundle.sh leaves out of the SGLang bundle.

`python scripts/sglang_bundle_stubs.py SGLANG_WHEEL LEAVE_OUT_REGEX OUT_DIR` writes, for every requirement of the
sglang wheel whose name matches the regex, a wheel with that name, the version the requirement pins (`==V`, or
the lower bound of `>=V`) plus the local label `+stub`, and no dependencies. pip's resolver then takes these
instead of the real packages (the GPU image has torch; the kernel libraries are optional), so a metadata-only
resolve (`pip install --dry-run --report`) neither downloads nor fails on their CUDA pins. Used for resolving only:
the stubs are never packed.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement


def stub(name: str, version: str, out: Path) -> Path:
    dist = re.sub(r"[-_.]+", "_", name).lower()
    path = out / f"{dist}-{version}+stub-py3-none-any.whl"
    info = f"{dist}-{version}+stub.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}+stub\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tidal-stub\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


def main(wheel: str, leave_out: str, out_dir: str) -> None:
    pattern, out = re.compile(leave_out), Path(out_dir)
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist: "):
            continue
        req = Requirement(line.removeprefix("Requires-Dist: "))
        if req.marker is not None and not req.marker.evaluate({"extra": "", "sys_platform": "linux",
                                                               "platform_machine": "x86_64"}):
            continue
        if not pattern.match(req.name.lower().replace("_", "-")):
            continue
        pins = [s.version for s in req.specifier if s.operator in ("==", ">=")]
        print(f"stub: {stub(req.name, pins[0] if pins else '99.0', out).name}")
    for name in ("triton",):  # pulled in by the stubbed torch's real dependants (flashinfer, xgrammar)
        print(f"stub: {stub(name, '3.7.0', out).name}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
