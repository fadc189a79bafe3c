"""Calibration of a rig from one recording: what a user cannot know or gets wrong, found from the data.

Input: the rig as written (its mechanism, IMUs on bodies, encoders) and a log with IMU messages and
encoders that determine every DOF (or, lacking them, a stretch where the rig rests).  Nothing to name:

1. **Trajectory.** The DOFs from the encoders and their derivatives: ``kinematics_check.solve_dofs`` and
   ``differentiate`` (Savitzky–Golay).  ``predict_imus`` of a *probe* rig — per IMU three virtual IMUs on
   its body with the identity axes, at the body-frame points (0, 0), (1, 0) and (0, 1) m — gives on the
   trajectory grid the body rate ω and the proper acceleration p(r) = p₀ + (p₁₀ − p₀) r_x + (p₀₁ − p₀) r_y
   at any lever arm r (exactly: it is linear in r), so the sensor models are the rig's own.
2. **Gyro** (per IMU): each channel regressed on ω: the channel with the largest |slope| is the one
   normal to the plane, the slope's sign its direction (``axes``; the in-plane pair is completed
   right-handed, keeping the rig's own axes when they already had that normal).  The **time offset** δ
   (stamp − sampling time, ``time_offset_s``) minimises Σ (g − s ω(t − δ) − b)² over ±0.1 s (1 ms grid,
   parabolic refinement), ω here from the encoders' raw differences (a smoothing window would move a
   reversal's timing); the **biases** are the mean residuals per channel, the **noise** their RMS.
3. **Accelerometer**: the in-plane reading u = A₂ᵀ m is fitted as u ≈ R(−α) p(r)(t − δ) + c by
   Gauss–Newton on the mount angle α, the lever arm r and the bias c (started from
   ``kinematics_check.fit_misalignment``).  α is observable only through the in-plane gravity (or the
   acceleration of the body's origin), r only through ω² and ω̇: a parameter whose standard deviation
   exceeds :data:`MOUNT_SIGMA_MAX_DEG` / :data:`LEVER_SIGMA_MAX_M` keeps the rig's value (said so), and
   the fit is repeated without it.  ``"acc"`` is fused where α is observable.
4. **Drive** (per DOF): the DOF read by the encoder is the output of a random walk in velocity,
   z̈ = w, w white of density q (``[[drive]] accel_density``), plus encoder noise σ_e.  A bank of
   Kalman filters over a (q, σ_e) grid gives the log-likelihood of the encoder's innovations; its
   maximum is (q, σ_e) (σ_e also sets the encoder's ``sigma``).  The same filters with the mechanism's
   own forward dynamics as a known input tell whether the DOF is driven: where the free model
   explains the encoder less well than a pure random walk does, a ``[[drive]]`` is written.

Uncertainties (1σ): least squares, with the residual variance scaled by the residuals' integrated
autocorrelation time (Sokal's window; correlated vibration counts as fewer samples); the mount, lever
arm and accelerometer biases plus the square of their change when the differentiation window is halved
(the smoothing's bias); the drive's from the curvature of the log-likelihood.  Without encoders, a rest (the quietest 0.5 s windows of
the gyros) gives the gyro biases and noise and the accelerometer noise; everything else keeps the rig's
value.  Units SI (rad, s, m); angles reported in degrees.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.optimize import minimize, minimize_scalar

from estimator_service.errors import UserError
from estimator_service.kinematics_check import (
    DEFAULT_WINDOW_S,
    DofTrajectory,
    differentiate,
    encoder_series,
    fit_misalignment,
    predict_imus,
    solve_dofs,
    trajectory_states,
)
from estimator_service.model import Model
from estimator_service.rig import ImuConfig, Rig
from estimator_service.sensors import Encoder
from estimator_service.stacked import StackedModel

MAX_OFFSET_S = 0.1  #: time offsets searched: ±0.1 s
MOUNT_SIGMA_MAX_DEG = 5.0  #: a mount angle less certain than this (1σ, deg) is not observable: the rig's is kept
LEVER_SIGMA_MAX_M = 0.005  #: a lever arm less certain than this (1σ per component, m) is kept as the rig has it
REST_WINDOW_S = 0.5  #: windows in which a rest is sought (no encoder)
REST_GYRO_MAX = math.radians(5.0)  #: a rest window's mean gyro reading is below this (rad/s): a MEMS bias bound
AXIS_LETTERS = ("x", "y", "z")
BATCHES = 5  #: the time offset and the drive are also estimated on this many consecutive parts of the window
SLOW_WINDOW_S = 0.5  #: the time scale of the written noise (:func:`slow_factor`): the consistency window's


@dataclass
class Estimate:
    """A scalar or per-axis value with its 1σ; ``found`` False: not observable, the rig's value kept."""

    value: np.ndarray
    sigma: np.ndarray
    found: bool = True

    @staticmethod
    def of(value: object, sigma: object, found: bool = True) -> Estimate:
        return Estimate(np.atleast_1d(np.asarray(value, float)), np.atleast_1d(np.asarray(sigma, float)), found)


