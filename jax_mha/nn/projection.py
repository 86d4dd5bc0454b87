"""The projections' matmul, with a kernel gradient XLA:CPU runs on its fast kernel.

`projection_dot_general` is `jax.lax.dot_general` for `nn.Dense(dot_general=...)` and
`nnx.Linear(dot_general=...)`: the same value and the same derivatives. Autodiff's
kernel gradient `dw = xᵀ g` contracts x's *row* axis, which XLA:CPU runs on its generic
(Eigen) kernel, slower than the matmul it uses for row-major operands. Here the tangent
rule reads x through a materialised xᵀ (kept by an optimization barrier from being
folded back), so the gradient, its transpose, is a row-major matmul; it costs one copy
of x (measured in docs/performance.md, "Row-major kernel gradient").

A `jax.custom_jvp`, not a `custom_vjp`: `jvp`, `jacfwd` and `hessian` still work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero


def _last_axis_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """`(…, d_in) @ (d_in, f) -> (…, f)`."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


@jax.custom_jvp
def _projection(x: jax.Array, w: jax.Array) -> jax.Array:
    return _last_axis_dot(x, w)


def _projection_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    y = _projection(x, w)
    dy = None if isinstance(dx, SymbolicZero) else _last_axis_dot(dx, w)
    if not isinstance(dw, SymbolicZero):
        xt = jax.lax.optimization_barrier(x.reshape(-1, x.shape[-1]).T)  # (d_in, B…·N), row-major
        term = (xt.T @ dw).reshape(y.shape)  # transposed for grad: dw = xt @ g
        dy = term if dy is None else dy + term
    return y, (jnp.zeros_like(y) if dy is None else dy)


_projection.defjvp(_projection_jvp, symbolic_zeros=True)


def projection_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """`jax.lax.dot_general`, with the fast kernel gradient for Dense's own contraction
    (last axis of `lhs` with a 2-D kernel) on the CPU backend without precision, dtype
    or sharding overrides; anything else is plain `dot_general` (`kwargs`, e.g. the
    `out_sharding` that `nnx.Linear` passes, go to it)."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    dense_like = (
        tuple(lhs_contract) == (lhs.ndim - 1,) and tuple(rhs_contract) == (0,)
        and not tuple(lhs_batch) and not tuple(rhs_batch) and rhs.ndim == 2
    )
    overridden = precision is not None or preferred_element_type is not None or any(v is not None for v in kwargs.values())
    if not dense_like or overridden or jax.default_backend() != "cpu":
        return jax.lax.dot_general(
            lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type, **kwargs
        )
    return _projection(lhs, rhs)
