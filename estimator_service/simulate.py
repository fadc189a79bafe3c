"""Accurate simulation of a rig: ground truth and sensor streams as bus messages, in time order.

The mechanism (with the rig's unmodelled ``[simulation]`` dampers) is integrated in independent
coordinates, state [z, ż], by scipy's DOP853 (rtol 1e-11, atol 1e-12), solving the position and
velocity problems at every evaluation from the previous q (so the assembly branch is kept).  The run
is integrated in segments (default 1 s) so that messages stream out with bounded memory; a segment is cut again
at every edge of a drive's reversal pulse (:meth:`DriveProfile.edges`), where the forcing's derivative jumps, so
the integrator neither steps over a pulse nor needs small steps between them.
Sensor samples are taken from the dense output at each sensor's rate; noise per the rig's noise
models, from ``numpy.random.Generator(PCG64(seed))`` per sensor: same seed, same messages.  An IMU
with ``time_offset_s`` = δ > 0 stamps its message t but samples the mechanism at t − δ.  An IMU named in
``[simulation.mount_deg]`` reads with its axes at that (true) mount angle, not at the rig's ``mount_deg``.  A drive whose controller
is measured (``[[drive]] input``) publishes ``act/<name>`` at its ``rate_hz``: the commanded position or velocity is
the truth's (the simulated drive follows its command exactly) and the torque is the generalized force the drive
puts on the free mechanism to move it so (:func:`drive_torque`), each plus white noise of the drive's ``sigma``.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from scipy.integrate import solve_ivp

from estimator_service.errors import UserError
from estimator_service.model import AssemblyError, Model
from estimator_service.rig import DriveProfile, Rig
from estimator_service.sensors import Accelerometer, DriveCommand, Encoder, Gyro, Inclination

RTOL, ATOL = 1e-11, 1e-12


@dataclass
class State:
    """A consistent mechanism state at time t (s)."""

    t: float
    q: np.ndarray
    qd: np.ndarray


def initial_state(model: Model, z0: dict[str, float] | None = None, zd0: dict[str, float] | None = None) -> State:
    """Assembled state from named DOF values (rad or m) and rates; unnamed DOFs keep the file's values."""
    z = model.q0[model.dof].copy()
    zd = np.zeros(model.g)
    for name, v in (z0 or {}).items():
        z[model.dof_names.index(name)] = v
    for name, v in (zd0 or {}).items():
        zd[model.dof_names.index(name)] = v
    q = model.solve_position(model.q0, z)
    return State(0.0, q, model.solve_velocity(q, zd))


def dof_forces(model: Model, torques: dict[str, float]) -> np.ndarray | None:
    """Generalized force vector (n,) with constant ``torques`` (N·m or N) on named DOFs; None if empty."""
    if not torques:
        return None
    tau = np.zeros(model.n)
    for name, v in torques.items():
        tau[model.dof[model.dof_names.index(name)]] = v
    return tau


def drive_forces(model: Model, drives: dict[str, DriveProfile], tau: np.ndarray | None) -> Callable[[float], np.ndarray | None]:
    """Generalized forces (n,) at time t: the constant ``tau`` plus, on each driven DOF (``model`` has its drive
    inertia), its drive inertia times the profile's acceleration, so z̈ follows the profile to ~1e-6 (the
    mechanism's own forces on it are ~1e-6 of the drive inertia's)."""
    if not drives:
        return lambda _t: tau
    idx = [(model.dof[model.dof_names.index(name)], model.M[model.dof[model.dof_names.index(name)]] @
            model.R(model.q0)[:, model.dof_names.index(name)], prof) for name, prof in drives.items()]

    def at(t: float) -> np.ndarray:
        out = np.zeros(model.n) if tau is None else tau.copy()
        for i, inertia, prof in idx:
            out[i] += inertia * prof.rate_and_accel(t)[1]
        return out
    return at


class _Pieces:
    """The dense output of one segment integrated in pieces: ``(t_end, solution)`` in time order."""

    def __init__(self, pieces: list[tuple[float, Callable[[float], np.ndarray]]]) -> None:
        self.ends = [e for e, _ in pieces]
        self.sols = [s for _, s in pieces]

    def __call__(self, t: float) -> np.ndarray:
        return self.sols[min(bisect_left(self.ends, t), len(self.sols) - 1)](t)


