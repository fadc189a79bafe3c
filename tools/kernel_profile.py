"""Where a backend's time goes inside and around its compiled kernels: Linux ``perf`` samples of a replay, each
attributed to the kernel whose machine code it hit (docs/performance.md, "Where a step's time goes").

    python tools/kernel_profile.py [--backend ekf] [--log LOG] [--seconds 20] [--json OUT.json]

The backend runs over a log (default: the public ``gyros`` scenario, as ``rigstate bench`` simulates and caches it)
again and again in a child process while ``perf record`` samples it for ``--seconds``.  numba's machine code has no
symbols perf can read; the child writes them to ``/tmp/perf-<pid>.map`` (perf's map of JIT code), which needs the
kernels compiled in that process: the child compiles every kernel from an empty cache of its own (minutes), pinned to
one CPU (so that no helper process compiles a part of them: estimator_service/kernels/warmup.py).  Machine code loaded
from numba's cache would show as bare addresses.

The report: the share of the samples per kind of code (the kernels' own arithmetic, numba's reference counting of
arrays, memory allocation, numba's dispatch from Python, the Python interpreter, numpy, the OS), then the kernels
that took the most.  A kernel's share is of its own code and of the copies of its callees that numba linked into it
and LLVM did not inline; sizes between map entries are taken as the distance to the next one.  Then the cold compile
the child did first (numba's compile events): its wall time, how many functions it compiled, and the kernels whose
own compile took longest (exclusive of the kernels they call, which are compiled first; a kernel's own time includes
optimising and emitting the copies of its callees linked into it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

#: the kinds of code a sample can hit, in the report's order, each with a test on (dso, symbol)
CATEGORIES = ("kernels", "reference counting", "allocation", "dispatch", "python", "numpy", "os", "other")
_REFCOUNT = {"NRT_incref", "NRT_decref"}
_ALLOC = re.compile(r"^(NRT_MemInfo|NRT_Allocate|NRT_Free|NRT_dealloc|malloc|free|cfree|_int_malloc|_int_free|"
                    r"malloc_consolidate|__libc_malloc|__libc_free)")
_MANGLED_PART = re.compile(r"(\d+)")


def demangle(symbol: str) -> str:
    """A numba function's symbol (``_ZN17estimator_service7kernels6linalg3dotB2v1…``) as its dotted name
    (``estimator_service.kernels.linalg.dot``; numba's Python-facing wrapper of it: ``cpython.`` before it); any other
    symbol as it is."""
    if not symbol.startswith("_ZN"):
        return symbol
    parts, i = [], 3
    while i < len(symbol):
        m = _MANGLED_PART.match(symbol, i)
        if m is None:
            break
        n = int(m.group(1))
        parts.append(symbol[m.end() : m.end() + n])
        i = m.end() + n
    return ".".join(parts) if parts else symbol


def category(dso: str, name: str) -> str:
    """The kind of code (:data:`CATEGORIES`) of a sample in ``dso`` at the symbol ``name`` (demangled)."""
    if name in _REFCOUNT:
        return "reference counting"
    if _ALLOC.match(name):
        return "allocation"
    if name.startswith("cpython.") or "_dispatcher" in dso:
        return "dispatch"
    if dso.startswith("[JIT]"):
        return "kernels"
    if "libpython" in dso or dso.startswith("python"):
        return "python"
    if "multiarray" in dso or "umath" in dso or "openblas" in dso:
        return "numpy"
    if "kernel" in dso:
        return "os"
    return "other"


def parse_report(text: str) -> list[tuple[float, str, str]]:
    """(per cent, dso, symbol) of each line of ``perf report --stdio --no-children --sort dso,sym`` output."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^\s*([\d.]+)%\s+(.+?)\s+\[[.k]\]\s+(\S+)", line)
        if m:
            out.append((float(m.group(1)), m.group(2).strip(), m.group(3)))
    return out


def summarize(rows: list[tuple[float, str, str]], top: int = 20) -> dict:
    """The report's figures: the share (%) per kind of code, and the ``top`` kernels (demangled) by share."""
    kinds: Counter[str] = Counter()
    kernels: Counter[str] = Counter()
    for pct, dso, sym in rows:
        name = demangle(sym)
        kind = category(dso, name)
        kinds[kind] += pct
        if kind == "kernels":
            kernels[name.removeprefix("estimator_service.kernels.")] += pct
    return {"categories": {k: round(kinds[k], 2) for k in CATEGORIES if kinds[k]},
            "kernels": {k: round(v, 2) for k, v in kernels.most_common(top)}}


def perf_map_lines() -> list[str]:
    """perf's map of the compiled kernels' machine code in this process (``<address> <size> <symbol>``, hex): every
    function of every kernel compiled here (code loaded from numba's cache has no module to read its functions from)."""
    from estimator_service import kernels

    entries = set()
    for dispatcher in kernels.compiled_functions().values():
        for cres in dispatcher.overloads.values():
            lib = cres.library
            try:
                ir = lib.get_llvm_str()
            except Exception:  # (loaded from the cache: no module)
                continue
            for name in re.findall(r'^define [^@]*@"?([^"(\s]+)"?\(', ir, flags=re.M):
                address = lib.get_pointer_to_function(name)
                if address:
                    entries.add((address, name))
    ordered = sorted(entries)
    lines = []
    for i, (address, name) in enumerate(ordered):
        size = min(ordered[i + 1][0] - address, 1 << 16) if i + 1 < len(ordered) else 1 << 12
        lines.append(f"{address:x} {size:x} {name}")
    return lines


