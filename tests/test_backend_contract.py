"""One list of behaviours every backend of the registry (estimator_service/backends/__init__.py) must have,
parametrised over it: a backend added there gets these tests for free.  Through the Backend interface itself
(initialise, step, declared output latency, re-initialisation, late data) and through the pipeline that uses
it (bounded memory, the quality field), on the public rig."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

from estimator_service import kernels, schema
from estimator_service.backends import REGISTRY, make_backend
from estimator_service.backends.base import Backend, Estimate, Measurement
from estimator_service.logfile import read_log
from estimator_service.offline import rig_of_log
from estimator_service.pipeline import Pipeline
from estimator_service.rig import load_rig

from helpers import RIG

# runs every backend: their kernels compiled before the tests start (conftest.py)
pytestmark = [pytest.mark.kernels(), pytest.mark.parametrize("name", REGISTRY)]

Z0, ZD0 = 1.0, 2.0  # the start: crank angle (rad) and rate (rad/s)


def started(name: str, t0: float = 0.0, z: float = Z0, zd: float = ZD0) -> Backend:
    """Backend ``name`` of the public rig (its fused sensors, its [estimator]) initialised at sensor time ``t0``
    (s) at crank angle ``z`` (rad) and rate ``zd`` (rad/s)."""
    rig = load_rig(RIG)
    m = rig.model
    be = make_backend(name, m, rig.virtual_sensors(m), rig.estimator)
    q = m.solve_position(m.q0, np.array([z]))
    qd = m.solve_velocity(q, np.array([zd]))
    be.initialize(t0, q, qd)
    be.latest = Estimate(t0, q, qd, q[m.dof], qd[m.dof], None, "init")  # (what :func:`reading` starts from)
    return be


def reading(be: Backend, t: float, extra: float = 0.0) -> Measurement:
    """The reading (rad/s) the backend's first sensor, the coupler gyro, would give at the backend's latest
    estimate, ``extra`` added to its planar axis, stamped at sensor time ``t`` (s): data the backend agrees
    with (no outlier gate rejects it)."""
    s, e = be.sensors[0], be.latest
    assert s.kind == "gyr"
    y = s.h(e.q, e.qd, be.model.forward_dynamics(e.q, e.qd))[0]
    return Measurement(t, 0, y + np.array([0.0, extra, 0.0]))


def run(be: Backend, steps: int, every: int = 10) -> list:
    """``steps`` steps, a reading (:func:`reading`) every ``every`` steps (none if 0) at the step's end; the
    estimates returned (the latest kept as ``be.latest``)."""
    out = []
    for k in range(steps):
        if every and k % every == 0:
            be.add_measurement(reading(be, be.t + be.dt))
        out += be.step()
        be.latest = out[-1] if out else be.latest
    return out


def test_initialise_and_step_on_the_grid_within_the_declared_latency(name: str) -> None:
    """From ``initialize(t0, q, q̇)`` each step advances ``dt``; the estimates come in time order on the step
    grid, no later than the declared ``output_latency_s`` behind the backend's time (first ones after at most
    ``steps_to_output()`` steps), consistent (Φ(q) = 0, z = q[dof], ż = q̇[dof]), starting from the given state."""
    be = started(name, t0=5.0)
    m, dt = be.model, be.dt
    assert be.output_latency_s >= 0.0 and be.steps_to_output() >= 1
    ests, first = [], None
    for k in range(300):
        got = run(be, 1, every=1 if k % 10 == 0 else 0)
        assert be.t == pytest.approx(5.0 + (k + 1) * dt, abs=1e-9)
        if got and first is None:
            first = k + 1
        ests += got
        if ests:
            assert ests[-1].t >= be.t - be.output_latency_s - 1e-9  # the declared latency is kept
    assert first is not None and first <= be.steps_to_output() + round(be.output_latency_s / dt)
    t = np.array([e.t for e in ests])
    assert np.all(np.diff(t) > 0) and t[0] >= 5.0 - 1e-9  # (the smoother emits its start too)
    np.testing.assert_allclose((t - 5.0) / dt, np.round((t - 5.0) / dt), atol=1e-6)  # on the step grid
    assert len(ests) >= 300 - round(be.output_latency_s / dt) - be.steps_to_output()
    for e in ests:
        assert np.abs(m.Phi(e.q)).max() < 1e-6
        np.testing.assert_array_equal(e.z, e.q[m.dof])
        np.testing.assert_array_equal(e.zd, e.qd[m.dof])
        assert e.status in ("ok", "degraded")
    assert abs(ests[0].z[0] - (Z0 + ZD0 * (ests[0].t - 5.0))) < 0.05  # it started where it was told


def test_the_backend_is_handed_its_dynamics_and_leaves_the_model_as_it_was(name: str) -> None:
    """A backend takes the compiled kernels as its own dynamics provider (kernels.compile_model; ``compiled`` says
    so) and changes nothing of the model it was given: no attribute is added to the model or replaced (its memo of
    the angle terms aside), so the model's methods stay its numpy reference for every other user of it (a
    simulator, a calibration, another backend)."""
    rig = load_rig(RIG)
    m = rig.model
    before = dict(vars(m))
    be = make_backend(name, m, rig.virtual_sensors(m), rig.estimator)
    assert be.compiled == kernels.enabled() and be.kernel_kind in kernels.KINDS  # (what its start compiles)
    assert vars(m).keys() == before.keys()  # (nothing added: its own caches only refill)
    assert all(vars(m)[k] is v for k, v in before.items() if not k.startswith("_"))
    assert all(getattr(type(m), f) is getattr(m, f).__func__
               for f in ("forward_dynamics", "forward_dynamics_jac_tau", "state_jacobians"))


def test_reinitialisation_restarts_at_the_given_state_and_says_so(name: str) -> None:
    """``mark_reinit`` then ``initialize`` (what the pipeline does after a divergence): counted, the next
    estimate carries status ``reinit`` and starts from the new state, later ones are ``ok`` again."""
    be = started(name)
    run(be, 100)
    m = be.model
    q = m.solve_position(m.q0, np.array([Z0 + 1.0]))
    be.mark_reinit("test")
    t_re = be.t
    be.initialize(t_re, q, np.zeros(m.n))
    after = run(be, 100)
    assert be.reinit_count == 1
    assert after[0].status == "reinit" and abs(after[0].z[0] - (Z0 + 1.0)) < 0.05
    assert {e.status for e in after[1:]} == {"ok"}
    assert all(e.t >= t_re - 1e-9 for e in after)


def test_late_data_within_history_is_used_at_its_own_time(name: str) -> None:
    """A reading older than the backend's time but newer than ``earliest_time()`` is used at its own time: the
    estimates after it are those of the same reading given in time (within 1 % of its effect), not those
    without it."""
    on_time, late, without = started(name), started(name), started(name)
    for be in (on_time, late, without):
        run(be, 95)
    y = reading(late, late.t + 1.5 * late.dt, 0.005)  # between two steps; 0.6 σ of the gyro noise off
    on_time.add_measurement(y)  # in time: before the step past it
    for be in (on_time, late, without):
        run(be, 5, every=0)
    assert late.earliest_time() < y.t < late.t
    late.add_measurement(y)  # 3.5 steps late
    for be in (on_time, late, without):
        be.out = run(be, 30, every=0)
    a, b, c = (be.out[-1].zd[0] for be in (on_time, late, without))
    assert len(late.out) == len(on_time.out) > 0 and {e.status for e in late.out} == {"ok"}
    # measured: the filters re-run from a snapshot (equal to the bit), the smoother adds it to its window (0.1 %)
    assert abs(b - c) > 1e-6 and abs(b - a) < 0.01 * abs(b - c), (a, b, c)


def test_memory_is_bounded_and_every_estimate_has_a_quality(name: str, sim_log_4s: Path) -> None:
    """Through the pipeline on 4 s of the public scenario: the Python objects alive (gc) after 2 s and after
    3.9 s of data are the same number (nothing retained per step; measured: equal), and every
    est/state carries a ``quality`` (``ok`` here: the scenario is the model's own)."""
    reader = read_log(sim_log_4s)
    pipe = Pipeline(rig_of_log(reader.header, sim_log_4s), name)
    alive: dict[float, int] = {}
    quality: dict[str | None, int] = {}
    for rec in reader:
        if rec.topic == "truth/state":
            continue
        for e in pipe.feed(rec.topic, schema.decode(rec.topic, rec.payload)):
            quality[e.get("quality")] = quality.get(e.get("quality"), 0) + 1
        for mark in (2.0, 3.9):
            if mark not in alive and rec.t_recv >= mark:
                gc.collect()
                alive[mark] = len(gc.get_objects())
    assert abs(alive[3.9] - alive[2.0]) <= 50, alive
    assert quality.keys() == {"ok"} and quality["ok"] > 3900