def drive_edges(drives: dict[str, DriveProfile]) -> Callable[[float, float], list[float]]:
    """The edges of every drive's reversal pulses in (t0, t1), in time order (:meth:`DriveProfile.edges`): a
    pulse lasts ``ramp_s`` (a few ms) between legs of constant rate, where DOP853's steps would jump over it."""
    return lambda t0, t1: sorted({e for p in drives.values() for e in p.edges(t0, t1)})


class Integrator:
    """Integrates a model from a state, segment by segment; ``state_at`` evaluates inside a segment.

    ``tau``: generalized forces (n,) applied to the mechanism at time t (s), or None.  ``edges(t0, t1)``: the times
    in (t0, t1) where ``tau``'s derivative jumps; each segment is integrated piecewise between them.
    """

    def __init__(self, model: Model, start: State, tau: Callable[[float], np.ndarray | None] | None = None,
                 edges: Callable[[float, float], list[float]] | None = None) -> None:
        self.model, self.tau, self.edges = model, tau or (lambda _t: None), edges or (lambda _t0, _t1: [])
        self.t = start.t
        self.q_hint = start.q.copy()
        self.x = np.concatenate([start.q[model.dof], start.qd[model.dof]])
        self._sol = None
        self._prev_sol = None  # the segment before the last one (for samples taken slightly earlier)
        self._t_seg = start.t  # start of the last segment
        self._q_sample = start.q.copy()

    def _rhs(self, t: float, x: np.ndarray) -> np.ndarray:
        m = self.model
        q = m.solve_position(self.q_hint, x[: m.g])
        self.q_hint = q
        qd = m.solve_velocity(q, x[m.g :])
        return np.concatenate([x[m.g :], m.zdd(q, qd, self.tau(t))])

    def advance(self, t_end: float) -> None:
        """Integrate to ``t_end``; afterwards :meth:`state_at` is valid on [previous t, t_end]."""
        knots = [self.t, *self.edges(self.t, t_end), t_end]
        x, pieces = self.x, []
        for a, b in zip(knots, knots[1:], strict=False):
            sol = solve_ivp(self._rhs, (a, b), x, method="DOP853", rtol=RTOL, atol=ATOL, dense_output=True)
            if not sol.success:
                raise RuntimeError(f"simulation failed at t = {a:.3f} s: {sol.message}")
            pieces.append((b, sol.sol))
            x = sol.y[:, -1]
        self._prev_sol, self._sol = self._sol, _Pieces(pieces)
        self._t_seg, self.t, self.x = self.t, t_end, x

    def state_at(self, t: float) -> tuple[State, np.ndarray]:
        """(state, q̈) at time t of the last two segments; constraints solved to 1e-12."""
        m = self.model
        x = self._sol(t) if t >= self._t_seg or self._prev_sol is None else self._prev_sol(t)
        q = m.solve_position(self._q_sample, x[: m.g])
        self._q_sample = q
        qd = m.solve_velocity(q, x[m.g :])
        return State(t, q, qd), m.forward_dynamics(q, qd, self.tau(t))


def _times(rate: float, phase: float, t0: float, t1: float) -> np.ndarray:
    """Sample times k/rate + phase in (t0, t1] (and t = 0 itself in the first segment)."""
    k0 = math.floor((t0 - phase) * rate + 1e-9) + 1 if t0 > 0 else 0
    k1 = math.floor((t1 - phase) * rate + 1e-9)
    return phase + np.arange(max(k0, 0), k1 + 1) / rate