class CompileTimes:
    """numba's compile events of this process: per compiled function (module.name), its count and its own seconds
    (its compile less that of the functions compiled inside it), and the wall seconds of the outermost compiles."""

    def __init__(self) -> None:
        self.own: Counter[str] = Counter()
        self.count: Counter[str] = Counter()
        self.wall = 0.0
        self._open: list[list] = []  # [name, start, seconds of nested compiles]

    def start(self, name: str) -> None:
        self._open.append([name, time.perf_counter(), 0.0])

    def end(self) -> None:
        name, t0, nested = self._open.pop()
        took = time.perf_counter() - t0
        self.own[name] += took - nested
        self.count[name] += 1
        if self._open:
            self._open[-1][2] += took
        else:
            self.wall += took

    def summary(self, top: int = 15) -> dict:
        """Total wall seconds, number of compiles, and the ``top`` functions by own seconds."""
        return {"wall_s": round(self.wall, 2), "compiles": sum(self.count.values()),
                "own_s": {k.removeprefix("estimator_service.kernels."): round(v, 2) for k, v in self.own.most_common(top)}}


def listen_to_compiles() -> CompileTimes:
    """A :class:`CompileTimes` fed by numba's ``numba:compile`` events from now on."""
    from numba.core import event

    times = CompileTimes()

    class _Listener(event.Listener):
        def on_start(self, ev) -> None:
            fn = ev.data["dispatcher"].py_func
            times.start(f"{fn.__module__}.{fn.__qualname__}")

        def on_end(self, ev) -> None:
            times.end()

    event.register("numba:compile", _Listener())
    return times


def child(backend: str, log: str, seconds: float) -> None:
    """The profiled process: compile (its compile times to ``compile.json`` beside numba's cache), write the map,
    say ``ready <pid>``, replay the log for ``seconds``."""
    compiles = listen_to_compiles()
    from estimator_service.logfile import read_log
    from estimator_service.offline import rig_of_log, run_log
    from estimator_service.pipeline import Pipeline

    reader = read_log(log)
    rig = rig_of_log(reader.header, log)

    def replay() -> None:
        for _ in run_log(Pipeline(rig, backend), iter(read_log(log))):
            pass

    replay()  # (every kernel the run calls is compiled now)
    (Path(os.environ["NUMBA_CACHE_DIR"]).parent / "compile.json").write_text(json.dumps(compiles.summary()))
    Path(f"/tmp/perf-{os.getpid()}.map").write_text("\n".join(perf_map_lines()) + "\n")
    print("ready", os.getpid(), flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        replay()


def profile(backend: str, log: Path, seconds: float) -> dict:
    """Run :func:`child` pinned to one CPU with an empty numba cache, sample it with perf for ``seconds`` once it is
    ready, and summarize (:func:`summarize`)."""
    with tempfile.TemporaryDirectory(prefix="rigstate-profile-") as tmp:
        env = dict(os.environ, NUMBA_CACHE_DIR=str(Path(tmp) / "numba"))
        cpu = min(os.sched_getaffinity(0))
        proc = subprocess.Popen([sys.executable, __file__, "--child", backend, str(log), str(seconds + 5)], env=env,
                                stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        try:
            line = proc.stdout.readline().split()
            if line[:1] != ["ready"]:
                raise SystemExit(f"the profiled process ended before it was ready (exit {proc.wait()})")
            pid, data = line[1], Path(tmp) / "perf.data"
            subprocess.run(["perf", "record", "-q", "-F", "1999", "-p", pid, "-o", str(data), "--", "sleep",
                            str(seconds)], check=True, stdout=subprocess.DEVNULL)
            text = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "dso,sym"],
                                  check=True, capture_output=True, text=True).stdout
            compile_times = json.loads((Path(tmp) / "compile.json").read_text())
        finally:
            proc.kill()
            proc.wait()
            Path(f"/tmp/perf-{proc.pid}.map").unlink(missing_ok=True)
    return {"backend": backend, "log": str(log), "seconds": seconds, **summarize(parse_report(text)),
            "cold_compile": compile_times}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="ekf", help="backend (default ekf)")
    p.add_argument("--log", type=Path, help="log to replay (default: the public gyros scenario, simulated and cached)")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds of sampling (default 20)")
    p.add_argument("--json", type=Path, help="also write the figures as JSON")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], float(args.child[2]))
        return 0
    if args.log is not None and not args.log.is_file():
        print(f"kernel_profile: {args.log}: no such log", file=sys.stderr)
        return 2
    if shutil.which("perf") is None:
        print("kernel_profile: needs Linux perf on the PATH (apt install linux-perf)", file=sys.stderr)
        return 2
    log = args.log
    if log is None:
        from estimator_service.commands.bench import default_cache_dir, scenario_log
        log = scenario_log("gyros", default_cache_dir(), None)
    out = profile(args.backend, log, args.seconds)
    print(f"{args.backend} on {log.name}, {args.seconds:g} s of samples: share of the process's time (%)")
    for kind, pct in out["categories"].items():
        print(f"  {pct:6.2f}  {kind}")
    print("the kernels that took the most (their own code and the callees linked into them):")
    for name, pct in out["kernels"].items():
        print(f"  {pct:6.2f}  {name}")
    c = out["cold_compile"]
    print(f"the cold compile before (one process, one CPU): {c['wall_s']:.1f} s, {c['compiles']} functions compiled; "
          "the longest own compiles (s):")
    for name, sec in c["own_s"].items():
        print(f"  {sec:6.2f}  {name}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
