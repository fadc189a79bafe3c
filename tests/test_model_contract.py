"""The model contract (estimator_service/model_arrays.py) and the modules' boundaries around it.

- ``model.arrays`` restates the numpy reference: Φ, Φ_q, the generalized forces, the bodies' rates and angles and
  the coordinate split computed from the contract's arrays alone equal ``Model``'s methods at random states of every
  shipped mechanism (overconstrained ones after their row reduction, a damped one, the rig's truth model with its
  unmodelled dampers); every array is read-only and the dataclass frozen.
- No module of ``estimator_service`` outside model.py reads a private attribute of a ``Model``, and none imports a
  private name (``_x``) from another module of the package (ast over every module's source).

The first boundary check is a name-based heuristic: a ``Model`` is whatever expression ends in one of
:data:`MODEL_NAMES` (``model._H``, ``self.model._H``, ``m._H``, ``truth._H``…), the names the project gives models;
a model held under another name is not seen.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from estimator_service.mechanism import Damper, load_mechanism
from estimator_service.model import Model
from estimator_service.paths import config_dir
from estimator_service.rig import load_rig

from helpers import MBSE, ROOT

PACKAGE = ROOT / "estimator_service"
#: the names a Model goes by in the project's modules (the heuristic of the first boundary check)
MODEL_NAMES = {"model", "m", "mdl", "mh", "ml", "truth", "truth_model", "sim_model"}
MECHANISMS = sorted(config_dir().glob("mechanisms/*.yaml")) + sorted(MBSE.glob("*.yaml"))
RIGS = sorted(config_dir().glob("rigs/*.toml"))


def _models() -> list[tuple[str, Model]]:
    out = [(p.stem, Model(load_mechanism(p))) for p in MECHANISMS]
    damped = load_mechanism(config_dir() / "mechanisms" / "fourbar-sensors2016.yaml")
    damped.dampers = [Damper(0, None, 0.3), Damper(1, 2, 0.2)]
    out.append(("damped", Model(damped)))
    for path in RIGS:  # the rigs' models (drives change M after the rows are reduced) and truth models (dampers)
        rig = load_rig(str(path))
        out += [(f"{path.stem}-rig", rig.model), (f"{path.stem}-truth", rig.truth_model())]
    return out


MODELS = _models()


def _phi(a, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Φ (m,), Φ_q (m, n)) from the contract's arrays alone (model_arrays.py's module docstring)."""
    qe = a.qe0.copy()
    qe[: a.n] = q
    phi = 0.5 * np.einsum("rij,i,j->r", a.H, qe, qe) + a.B @ qe + a.c
    J = a.H @ qe + a.B
    for r in a.angles:
        th = q[r.theta]
        s, c = math.sin(th), math.cos(th)
        xform = abs(s) >= abs(c)
        J[r.row] = 0.0
        if xform:
            phi[r.row] = qe[r.xb] - qe[r.xa] - r.length * c
            J[r.row, r.xb], J[r.row, r.xa], J[r.row, r.theta] = 1.0, -1.0, r.length * s
        else:
            phi[r.row] = qe[r.yb] - qe[r.ya] - r.length * s
            J[r.row, r.yb], J[r.row, r.ya], J[r.row, r.theta] = 1.0, -1.0, -r.length * c
    return phi, J[:, : a.n]


def _forces(a, q: np.ndarray, qd: np.ndarray) -> np.ndarray:
    """Generalized forces (n,) from the contract: gravity and the dampers' −c (Aᵀ qe)[:n] qeᵀ A q̇e."""
    qe, qde = a.qe0.copy(), np.zeros(a.ne)
    qe[: a.n], qde[: a.n] = q, qd
    out = a.Q_gravity.copy()
    for A, c in a.dampers:
        out -= c * (A.T @ qe)[: a.n] * float(qe @ A @ qde)
    return out


