"""What a backend's steps would cost with no Python in them: the compiled floor (docs/performance.md, issue 9).

    python tools/compiled_floor.py [--backends ekf,ukf] [--log LOG] [--json OUT.json]

Runs each backend over a log (default: the public ``gyros`` scenario, as ``rigstate bench`` simulates and caches it)
once with every compiled entry point of estimator_service/kernels/ that Python calls recorded per step, with copies
of its arguments.  Then it replays each step's calls back to back, in the run's order, with nothing between them but
the loop (twice; the second replay is reported), and prints per step p50 / p90 / p99 / mean (µs), the same per entry
point, each entry point repeated in place (warm caches), and the dispatcher's own cost per call (a compiled function
of the same arguments that does nothing).  A whole step in one compiled call would cost at least the replayed step
less the dispatches it saves.  Numbers are this machine's; compare runs side by side.
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np

from estimator_service import freeze_heap
from estimator_service.commands.bench import default_cache_dir, scenario_log
from estimator_service.logfile import read_log
from estimator_service.offline import rig_of_log, run_log
from estimator_service.pipeline import Pipeline

#: each entry point repeated in place this many times for its warm cost
WARM_REPEATS = 200


@numba.njit
def _nothing(*args):
    """The dispatcher's own cost: typing and unboxing the arguments, no work."""
    return 0


def _recording(fn, depth: list[int], calls: list) -> Callable:
    """``fn`` (a compiled entry point) that appends (fn, copied arguments) to ``calls[-1]`` when called from Python
    (not from another recorded entry point)."""
    def rec(*args):
        if calls and depth[0] == 0:
            calls[-1].append((fn, copy.deepcopy(args)))
        depth[0] += 1
        try:
            return fn(*args)
        finally:
            depth[0] -= 1

    rec.py_func, rec.__name__ = fn.py_func, fn.__name__
    return rec


def _percentiles(us: np.ndarray) -> dict[str, float]:
    return {"n": int(us.size), "p50": float(np.percentile(us, 50)), "p90": float(np.percentile(us, 90)),
            "p99": float(np.percentile(us, 99)), "mean": float(us.mean())}


def record(log: Path, backend: str) -> tuple[list[list[tuple]], np.ndarray]:
    """(per step: its compiled calls as (entry point, arguments)), the run's own step times (µs, with recording)."""
    reader = read_log(log)
    pipe = Pipeline(rig_of_log(reader.header, str(log)), backend)
    be = pipe.backend
    calls: list[list[tuple]] = []
    depth = [0]
    # every binding of a compiled kernel in the project's modules (kernels/model_kernels.py's wrappers, a backend's
    # own import): Python looks the name up there at each call
    saved = [(mod, name, fn) for mod_name, mod in list(sys.modules.items()) if mod_name.startswith("estimator_service.")
             for name, fn in list(vars(mod).items()) if isinstance(fn, numba.core.registry.CPUDispatcher)]
    times = []
    step = be.step

    def timed_step():
        calls.append([])
        t0 = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - t0)
        return out

    for mod, name, fn in saved:
        setattr(mod, name, _recording(fn, depth, calls))
    be.step = timed_step
    try:
        for _ in run_log(pipe, iter(reader)):
            pass
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
    return calls, np.array(times) * 1e6


def replay(calls: list[list[tuple]]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(per step: its calls back to back (µs), per entry point: each call's time (µs)), from a second pass."""
    for _ in range(2):
        steps, each = [], {}
        for step in calls:
            t_step = time.perf_counter()
            for fn, args in step:
                t0 = time.perf_counter()
                fn(*args)
                each.setdefault(fn.__name__, []).append(time.perf_counter() - t0)
            steps.append(time.perf_counter() - t_step)
    return np.array(steps) * 1e6, {k: np.array(v) * 1e6 for k, v in each.items()}


def in_place(calls: list[list[tuple]]) -> dict[str, dict[str, float]]:
    """Per entry point: one of its calls from the middle of the run repeated in place, and the dispatch alone
    (µs, medians)."""
    out = {}
    for fn, args in (c for step in itertools.chain(calls[len(calls) // 2 :], calls) for c in step):
        if fn.__name__ in out:
            continue
        warm, dispatch = [], []
        _nothing(*args)
        for _ in range(WARM_REPEATS):
            t0 = time.perf_counter()
            fn(*args)
            t1 = time.perf_counter()
            _nothing(*args)
            dispatch.append(time.perf_counter() - t1)
            warm.append(t1 - t0)
        out[fn.__name__] = {"warm": float(np.median(warm)) * 1e6, "dispatch": float(np.median(dispatch)) * 1e6}
    return out


def floor(log: Path, backend: str) -> dict:
    """The figures of one backend on one log (see the module docstring)."""
    calls, run = record(log, backend)
    freeze_heap()
    gc.disable()  # (the recorded arguments are many objects: no collection inside a timed step)
    try:
        steps, each = replay(calls)
    finally:
        gc.enable()
    return {"backend": backend, "log": str(log), "steps": len(calls),
            "run_with_recording_us": _percentiles(run), "replayed_step_us": _percentiles(steps),
            "replayed_entry_us": {k: _percentiles(v) for k, v in sorted(each.items())},
            "in_place_us": in_place(calls)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="ekf,ukf", help="comma-separated filter backends (default ekf,ukf)")
    p.add_argument("--log", type=Path, help="log with the sensors (default: the public gyros scenario, cached)")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help="where the public scenario's log is kept (as rigstate bench --cache-dir)")
    p.add_argument("--json", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)
    log = args.log or scenario_log("gyros", args.cache_dir, None)
    results = [floor(log, be) for be in args.backends.split(",") if be]
    for r in results:
        s = r["replayed_step_us"]
        print(f"{r['backend']}: {r['steps']} steps; replayed compiled calls per step p50 {s['p50']:.0f} "
              f"p90 {s['p90']:.0f} p99 {s['p99']:.0f} mean {s['mean']:.1f} us")
        for name, e in r["replayed_entry_us"].items():
            warm = r["in_place_us"][name]
            print(f"  {name:28s} x{e['n']:<6d} p50 {e['p50']:6.1f} p99 {e['p99']:6.1f}   in place {warm['warm']:6.1f}"
                  f"   dispatch alone {warm['dispatch']:4.1f} us")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
