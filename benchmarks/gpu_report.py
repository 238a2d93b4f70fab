"""The GPU report: the kernel tests on this host's device plus benchmarks/kernels.py, printed as
ONE JSON object {"device", "kernel_tests": {...}, "benchmark": {...}}.

    make gpu-report                               # .venv's python if there is one, else python3
    make gpu-report PY=python3 BENCH_ARGS="--repeats 3 --long-context 0"
    python3 benchmarks/gpu_report.py [benchmarks/kernels.py flags ...]

Needs only torch, Triton, transformers and pytest (the lent GPU image has them; no .venv, no
install). Without pydantic the tests that build an OptimizationSpec error at collection and the
benchmark's tiny-model section is skipped: the report says so (REFERENCE.md §12 shows how to add
pydantic with `pip install --target`). Exit status 0 only when every kernel test passed and the
benchmark's correctness checks all held.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def kernel_tests() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "kernels.xml"
        proc = subprocess.run([sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"],
                              cwd=ROOT, capture_output=True, text=True, check=False)
        out = {"command": "python -m pytest tests/kernels -q", "exit_code": proc.returncode}
        if not xml.exists():
            return {**out, "error": (proc.stdout + proc.stderr)[-2000:]}
        root = ET.parse(xml).getroot()
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
        bad = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
               if c.find("failure") is not None or c.find("error") is not None]
    return {"passed": count["tests"] - count["failures"] - count["errors"] - count["skipped"], "failed": count["failures"],
            "errors": count["errors"], "skipped": count["skipped"], **out, "not_passed": bad[:50],
            "summary": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""}


def benchmark(argv: list[str]) -> tuple[dict, int]:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels.py"), *argv], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True, check=False)  # its stderr (tracebacks) goes straight through
    for line in reversed(proc.stdout.strip().splitlines()):
        try:
            return json.loads(line), proc.returncode
        except json.JSONDecodeError:
            continue
    return {"error": "benchmarks/kernels.py printed no JSON", "exit_code": proc.returncode,
            "stdout_tail": proc.stdout[-2000:]}, proc.returncode or 1


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--help"], cwd=ROOT, check=False)
        return 0
    import torch

    cuda = torch.cuda.is_available()
    report: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu (no CUDA device: kernel tests ran on the Triton interpreter)",
                    "torch": torch.__version__, "cuda": torch.version.cuda}
    if importlib.util.find_spec("pydantic") is None:
        report["note"] = ("pydantic is not installed: kernel tests that build an OptimizationSpec error at collection and the "
                          "benchmark's tiny-model section is skipped (REFERENCE.md §12: carry the wheels, pip install --target)")
    os.environ.pop("CANARY_KERNELS", None)  # the default dispatch: Triton on CUDA
    report["kernel_tests"] = kernel_tests()
    report["benchmark"], rc = benchmark(argv)
    print(json.dumps(report))
    t = report["kernel_tests"]
    return 0 if rc == 0 and t.get("exit_code") == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