@pytest.mark.parametrize("name, model", MODELS, ids=[n for n, _ in MODELS])
def test_the_contract_restates_the_numpy_reference(name: str, model: Model) -> None:
    a = model.arrays
    assert (a.n, a.ne, a.m, a.g) == (model.n, model.ne, model.m, model.g)
    assert np.array_equal(a.M, model.M) and np.array_equal(a.dof, model.dof)
    assert np.array_equal(a.Hq, a.H[:, : a.n, : a.n]) and np.array_equal(a.fixed, a.qe0[a.n :])
    assert np.array_equal(np.sort(np.concatenate([a.dof, a.dependent])), np.arange(a.n))
    assert len(a.body_geom) == len(a.omega_A) == len(model.mech.bodies)
    assert len(a.dampers) == len(model.mech.dampers)
    rng = np.random.default_rng(38)
    for _ in range(4):
        q = model.solve_position(model.q0, model.q0[model.dof] + rng.normal(0, 0.1, model.g))
        qd = model.solve_velocity(q, rng.normal(0, 1.0, model.g))
        off = q + rng.normal(0, 1e-3, model.n)  # off the manifold too: Φ ≠ 0 there
        for at in (q, off):
            phi, J = _phi(a, at)
            assert np.allclose(phi, model.Phi(at), rtol=0, atol=1e-12 * a.size**2)
            assert np.allclose(J, model.Phi_q(at), rtol=0, atol=1e-12 * a.size)
        assert np.max(np.abs(_phi(a, q)[0])) <= 1e-12 * a.size**2  # the solved q is on the manifold
        assert np.allclose(_forces(a, q, qd), model.Q(q, qd), rtol=1e-12, atol=1e-12)
        assert np.array_equal(a.S @ q, q[a.dof])
        qe = a.qe0.copy()
        qe[: a.n] = q
        qde = np.zeros(a.ne)
        qde[: a.n] = qd
        for body, (xi, yi, xj, yj, L) in enumerate(a.body_geom):
            assert math.isclose(math.hypot(qe[xj] - qe[xi], qe[yj] - qe[yi]), L, rel_tol=1e-9)
            assert math.isclose(math.atan2(qe[yj] - qe[yi], qe[xj] - qe[xi]), model.body_angle(q, body)[0],
                                rel_tol=0, abs_tol=1e-12)
            assert math.isclose(float(qe @ a.omega_A[body] @ qde), model.body_rate(q, qd, body)[0],
                                rel_tol=1e-12, abs_tol=1e-12)


@pytest.mark.parametrize("name, model", [nm for nm in MODELS if nm[0] == "damped" or nm[0].endswith("-truth")],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_the_contract_is_frozen_and_read_only(name: str, model: Model) -> None:
    a = model.arrays
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.H = np.zeros(1)  # type: ignore[misc]
    arrays = [a.qe0, a.H, a.B, a.c, a.Hq, a.Q_gravity, a.M, a.dof, a.dependent, a.S, *a.omega_A,
              *(A for A, _ in a.dampers)]
    assert all(not x.flags.writeable for x in arrays)
    with pytest.raises(ValueError, match="read-only"):
        a.M[0, 0] = 1.0
    assert model.arrays is a  # built once


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _receiver(node: ast.expr) -> str | None:
    """The last name of an attribute's receiver: ``model`` of ``self.model._H``, ``m`` of ``m._H``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def test_no_module_reads_a_private_attribute_of_a_model() -> None:
    found = [f"{p.relative_to(ROOT)}:{n.lineno}: {ast.unparse(n)}" for p, tree in _modules()
             if p.name not in ("model.py", "model_arrays.py") for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and _private(n.attr) and _receiver(n.value) in MODEL_NAMES]
    assert not found, "private attributes of Model read outside model.py (use model.arrays):\n" + "\n".join(found)


def test_the_check_sees_a_private_read() -> None:
    """The heuristic flags the shapes it is meant to (a check that sees nothing would pass anything)."""
    tree = ast.parse("a = model._H\nb = self.model._size\nc = m.arrays.H\nd = self._model\n")
    hits = [ast.unparse(n) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and _private(n.attr) and _receiver(n.value) in MODEL_NAMES]
    assert sorted(hits) == ["model._H", "self.model._size"]


def _package_modules() -> set[str]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for p in PACKAGE.rglob("*.py")}


def _private_imports(path: Path, tree: ast.Module, modules: set[str]) -> list[str]:
    """``from estimator_service.x import _y`` and ``x._y`` on an imported module of the package, in one file."""
    out = []
    module_aliases: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "estimator_service":
            for a in n.names:
                if f"{n.module}.{a.name}" in modules:
                    module_aliases.add(a.asname or a.name)
                elif _private(a.name):
                    out.append(f"{path.relative_to(ROOT)}:{n.lineno}: from {n.module} import {a.name}")
        elif isinstance(n, ast.Import):
            module_aliases |= {a.asname or a.name for a in n.names if a.name.split(".")[0] == "estimator_service"}
    for n in ast.walk(tree):
        if (isinstance(n, ast.Attribute) and _private(n.attr) and isinstance(n.value, ast.Name)
                and n.value.id in module_aliases):
            out.append(f"{path.relative_to(ROOT)}:{n.lineno}: {ast.unparse(n)}")
    return out


def test_no_module_imports_a_private_name_of_another() -> None:
    modules = _package_modules()
    found = [line for p, tree in _modules() for line in _private_imports(p, tree, modules)]
    assert not found, "private names used across modules (give them a public name):\n" + "\n".join(found)


def test_the_import_check_sees_a_private_import() -> None:
    tree = ast.parse("from estimator_service.kernels.linalg import _mm, dot\nfrom estimator_service.kernels import jit\n"
                     "from estimator_service.rig import load_rig as _load_rig\nf = jit._prune\n")
    found = _private_imports(ROOT / "x.py", tree, _package_modules())
    assert found == ["x.py:1: from estimator_service.kernels.linalg import _mm", "x.py:4: jit._prune"]