def simulate(rig: Rig | None = None, model: Model | None = None, duration: float | None = None,
             seed: int | None = None, segment_s: float = 1.0) -> Iterator[tuple[str, dict]]:
    """Yield (topic, message) in time order: ``truth/state`` and, with a rig, every sensor stream.

    With only a ``model``: truth from its assembled configuration at rest.  With a rig: its truth
    model (mechanism + unmodelled dampers), initial DOF state and applied torques of ``[simulation]``;
    ``duration`` and ``seed`` default to the rig's.
    """
    tau = None
    if rig is not None:
        model = rig.truth_model()
        tau = dof_forces(model, rig.simulation.torques)
        drives = rig.simulation.drives
        # a driven DOF starts where its profile does (low, going up) unless [simulation.initial] says otherwise
        z0 = {**{d: p.low for d, p in drives.items()}, **rig.simulation.initial}
        zd0 = {**{d: p.speed for d, p in drives.items()}, **rig.simulation.initial_rate}
        start = initial_state(model, z0, zd0)
        duration = rig.simulation.duration_s if duration is None else duration
        seed = rig.simulation.seed if seed is None else seed
        truth_rate = rig.simulation.truth_rate_hz
    else:
        assert model is not None
        start = State(0.0, model.q0.copy(), np.zeros(model.n))
        duration = 10.0 if duration is None else duration
        truth_rate = 1000.0
    seed = 0 if seed is None else seed
    integ = Integrator(model, start, drive_forces(model, rig.simulation.drives, tau) if rig is not None else None,
                       drive_edges(rig.simulation.drives) if rig is not None else None)
    crank = model.dof_names.index("crank") if "crank" in model.dof_names else None
    streams = _sensor_streams(rig, model, seed) if rig is not None else []
    lags = {f"imu/{s.name}": s.time_offset_s + rig.simulation.stamp_offset_s.get(s.name, 0.0)
            for s in rig.imus} if rig is not None else {}
    for topic, lag in lags.items():
        if not 0.0 <= lag < segment_s:
            raise UserError(f"{topic}: time_offset_s = {lag:g}: the simulator supports 0 <= offset < {segment_s:g} s")
    seqs: dict[str, int] = {}
    t0 = 0.0
    while t0 < duration - 1e-12:
        t1 = min(duration, t0 + segment_s)
        try:
            segment = _segment(integ, streams, lags, seqs, truth_rate, crank, t0, t1)
        except (np.linalg.LinAlgError, AssemblyError) as exc:
            raise UserError(f"{model.mech.source}: the simulation failed between t = {t0:.3f} and {t1:.3f} s: "
                            f"{exc} (a singular configuration of the mechanism)") from None
        yield from segment
        t0 = t1


def _segment(integ: Integrator, streams: list, lags: dict[str, float], seqs: dict[str, int], truth_rate: float,
             crank: int | None, t0: float, t1: float) -> list[tuple[str, dict]]:
    """The messages of one segment (t0, t1] in time order (truth first at equal times)."""
    model = integ.model
    integ.advance(t1)
    events: list[tuple[float, int, str, float]] = [
        (round(t, 9), 0, "truth/state", round(t, 9)) for t in _times(truth_rate, 0.0, t0, t1)]
    for i, (topic, rate, phase, _) in enumerate(streams):
        lag = lags.get(topic, 0.0)  # stamped t, sampled at t - lag
        events.extend((round(t, 9), i + 1, topic, round(t - lag, 9)) for t in _times(rate, phase + lag, t0, t1))
    events.sort(key=lambda e: (e[0], e[1]))
    t_state = None
    out = []
    for t, idx, topic, ts in events:
        if ts != t_state:  # one state per sample time, shared by the topics sampled then
            st, qdd = integ.state_at(ts)
            t_state = ts
        z, zd = st.q[model.dof], st.qd[model.dof]
        if idx == 0:
            msg = {"t": t, "q": st.q.tolist(), "qd": st.qd.tolist(), "z": z.tolist(), "zd": zd.tolist()}
            if crank is not None:
                msg["crank"], msg["crank_rate"] = float(z[crank]), float(zd[crank])
        else:
            msg = streams[idx - 1][3](t, st, qdd)
            msg["seq"] = seqs.get(topic, 0)
            seqs[topic] = msg["seq"] + 1
        out.append((topic, msg))
    return out