@dataclass
class ImuCalibration:
    """One IMU: axes (strings, ``normal`` = sensor axis index along body z, ``sign``), time offset (s),
    gyro scale (1 = as the estimator assumes), biases (rad/s, m/s², sensor axes), noise (per channel
    RMS), mount (rad), lever arm (m, body frame), fused channels; the series drawn."""

    name: str
    axes: list[str]
    axes_before: list[str]
    normal: int
    sign: int
    time_offset: Estimate
    gyr_scale: Estimate
    gyr_bias: Estimate
    gyr_noise: Estimate
    mount: Estimate
    at: Estimate
    acc_bias: Estimate
    acc_noise: Estimate
    use: list[str]
    figures: dict = field(default_factory=dict)  #: arrays for the figures (t, measured, predicted, cost curve)
    #: the σ per channel the estimator is given (written ``gyr_sigma``/``acc_sigma``): the RMS noise times
    #: √(its slow factor, :func:`slow_factor`): correlated noise weighs what its slow part weighs
    gyr_sigma: np.ndarray | None = None
    acc_sigma: np.ndarray | None = None
    #: the normal gyro axis's bias (rad/s, raw reading) with the scale from the integrals (``gyr_scale``)
    gyr_scaled_bias: float = 0.0


@dataclass
class DriveCalibration:
    """One DOF: the density q of the acceleration the encoder shows (rad/s²/√Hz or m/s²/√Hz), the encoder
    noise σ_e, whether the free model explains the DOF less well than a drive (``driven``), and the
    likelihood surface drawn."""

    dof: str
    accel_density: Estimate
    encoder_sigma: float
    driven: bool
    loglik_drive: float
    loglik_model: float
    q_grid: np.ndarray
    profile: np.ndarray  #: max over σ_e of the log-likelihood at each q


@dataclass
class Calibration:
    """Everything ``calibrate`` found (``source``: ``"encoders"`` or ``"rest"``)."""

    rig: Rig
    source: str
    window: tuple[float, float]  #: s, the log's sensor time span used
    imus: list[ImuCalibration]
    drives: list[DriveCalibration]
    encoder_sigma: dict[str, float]  #: encoder name -> noise σ (rad), from the drive fit
    traj: DofTrajectory | None
    notes: list[str]


# ------------------------------------------------------------------------------------ helpers
def tau_int(res: np.ndarray) -> float:
    """Integrated autocorrelation time (samples, ≥ 1) of a residual series, Sokal's window (c = 5)."""
    x = np.asarray(res, float) - np.mean(res)
    n = x.size
    if n < 16 or not np.any(x):
        return 1.0
    f = np.fft.rfft(x, 2 * n)
    acf = np.fft.irfft(f * np.conj(f))[:n]
    acf /= acf[0]
    tau = 1.0
    for k in range(1, n):
        tau += 2.0 * acf[k]
        if k >= 5.0 * tau:
            break
    return max(1.0, float(tau))


def slow_factor(res: np.ndarray, t: np.ndarray, window_s: float = SLOW_WINDOW_S) -> float:
    """How much more a residual's means over ``window_s`` vary than white noise of its RMS would (≥ 1): n·var of
    the block means over the variance. A stepper's vibration (alternating sample to sample) averages out (1);
    an accelerometer's slowly varying model error (scale, cross-axis, the lever arm at reversals) does not
    (8–15 on the real shaft): the estimators, which take every sample's noise as independent, are given the
    RMS times √ of this, so that what the slow part weighs is what they believe."""
    x = np.asarray(res, float) - np.mean(res)
    n = int(round(window_s / float(np.median(np.diff(t))))) if t.size > 1 else 0
    if n < 2 or x.size < 4 * n or not np.any(x):
        return 1.0
    m = x[: x.size // n * n].reshape(-1, n).mean(axis=1)
    return max(1.0, float(n * np.var(m) / np.var(x)))


def info_inverse(M: np.ndarray) -> np.ndarray:
    """Inverse of an information matrix; a parameter that loads on a direction without information
    (eigenvalue below 1e-10 of the largest) gets an infinite variance."""
    lam, V = np.linalg.eigh(M)
    null = lam <= 1e-10 * max(float(lam.max()), 1e-300)
    cov = (V[:, ~null] / lam[~null]) @ V[:, ~null].T
    blind = np.any(np.abs(V[:, null]) > 1e-6, axis=1)
    cov[blind, :] = np.nan
    cov[:, blind] = np.nan
    cov[blind, blind] = np.inf
    return cov


def _ls_cov(J: np.ndarray, res: np.ndarray) -> np.ndarray:
    """Covariance of a least-squares fit with Jacobian J (N, P) and residuals res (N,): σ² τ (JᵀJ)⁻¹, σ²
    the residual variance, τ its integrated autocorrelation time."""
    s2 = float(np.sum(res**2)) / max(1, res.size - J.shape[1])
    return s2 * tau_int(res) * info_inverse(J.T @ J)


def axes_strings(A: np.ndarray) -> list[str]:
    """``["+x", "-z", ...]`` of an axes matrix whose rows are ± body unit vectors."""
    out = []
    for row in A:
        k = int(np.argmax(np.abs(row)))
        out.append(("+" if row[k] > 0 else "-") + AXIS_LETTERS[k])
    return out


def normal_axes(before: np.ndarray, normal: int, sign: int) -> np.ndarray:
    """Axes matrix with sensor axis ``normal`` along ``sign`` · body z: ``before`` if it already says so,
    else the cyclic completion (next axis +body x, the one after ±body y, right-handed)."""
    if before[normal, 2] == sign:
        return before
    A = np.zeros((3, 3))
    A[normal, 2] = sign
    A[(normal + 1) % 3, 0] = 1.0
    A[(normal + 2) % 3, 1] = sign
    return A


def _rot(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, -s], [s, c]])


