"""The GPU report in sections, each a separate command that writes its own JSON file the moment it
ends, so that a device call cut off at its time limit still brings back what finished.

    make gpu-report                                   # every section in turn, each written as it ends
    make gpu-report PY=python3 BENCH_ARGS="--section decode --long-context 0 --repeats 3"
    python3 benchmarks/gpu_report.py --section tests [--out DIR] [--section-timeout 540]
    python3 benchmarks/gpu_report.py --section w4a16 attention [benchmarks/kernel_bench.py flags ...]
    python3 benchmarks/gpu_report.py --device cpu --smoke     # rehearse every section here (no GPU)

Sections: tests (pytest tests/kernels on this host's device, --continue-on-collection-errors,
its JUnit XML beside the JSON), then w4a16, attention, decode and tiny (benchmarks/kernel_bench.py
with only that section; every one also measures the copy bandwidth its fractions divide by).
Each writes DIR/<section>.json (default DIR: benchmarks/results/gpu; with --smoke out/gpu-smoke)
and prints a progress line on stderr as it starts and ends; the end prints one JSON object
{"device", "out", "sections": {name: {"file", "exit_code", "wall_s"}}} on stdout.

Needs only torch, Triton, transformers and pytest (the lent GPU image has them; no .venv, no
install). Without pydantic the engine-level kernel tests skip and the tiny-model section says it
is skipped: docs/benchmarks.md "GPU report" shows how to carry the pydantic wheels. Exit status 0 only when
every section ran to the end, every kernel test passed and every benchmark check held.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "benchmarks" / "kernel_bench.py"
BENCH_SECTIONS = ("w4a16", "attention", "decode", "tiny")  # benchmarks/kernel_bench.py's own section names
SECTIONS = ("tests", *BENCH_SECTIONS)
SMOKE_TESTS = ["tests/kernels/test_fp8_kv.py", "tests/kernels/test_collect_without_pydantic.py"]


def progress(msg: str) -> None:
    print(f"[gpu-report {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="benchmarks/gpu_report.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Any other flag goes to benchmarks/kernel_bench.py (its --help lists them).")
    ap.add_argument("--section", nargs="+", choices=(*SECTIONS, "all"), default=["all"],
                    help="sections to run, in the order given (default: all, in the order above)")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for <section>.json (default benchmarks/results/gpu; out/gpu-smoke with --smoke)")
    ap.add_argument("--section-timeout", type=float, default=None,
                    help="seconds a section may run before it is stopped, its JSON saying so (default: none)")
    ap.add_argument("--tests", nargs="+", default=None,
                    help="what the tests section gives pytest (default tests/kernels; two small files with --smoke)")
    ap.add_argument("--device", default="cuda", help="passed to benchmarks/kernel_bench.py (cpu needs --smoke)")
    ap.add_argument("--smoke", action="store_true", help="to benchmarks/kernel_bench.py: tiny shapes, measures nothing")
    args, rest = ap.parse_known_args(argv)
    sections = list(SECTIONS) if "all" in args.section else list(dict.fromkeys(args.section))
    args.section = sections
    if args.out is None:
        args.out = ROOT / ("out/gpu-smoke" if args.smoke else "benchmarks/results/gpu")
    if args.tests is None:
        args.tests = SMOKE_TESTS if args.smoke else ["tests/kernels"]
    return args, rest


def run_streamed(cmd: list[str], timeout: float | None, echo_stdout: bool) -> tuple[int | None, str, bool]:
    """Run cmd from the repository root, its stderr passed straight through (progress, tracebacks);
    stdout kept (and echoed to stderr when echo_stdout). → (exit code, stdout, timed out)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CANARY_KERNELS", None)  # the default dispatch: Triton on CUDA
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, bufsize=1)
    timed_out = threading.Event()

    def stop() -> None:
        timed_out.set()
        proc.kill()

    timer = threading.Timer(timeout, stop) if timeout else None
    if timer:
        timer.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if echo_stdout:
                sys.stderr.write(line)
                sys.stderr.flush()
        proc.wait()
    finally:
        if timer:
            timer.cancel()
    return proc.returncode, "".join(lines), timed_out.is_set()


def kernel_tests(args) -> dict:
    xml = args.out / "tests.xml"
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", *args.tests, "-v", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", f"--junitxml={xml}"]
    rc, out, timed_out = run_streamed(cmd, args.section_timeout, echo_stdout=True)
    res: dict = {"command": " ".join(["python", *cmd[1:-1]]), "exit_code": rc, "junit_xml": xml.name}
    if timed_out:
        res["error"] = f"stopped after {args.section_timeout:g} s (--section-timeout)"
    if not xml.exists():
        return {**res, "error": res.get("error", "pytest wrote no JUnit XML"),
                "output_tail": list(deque(out.splitlines(), 40))}
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    bad = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
           if c.find("failure") is not None or c.find("error") is not None]
    lines = out.strip().splitlines()
    return {**res, "passed": count["tests"] - count["failures"] - count["errors"] - count["skipped"],
            "failed": count["failures"], "errors": count["errors"], "skipped": count["skipped"], "not_passed": bad[:50],
            "summary": lines[-1] if lines else ""}


def benchmark(args, section: str, passthrough: list[str]) -> dict:
    others = [s for s in BENCH_SECTIONS if s != section]
    cmd = [sys.executable, str(KERNELS), "--device", args.device, *(["--smoke"] if args.smoke else []),
           *passthrough, "--skip", *others]
    rc, out, timed_out = run_streamed(cmd, args.section_timeout, echo_stdout=False)
    res: dict = {"command": " ".join(["python", "benchmarks/kernel_bench.py", *cmd[2:]]), "exit_code": rc}
    if timed_out:
        res["error"] = f"stopped after {args.section_timeout:g} s (--section-timeout): see the progress lines on stderr"
    for line in reversed(out.strip().splitlines()):
        try:
            return {**res, "benchmark": json.loads(line)}
        except json.JSONDecodeError:
            continue
    return {**res, "error": res.get("error", "benchmarks/kernel_bench.py printed no JSON"), "stdout_tail": out[-2000:]}


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        parse_args(["--help"])
    args, passthrough = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and args.device.startswith("cuda")
    head: dict = {"device": torch.cuda.get_device_name() if cuda else
                  "cpu (no CUDA device in use: kernels ran on the Triton interpreter)",
                  "torch": torch.__version__, "cuda": torch.version.cuda}
    if importlib.util.find_spec("pydantic") is None:
        head["note"] = ("pydantic is not installed: the engine-level kernel tests skip and the tiny-model section is "
                        "skipped (docs/benchmarks.md 'GPU report': carry the pydantic wheels)")
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {**head, "out": str(args.out), "sections": {}}
    ok = True
    for name in args.section:
        progress(f"{name}: start")
        t = time.perf_counter()
        res = kernel_tests(args) if name == "tests" else benchmark(args, name, passthrough)
        wall = round(time.perf_counter() - t, 1)
        path = args.out / f"{name}.json"
        path.write_text(json.dumps({"section": name, **head, "wall_s": wall, **res}, indent=1, default=list) + "\n")
        good = res.get("exit_code") == 0 and "error" not in res
        ok = ok and good
        summary["sections"][name] = {"file": path.name, "exit_code": res.get("exit_code"), "wall_s": wall,
                                     **({"error": res["error"]} if "error" in res else {})}
        progress(f"{name}: {'ok' if good else 'NOT ok'} in {wall:.0f} s, written to {path}")
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