def _sensor_streams(rig: Rig, model: Model, seed: int) -> list[tuple[str, float, float, object]]:
    """Per sensor topic: (topic, rate_hz, phase_s, sample(t, state, q̈) -> message dict)."""
    out = []
    sensors = rig.simulated_sensors(model)  # at the IMUs' true mounts
    for k, imu in enumerate(rig.imus):
        topic = f"imu/{imu.name}"
        gyr = next(s for s in sensors if isinstance(s, Gyro) and s.topic == topic)
        acc = next(s for s in sensors if isinstance(s, Accelerometer) and s.topic == topic)
        incl = next(s for s in sensors if isinstance(s, Inclination) and s.topic == topic)
        rng = np.random.Generator(np.random.PCG64([seed, 1, k]))

        axis = int(np.argmax(np.abs(gyr.col)))
        spikes = sorted(t for name, times, _ in rig.simulation.outliers if name == imu.name for t in times)
        spike_size = {name: v for name, _, v in rig.simulation.outliers}.get(imu.name, 0.0)
        done: list[float] = []

        def sample(t: float, st: State, qdd: np.ndarray, gyr=gyr, acc=acc, incl=incl, rng=rng, imu=imu,
                   axis=axis, spikes=spikes, spike_size=spike_size, done=done) -> dict:
            g = imu.gyr.sample(gyr.h(st.q, st.qd, qdd)[0], rng)
            if len(done) < len(spikes) and st.t >= spikes[len(done)] - 1e-9:  # first sample at or after the time
                done.append(st.t)
                g[axis] += spike_size
            a = imu.acc.sample(acc.h(st.q, st.qd, qdd)[0], rng)
            phi = float(incl.h(st.q, st.qd, qdd)[0][0]) + imu.incl_sigma * rng.standard_normal()
            return {"t": t, "gyr": g.tolist(), "acc": a.tolist(), "quat": incl.quaternion(phi).tolist(),
                    "dev_t": t, "status": 0}

        out.append((topic, imu.rate_hz, imu.phase_s, sample))
    for enc_cfg in rig.encoders:
        topic = f"enc/{enc_cfg.name}"
        enc = next(s for s in sensors if isinstance(s, Encoder) and s.topic == topic)

        def sample_enc(t: float, st: State, qdd: np.ndarray, enc=enc) -> dict:
            count = enc.to_counts(float(enc.h(st.q, st.qd, qdd)[0][0]))
            return {"t": t, "count": count, "cpr": enc.cpr, "angle": enc.from_counts(count)}

        out.append((topic, enc_cfg.rate_hz, 0.0, sample_enc))
    free = rig.truth_model(drive_inertia=False)
    tau = dof_forces(free, rig.simulation.torques)
    for j, d in enumerate(x for x in rig.drives if x.measured):
        k = model.dof_names.index(d.dof)
        rng = np.random.Generator(np.random.PCG64([seed, 3, j]))
        command = None if d.input == "torque" else DriveCommand(d.name, d.topic, model, k, d.input, d.sigma, 0.0, 0.0)

        def sample_act(t: float, st: State, qdd: np.ndarray, d=d, k=k, rng=rng, command=command) -> dict:
            noise = d.sigma * rng.standard_normal()
            if command is None:
                return {"t": t, "torque": drive_torque(free, tau, k, st, qdd) + noise}
            return {"t": t, command.field: float(command.h(st.q, st.qd, qdd)[0][0]) + noise}

        out.append((d.topic, d.rate_hz, 0.0, sample_act))
    return out


def drive_torque(free: Model, tau: np.ndarray | None, k: int, st: State, qdd: np.ndarray) -> float:
    """The generalized force (N·m or N) on DOF k of the free mechanism ``free`` (its constant forces ``tau``)
    that gives it the acceleration z̈_k of the truth (``qdd`` at the state ``st``) with the other DOFs free: z̈ is
    affine in it, z̈ = z̈₀ + M̄⁻¹ e_k τ_k."""
    z0 = free.zdd(st.q, st.qd, tau)
    unit = np.zeros(free.n)
    unit[free.dof[k]] = 1.0
    gain = free.zdd(st.q, st.qd, unit if tau is None else tau + unit)[k] - z0[k]
    return float((qdd[free.dof[k]] - z0[k]) / gain)