# ------------------------------------------------------------------------------------ trajectory
@dataclass
class _Probe:
    """Per IMU, on the trajectory grid: body rate ω (N,), origin proper acceleration p0 (N, 2) and the
    lever-arm columns bx, by (N, 2), body frame; ``dw`` = dω/dt (N,); ``w_raw`` the body rate from the
    encoders' differences between consecutive readings, at their midpoints ``t_raw`` (no smoothing)."""

    t: np.ndarray
    w: np.ndarray
    dw: np.ndarray
    p0: np.ndarray
    bx: np.ndarray
    by: np.ndarray
    t_raw: np.ndarray
    w_raw: np.ndarray

    def at(self, t: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(ω, dω/dt, p(r) (n, 2), [bx, by] (n, 2, 2)) at times t."""
        def f(a: np.ndarray) -> np.ndarray:
            return np.interp(t, self.t, a)
        bx = np.column_stack([f(self.bx[:, 0]), f(self.bx[:, 1])])
        by = np.column_stack([f(self.by[:, 0]), f(self.by[:, 1])])
        p = np.column_stack([f(self.p0[:, 0]), f(self.p0[:, 1])]) + bx * r[0] + by * r[1]
        return f(self.w), f(self.dw), p, np.stack([bx, by], axis=2)


def _predict_probes(rig: Rig, model: Model, traj: DofTrajectory, points: tuple[tuple[float, float], ...]) -> dict:
    """``predict_imus`` of a probe rig (per IMU, one identity-axes IMU at each body-frame point) on the
    trajectory's grid: (IMU name, point index) -> its series."""
    probe = copy.copy(rig)
    probe.imus = [replace(imu, name=f"{imu.name}.{k}", at=at, axes=np.eye(3), mount=0.0,
                          gyr_bias_cal=np.zeros(3), acc_bias_cal=np.zeros(3))
                  for imu in rig.imus for k, at in enumerate(points)]
    lo, hi = traj.valid
    grid = traj.t[(traj.t >= lo) & (traj.t <= hi)]
    msgs = {f"imu/{p.name}": [{"t": float(t), "gyr": [0.0] * 3, "acc": [0.0] * 3} for t in grid] for p in probe.imus}
    series = {s.name: s for s in predict_imus(probe, model, traj, msgs)}
    return {(imu.name, k): series[f"{imu.name}.{k}"] for imu in rig.imus for k in range(len(points))}


def _raw_trajectory(t: np.ndarray, z: np.ndarray) -> DofTrajectory:
    """The DOFs' rates as differences of consecutive encoder readings, at the midpoints (ż only: z̈ is a
    difference of those, unused)."""
    dt = np.diff(t)
    keep = dt > 0
    tm = (0.5 * (t[1:] + t[:-1]))[keep]
    zd = (np.diff(z, axis=0) / dt[:, None])[keep]
    zm = (0.5 * (z[1:] + z[:-1]))[keep]
    return DofTrajectory(tm, zm, zd, np.gradient(zd, tm, axis=0), (float(tm[0]), float(tm[-1])))


def _probes(rig: Rig, model: Model, traj: DofTrajectory, raw: DofTrajectory | None) -> dict[str, _Probe]:
    """:class:`_Probe` of every IMU from the rig's own virtual sensors (without ``raw``: no raw rates)."""
    smooth = _predict_probes(rig, model, traj, ((0.0, 0.0), (1.0, 0.0), (0.0, 1.0)))
    rates = _predict_probes(rig, model, raw, ((0.0, 0.0),)) if raw is not None else None
    out = {}
    for imu in rig.imus:
        s0, s1, s2 = (smooth[imu.name, k] for k in range(3))
        w = s0.gyr_pred[:, 2]
        t_raw, w_raw = (rates[imu.name, 0].t, rates[imu.name, 0].gyr_pred[:, 2]) if rates else (np.empty(0), np.empty(0))
        out[imu.name] = _Probe(s0.t, w, np.gradient(w, s0.t), s0.acc_pred[:, :2],
                               s1.acc_pred[:, :2] - s0.acc_pred[:, :2], s2.acc_pred[:, :2] - s0.acc_pred[:, :2],
                               t_raw, w_raw)
    return out


# ------------------------------------------------------------------------------------ gyro
def _time_offset(t: np.ndarray, g: np.ndarray, pr: _Probe) -> tuple[float, np.ndarray, np.ndarray]:
    """δ minimising Σ (g − ω(t − δ) − b)² (g: the normal channel with its sign applied; ω from the encoders'
    raw differences, whose timing no smoothing window shifts at a reversal); the grid and the cost."""
    grid = np.arange(-MAX_OFFSET_S, MAX_OFFSET_S + 5e-4, 1e-3)
    cost = np.empty(grid.size)
    for i, d in enumerate(grid):
        e = g - np.interp(t - d, pr.t_raw, pr.w_raw)
        cost[i] = np.sum((e - e.mean()) ** 2)
    k = int(np.clip(np.argmin(cost), 1, grid.size - 2))
    c0, c1, c2 = cost[k - 1:k + 2]
    curv = c0 - 2 * c1 + c2
    step = 0.5 * (c0 - c2) / curv if curv > 0 else 0.0
    return float(grid[k] + np.clip(step, -1, 1) * 1e-3), grid, cost


def _calibrate_gyro(imu: ImuConfig, t: np.ndarray, gyr: np.ndarray, pr: _Probe) -> dict:
    """Normal axis and sign, time offset, scale, biases and noise of one gyro (rad/s)."""
    w0 = np.interp(t, pr.t, pr.w)
    wc = w0 - w0.mean()
    if float(np.sum(wc**2)) < 1e-12 * t.size:
        raise UserError(f"imu {imu.name}: its body does not turn in the window; nothing to calibrate the axes on")
    slopes = (gyr - gyr.mean(axis=0)).T @ wc / np.sum(wc**2)
    normal = int(np.argmax(np.abs(slopes)))
    sign = 1 if slopes[normal] > 0 else -1
    if abs(slopes[normal]) < 0.5:
        raise UserError(f"imu {imu.name}: no gyro channel follows the body rate the encoders give (slopes "
                        f"{', '.join(f'{v:+.2f}' for v in slopes)}); is it on body {imu.body}, are the encoders its DOFs'?")
    g = sign * gyr[:, normal]
    delta, grid, cost = _time_offset(t, g, pr)
    w = np.interp(t - delta, pr.t, pr.w)
    dw = np.interp(t - delta, pr.t, pr.dw)
    J = np.column_stack([-dw, np.ones_like(w)])  # ∂(ω(t − δ) + b)/∂(δ, b)
    res = gyr.copy()
    res[:, normal] -= sign * w
    bias = res.mean(axis=0)
    res -= bias
    e_raw = g - np.interp(t - delta, pr.t_raw, pr.w_raw)
    cov = _ls_cov(J, e_raw - e_raw.mean())
    # batch means: δ of each fifth of the window; their scatter bounds σ_δ from below (systematic errors of
    # the encoders' derivative at reversals, which the residuals' autocorrelation does not show)
    blocks = [b for b in np.array_split(np.arange(t.size), BATCHES) if b.size >= 20]
    per_block = [_time_offset(t[b], g[b], pr)[0] for b in blocks]
    sigma_delta = max(math.sqrt(cov[0, 0]), float(np.std(per_block, ddof=1)) / math.sqrt(len(blocks)) if len(blocks) > 1 else 0.0)
    # scale from the integrals (the vibration averages out; smoothing keeps an integral): ∫ g dt ≈ k Φ(t − δ) + b t + c
    # with Φ = ∫ ω dt the body's angle from the encoders
    G = np.concatenate([[0.0], np.cumsum(0.5 * (g[1:] + g[:-1]) * np.diff(t))])
    Phi = np.concatenate([[0.0], np.cumsum(0.5 * (pr.w[1:] + pr.w[:-1]) * np.diff(pr.t))])
    Z = np.interp(t - delta, pr.t, Phi)
    Js = np.column_stack([Z - Z[0], t - t[0], np.ones_like(t)])
    ks = np.linalg.lstsq(Js, G, rcond=None)[0]
    cov_s = _ls_cov(Js, G - Js @ ks)
    n = t.size
    noise = np.sqrt(np.mean(res**2, axis=0))
    bias_sigma = np.array([math.sqrt(float(np.mean(res[:, i] ** 2)) * tau_int(res[:, i]) / n) for i in range(3)])
    noise_sigma = np.array([noise[i] * math.sqrt(tau_int(res[:, i] ** 2) / (2 * n)) for i in range(3)])
    return {"normal": normal, "sign": sign, "slopes": slopes,
            "time_offset": Estimate.of(delta, sigma_delta), "scale": Estimate.of(ks[0], math.sqrt(cov_s[0, 0])),
            "bias": Estimate.of(bias, bias_sigma), "noise": Estimate.of(noise, noise_sigma),
            "sigma": noise * np.sqrt([slow_factor(res[:, i], t) for i in range(3)]), "scaled_bias": sign * ks[1],
            "w": w, "cost": (grid, cost), "res": res}


# ------------------------------------------------------------------------------------ accelerometer
def _acc_model(theta: np.ndarray, free: np.ndarray, fixed: np.ndarray, p0: np.ndarray, B: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """u(θ) (n, 2) and ∂u/∂θ_free (n, 2, k): θ = [α, r_x, r_y, c_x, c_y], ``free`` a mask; ``fixed``
    supplies the values of the others."""
    th = np.where(free, theta, fixed)
    a, r, c = th[0], th[1:3], th[3:5]
    Rm = _rot(-a)
    p = p0 + B @ r
    u = p @ Rm.T + c
    dR = np.array([[-math.sin(a), math.cos(a)], [-math.cos(a), -math.sin(a)]])  # d R(−α)/dα
    cols = [p @ dR.T, (B[:, :, 0] @ Rm.T), (B[:, :, 1] @ Rm.T),
            np.tile([1.0, 0.0], (p.shape[0], 1)), np.tile([0.0, 1.0], (p.shape[0], 1))]
    J = np.stack([cols[i] for i in range(5) if free[i]], axis=2)
    return u, J


def _fit_acc(u: np.ndarray, p0: np.ndarray, B: np.ndarray, theta0: np.ndarray, free: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gauss–Newton on the free entries of θ; (θ, covariance of all five (NaN where fixed), residuals)."""
    th = theta0.copy()
    for _ in range(20):
        pred, J = _acc_model(th, free, theta0, p0, B)
        e = (u - pred).reshape(-1)
        Jf = J.reshape(-1, J.shape[2])
        step = np.linalg.lstsq(Jf, e, rcond=None)[0]
        th[free] += step
        if np.max(np.abs(step)) < 1e-10:
            break
    pred, J = _acc_model(th, free, theta0, p0, B)
    res = u - pred
    # one row per sample and axis; τ from the worse of the two in-plane residual series
    Jf = J.reshape(-1, J.shape[2])
    s2 = float(np.sum(res**2)) / max(1, res.size - int(free.sum()))
    tau = max(tau_int(res[:, 0]), tau_int(res[:, 1]))
    cov = np.full((5, 5), np.nan)
    idx = np.flatnonzero(free)
    cov[np.ix_(idx, idx)] = s2 * tau * info_inverse(Jf.T @ Jf)
    return th, cov, res


def _calibrate_acc(imu: ImuConfig, A: np.ndarray, t: np.ndarray, acc: np.ndarray, delta: float, pr: _Probe,
                   pr_half: _Probe, notes: list[str]) -> dict:
    """Mount angle, lever arm, biases and noise of one accelerometer; which of them are observable.
    ``pr_half``: the probes with half the differentiation window; the change of each parameter between
    the two fits is added to its variance (the derivatives' smoothing bias, which the residuals hide)."""
    r0 = np.array(imu.at, float)
    _, _, p, B = pr.at(t - delta, r0)
    p0 = p - B @ r0
    _, _, ph, Bh = pr_half.at(t - delta, r0)
    p0h = ph - Bh @ r0
    A2, n = A[:, :2], A[:, 2]
    # start: the closed-form in-plane misalignment at the rig's lever arm (kinematics_check)
    alpha0, bias0, _ = fit_misalignment(A2, n, acc, np.column_stack([p, np.zeros(len(t))]) @ A.T)
    u = acc @ A2
    theta0 = np.concatenate([[alpha0], r0, A2.T @ bias0])
    free = np.ones(5, bool)

    def fit(start: np.ndarray, free: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        th, cov, res = _fit_acc(u, p0, B, start, free)
        d = np.where(free, th - _fit_acc(u, p0h, Bh, start, free)[0], 0.0)
        return th, cov + np.diag(d**2), res

    th, cov, res = fit(theta0, free)
    mount_ok = math.degrees(math.sqrt(cov[0, 0])) <= MOUNT_SIGMA_MAX_DEG
    if not mount_ok:
        notes.append(f"imu {imu.name}: in-plane mount not observable (no in-plane gravity or acceleration of the body's "
                     f"origin in the window): mount_deg kept at {math.degrees(imu.mount):g}")
        # the rig's mount is an angle about its own axes: kept when the axes are, else 0
        theta0[0] = imu.mount if np.array_equal(A, imu.axes) else 0.0
        free[0] = False
        th, cov, res = fit(np.where(free, th, theta0), free)
    lever_ok = bool(np.all(np.sqrt(np.diag(cov)[1:3]) <= LEVER_SIGMA_MAX_M))
    if not lever_ok:
        notes.append(f"imu {imu.name}: lever arm not observable (1σ > {LEVER_SIGMA_MAX_M * 1e3:g} mm): "
                     f"at kept at [{r0[0]:g}, {r0[1]:g}] m")
        free[1:3] = False
        th, cov, res = fit(np.where(free, th, theta0), free)
    out_mean = float(np.mean(acc @ n))
    if abs(out_mean) > 1.0:
        notes.append(f"imu {imu.name}: the accelerometer reads {out_mean:+.3f} m/s² along body z, which the "
                     "mechanism does not predict (gravity along the axis?): written as its bias")
    sd = np.sqrt(np.nan_to_num(np.diag(cov), nan=0.0, posinf=np.inf))
    bias = A2 @ th[3:5] + n * out_mean
    out_n = acc @ n - out_mean
    sig_out = math.sqrt(float(np.mean(out_n**2)) * tau_int(out_n) / len(t))
    bias_sigma = np.sqrt((A2**2) @ (sd[3:5] ** 2) + (n**2) * sig_out**2)
    resid3 = res @ A2.T + np.outer(out_n, n)
    noise = np.sqrt(np.mean(resid3**2, axis=0))
    noise_sigma = np.array([noise[i] * math.sqrt(tau_int(resid3[:, i] ** 2) / (2 * len(t))) for i in range(3)])
    return {"mount": Estimate.of(th[0], sd[0], mount_ok), "at": Estimate.of(th[1:3], sd[1:3], lever_ok),
            "bias": Estimate.of(bias, bias_sigma), "noise": Estimate.of(noise, noise_sigma),
            "sigma": noise * np.sqrt([slow_factor(resid3[:, i], t) for i in range(3)]),
            "u": u, "u_pred": u - res, "informative": mount_ok}


# ------------------------------------------------------------------------------------ drive
def _kf_loglik(t: np.ndarray, y: np.ndarray, u: np.ndarray, q: np.ndarray, r: np.ndarray, burn: int = 10) -> np.ndarray:
    """Log-likelihood of the innovations of Kalman filters on x = [z, ż], z̈ = u + w (w white, density
    q), y = z + e (σ_e = r); one filter per entry of the broadcast arrays q, r."""
    q2, r2 = np.broadcast_arrays(np.asarray(q, float) ** 2, np.asarray(r, float) ** 2)
    shape = q2.shape
    if not shape:  # one filter (the optimisers' calls): the same recursion on floats, ~20x faster than on 1-arrays
        return np.array(_kf_recursion(t.tolist(), y.tolist(), u.tolist(), float(q2), float(r2), burn, math.log))
    return _kf_recursion(t, y, u, q2.ravel(), r2.ravel(), burn, np.log).reshape(shape)


def _kf_recursion(t, y, u, q2, r2, burn: int, log):
    """The recursion of :func:`_kf_loglik` (densities q = √q2, noise σ_e = √r2): on Python floats with ``math.log``
    for one filter, on numpy arrays with ``np.log`` for one filter per entry of q2 and r2."""
    zero = 0.0 * r2
    x0, x1 = y[0] + zero, (y[1] - y[0]) / (t[1] - t[0]) + zero
    p00, p01, p11 = r2 + zero, zero, 1e2 + zero
    ll = zero
    for k in range(1, len(t)):
        h = t[k] - t[k - 1]
        x0 = x0 + h * x1 + 0.5 * h * h * u[k - 1]
        x1 = x1 + h * u[k - 1]
        p00, p01, p11 = (p00 + 2 * h * p01 + h * h * p11 + q2 * h**3 / 3, p01 + h * p11 + q2 * h * h / 2, p11 + q2 * h)
        e = y[k] - x0
        s = p00 + r2
        if k > burn:
            ll = ll - 0.5 * (log(2 * math.pi * s) + e * e / s)
        k0, k1 = p00 / s, p01 / s
        x0, x1 = x0 + k0 * e, x1 + k1 * e
        p00, p01, p11 = (1 - k0) * p00, (1 - k0) * p01, p11 - k1 * p01
    return ll


def _calibrate_drive(name: str, t: np.ndarray, z: np.ndarray, u_model: np.ndarray, step: float) -> DriveCalibration:
    """ML density of the DOF's acceleration and the encoder noise (see module docstring, 4.): a grid of
    filters, then Nelder–Mead on (ln q, ln σ_e) from its best point; σ of q from the Hessian there, or
    from the scatter of q over fifths of the window where that is larger."""
    q = np.logspace(-3, 4, 36)
    r = step / math.sqrt(12) * np.logspace(0, 3, 19)
    ll = _kf_loglik(t, z, np.zeros_like(t), q[:, None], r[None, :])
    profile = ll.max(axis=1)
    k, j = np.unravel_index(int(np.argmax(ll)), ll.shape)
    zero = np.zeros_like(t)

    def nll(x: np.ndarray) -> float:
        return -float(_kf_loglik(t, z, zero, math.exp(x[0]), math.exp(x[1])))

    res = minimize(nll, [math.log(q[k]), math.log(r[j])], method="Nelder-Mead",
                   options={"xatol": 1e-4, "fatol": 1e-3, "maxfev": 200})
    x, f0, d = res.x, float(res.fun), 0.01
    H = np.empty((2, 2))
    for a in range(2):
        for b in range(2):
            ea, eb = np.eye(2)[a] * d, np.eye(2)[b] * d
            H[a, b] = (nll(x + ea + eb) - nll(x + ea - eb) - nll(x - ea + eb) + nll(x - ea - eb)) / (4 * d * d)
    cov = info_inverse(H) if np.all(np.linalg.eigvalsh(H) > 0) else np.full((2, 2), np.inf)
    qhat = math.exp(x[0])
    sigma = qhat * math.sqrt(cov[0, 0])
    # batch means: q of each fifth (σ_e held); their scatter bounds σ_q from below (heavy-tailed, unsteady drives)
    per_block = []
    for b in np.array_split(np.arange(t.size), BATCHES):
        if b.size >= 50:
            tb, zb = t[b], z[b]
            fit = minimize_scalar(lambda v, tb=tb, zb=zb: -float(_kf_loglik(tb, zb, np.zeros_like(tb), math.exp(v), math.exp(x[1]))),
                                  bounds=(x[0] - 3.0, x[0] + 3.0), method="bounded", options={"xatol": 1e-3})
            per_block.append(math.exp(fit.x))
    if len(per_block) > 1:
        sigma = max(sigma, float(np.std(per_block, ddof=1)) / math.sqrt(len(per_block)))
    ll_model = float(_kf_loglik(t, z, u_model, q[:, None], r[None, :]).max())
    return DriveCalibration(name, Estimate.of(qhat, sigma), math.exp(x[1]), ll_model <= -f0,
                            -f0, ll_model, q, profile)


# ------------------------------------------------------------------------------------ rest
def _rest_mask(t: np.ndarray, gyr: np.ndarray) -> np.ndarray:
    """Samples in 0.5 s windows whose gyro spread is at most twice the quietest window's and whose mean
    reading is below :data:`REST_GYRO_MAX`."""
    edges = np.arange(t[0], t[-1] + REST_WINDOW_S, REST_WINDOW_S)
    idx = np.digitize(t, edges)
    spread = {}
    for w in np.unique(idx):
        sel = idx == w
        if sel.sum() >= 5 and np.max(np.abs(gyr[sel].mean(axis=0))) < REST_GYRO_MAX:
            spread[w] = float(np.max(gyr[sel].std(axis=0)))
    if not spread:
        return np.zeros(t.size, bool)
    quiet = min(spread.values())
    return np.isin(idx, [w for w, s in spread.items() if s <= 2 * quiet])


def _calibrate_rest(rig: Rig, msgs: dict[str, list[dict]], notes: list[str]) -> list[ImuCalibration]:
    out = []
    for imu in rig.imus:
        m = msgs.get(f"imu/{imu.name}", [])
        if len(m) < 10:
            raise UserError(f"imu {imu.name}: {len(m)} messages in the window; need at least 10")
        t = np.array([x["t"] for x in m])
        gyr = np.array([x["gyr"] for x in m])
        acc = np.array([x["acc"] for x in m])
        rest = _rest_mask(t, gyr)
        if rest.sum() < 10:
            raise UserError(f"imu {imu.name}: the window has no encoder readings and the rig never rests in it "
                            f"(no {REST_WINDOW_S} s with a steady gyro below {math.degrees(REST_GYRO_MAX):g} °/s): "
                            "record a rest, or add an encoder")
        g, a = gyr[rest], acc[rest]
        n = int(rest.sum())
        gb = g.mean(axis=0)
        gn, an = g.std(axis=0), a.std(axis=0)
        axes = axes_strings(imu.axes)
        normal = int(np.argmax(np.abs(imu.axes[:, 2])))
        out.append(ImuCalibration(
            imu.name, axes, axes, normal, int(np.sign(imu.axes[normal, 2])),
            Estimate.of(imu.time_offset_s, 0.0, False), Estimate.of(1.0, 0.0, False),
            Estimate.of(gb, [gn[i] * math.sqrt(tau_int(g[:, i]) / n) for i in range(3)]),
            Estimate.of(gn, gn / math.sqrt(2 * n)), Estimate.of(imu.mount, 0.0, False), Estimate.of(imu.at, [0, 0], False),
            Estimate.of(imu.acc_bias_cal, [0, 0, 0], False), Estimate.of(an, an / math.sqrt(2 * n)), list(imu.use),
            {"t": t, "rest": rest, "gyr": gyr}))
        notes.append(f"imu {imu.name}: no encoder: gyro biases and noise from {n} samples at rest; axes, mount, time "
                     "offset, lever arm and accelerometer biases kept as the rig has them")
    return out


# ------------------------------------------------------------------------------------ the whole
def window_messages(msgs: dict[str, list[dict]], window: tuple[float | None, float | None]) -> tuple[dict[str, list[dict]], tuple[float, float]]:
    """The messages whose stamps lie in ``window`` (s from the first sensor message; None: open) and
    the absolute span; UserError when nothing is left."""
    stamps = [m[0]["t"] for m in msgs.values() if m]
    if not stamps:
        raise UserError("the log has no IMU or encoder messages of this rig")
    t0 = min(stamps)
    t_end = max(m[-1]["t"] for m in msgs.values() if m)
    lo = t0 + (window[0] or 0.0)
    hi = t_end if window[1] is None else t0 + window[1]
    out = {k: [m for m in v if lo <= m["t"] <= hi] for k, v in msgs.items()}
    if hi <= lo or not any(out.values()):
        raise UserError(f"--window {window[0] if window[0] is not None else ''}:{window[1] if window[1] is not None else ''}: "
                        f"no sensor message in it (the log spans 0 to {t_end - t0:.3f} s from its first sensor message)")
    return out, (lo, hi)


def calibrate(rig: Rig, msgs: dict[str, list[dict]], window: tuple[float | None, float | None] = (None, None),
              diff_window_s: float = DEFAULT_WINDOW_S) -> Calibration:
    """Calibrate ``rig`` on the decoded messages ``msgs`` (topic -> messages; see module docstring)."""
    msgs, span = window_messages(msgs, window)
    model = Model(rig.mechanism)  # kinematics only: drives do not change them
    notes: list[str] = []
    encoders = [s for s in rig.all_virtual_sensors(model) if isinstance(s, Encoder)]
    series = encoder_series(msgs, encoders)
    if not series:
        return Calibration(rig, "rest", span, _calibrate_rest(rig, msgs, notes), [], {}, None, notes)
    t_enc, z = solve_dofs(model, encoders, series)
    traj = differentiate(t_enc, z, diff_window_s)
    probes = _probes(rig, model, traj, _raw_trajectory(t_enc, z))
    half = _probes(rig, model, differentiate(t_enc, z, diff_window_s / 2), None)
    imus = []
    for imu in rig.imus:
        m = [x for x in msgs.get(f"imu/{imu.name}", [])
             if traj.valid[0] + MAX_OFFSET_S <= x["t"] <= traj.valid[1] - MAX_OFFSET_S]
        if len(m) < 20:
            raise UserError(f"imu {imu.name}: {len(m)} messages inside the encoders' span of the window; need at least 20")
        t = np.array([x["t"] for x in m])
        gyr, acc = np.array([x["gyr"] for x in m]), np.array([x["acc"] for x in m])
        pr = probes[imu.name]
        gc = _calibrate_gyro(imu, t, gyr, pr)
        A = normal_axes(imu.axes, gc["normal"], gc["sign"])
        ac = _calibrate_acc(imu, A, t, acc, float(gc["time_offset"].value[0]), pr, half[imu.name], notes)
        use = [c for c in imu.use if c != "acc"]
        if ac["informative"]:
            use.insert(1 if "gyr" in use else 0, "acc")
        imus.append(ImuCalibration(
            imu.name, axes_strings(A), axes_strings(imu.axes), gc["normal"], gc["sign"], gc["time_offset"], gc["scale"],
            gc["bias"], gc["noise"], ac["mount"], ac["at"], ac["bias"], ac["noise"], use,
            {"t": t, "g": gyr[:, gc["normal"]] * gc["sign"], "w": gc["w"], "cost": gc["cost"], "u": ac["u"],
             "u_pred": ac["u_pred"], "slopes": gc["slopes"]}, gc["sigma"], ac["sigma"], float(gc["scaled_bias"])))
    drives, enc_sigma = [], {}
    dof_enc = {e.coordinate: e for e in encoders if e.coordinate is not None and e.topic in series}
    for i, name in enumerate(model.dof_names):
        enc = dof_enc.get(int(model.dof[i]))
        if enc is None:
            notes.append(f"dof {name}: no encoder reads it directly: its drive is not calibrated")
            continue
        te, ye = series[enc.topic]
        ye = np.unwrap(ye)
        u_model = _free_acceleration(model, traj, te, i)
        d = _calibrate_drive(name, te, ye, u_model, 2 * math.pi / enc.cpr)
        drives.append(d)
        enc_sigma[enc.name] = d.encoder_sigma
    return Calibration(rig, "encoders", span, imus, drives, enc_sigma, traj, notes)


def _free_acceleration(model: Model, traj: DofTrajectory, t: np.ndarray, dof: int) -> np.ndarray:
    """z̈ of DOF ``dof`` by the mechanism's own forward dynamics (no drive) along the encoder trajectory,
    at times t (zero outside the trajectory's valid span)."""
    lo, hi = traj.valid
    sel = (traj.t >= lo) & (traj.t <= hi)
    tg = traj.t[sel][:: max(1, int(round(0.002 / float(np.median(np.diff(traj.t))))))]
    q, qd, _ = trajectory_states(model, traj, tg)
    acc = StackedModel(model).forward_dynamics(q, qd)[:, model.dof[dof]]
    return np.interp(t, tg, acc, left=0.0, right=0.0)
