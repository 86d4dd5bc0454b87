"""A linear map whose transpose is written by hand, for every JAX transformation.

The engine's custom JVP (`jax_mha.paths.engine`) returns a tangent that is linear in the
input tangents. Left to JAX, reverse mode would transpose that tangent program
step by step; `linear_call` lets the engine give the transpose itself (the
FlashAttention-2 backward), while forward mode still evaluates the tangent.

`jax.custom_derivatives.linear_call` has the same idea but no batching rule (no
vmap) and asserts that its non-linear inputs carry no tangent (no forward-over-
reverse, so no `jax.hessian`). This primitive adds both:

* jvp: linear in the linear inputs; for tangents of the other inputs (the
  residuals) the map's `apply` is differentiated as ordinary JAX code;
* transpose: `map.transpose()`, itself a `LinearMap` (transposing twice gives the
  map back);
* vmap: the map vmapped (`Vmapped`), batch axes moved to the front.

A map is a hashable object (it is a primitive parameter) with
`apply(res, lin) -> list`, `transpose() -> map` and `out_avals(res_avals, lin_avals)
-> list of jax.ShapeDtypeStruct`, where `res` and `lin` are lists of arrays.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

linear_p = Primitive("jax_mha_linear_call")
linear_p.multiple_results = True


def linear_call(fn, res, lin) -> list:
    """`fn.apply(res, lin)`, linear in `lin`, transposed by `fn.transpose()`.

    Args:
      fn: a hashable linear map (see the module docstring).
      res: list of arrays the map is not linear in (never transposed).
      lin: list of arrays the map is linear in.

    Returns:
      the list `fn.apply(res, lin)`.
    """
    return linear_p.bind(*res, *lin, fn=fn, num_res=len(res))


def _split(args, num_res):
    return list(args[:num_res]), list(args[num_res:])


def _impl(*args, fn, num_res):
    return list(fn.apply(*_split(args, num_res)))


def _abstract_eval(*avals, fn, num_res):
    res, lin = _split(avals, num_res)
    return [jax.core.ShapedArray(x.shape, x.dtype) for x in fn.out_avals(res, lin)]


def _zeros(t, aval):
    return jnp.zeros(aval.shape, aval.dtype) if type(t) is ad.Zero else t


def _differentiable(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _jvp(primals, tangents, *, fn, num_res):
    """Linear in `lin`: the tangent is the map of the tangents of `lin`, plus, where a
    residual carries a tangent, the derivative of `apply` in the residuals."""
    res, lin = _split(primals, num_res)
    d_res, d_lin = _split(tangents, num_res)
    out = linear_p.bind(*primals, fn=fn, num_res=num_res)
    total = None
    if any(type(t) is not ad.Zero for t in d_lin):
        total = linear_p.bind(*res, *(_zeros(t, jax.typeof(x)) for t, x in zip(d_lin, lin)), fn=fn,
                              num_res=num_res)
    moving = [i for i, (x, t) in enumerate(zip(res, d_res)) if type(t) is not ad.Zero and _differentiable(x)]
    if moving:
        def of_res(*moved):
            full = list(res)
            for i, x in zip(moving, moved):
                full[i] = x
            return list(fn.apply(full, lin))

        extra = jax.jvp(of_res, tuple(res[i] for i in moving), tuple(d_res[i] for i in moving))[1]
        total = extra if total is None else [a + b for a, b in zip(total, extra)]
    if total is None:
        return out, [ad.Zero(jax.typeof(x).to_tangent_aval()) for x in out]
    return out, total


def _transpose(cts, *args, fn, num_res):
    res, lin = _split(args, num_res)
    if any(ad.is_undefined_primal(x) for x in res):
        raise NotImplementedError("linear_call is linear only in its linear inputs")
    out_avals = fn.out_avals([jax.typeof(x) for x in res], [x.aval if ad.is_undefined_primal(x)
                                                                 else jax.typeof(x) for x in lin])
    cts = [_zeros(ct, aval) for ct, aval in zip(cts, out_avals)]
    back = linear_p.bind(*res, *cts, fn=fn.transpose(), num_res=num_res)
    return [None] * num_res + [ct if ad.is_undefined_primal(x) else None for ct, x in zip(back, lin)]


@dataclasses.dataclass(frozen=True)
class Vmapped:
    """`fn` vmapped: residuals batched along `res_axes` (0 or None), every linear
    input and every output along axis 0, of size `size`."""

    fn: object
    res_axes: tuple
    size: int

    def apply(self, res, lin):
        return jax.vmap(lambda r, x: list(self.fn.apply(r, x)), in_axes=(list(self.res_axes), 0))(res, lin)

    def transpose(self):
        return Vmapped(self.fn.transpose(), self.res_axes, self.size)

    def out_avals(self, res_avals, lin_avals):
        unbatch = lambda x, axis: x if axis is None else jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
        res = [unbatch(x, axis) for x, axis in zip(res_avals, self.res_axes)]
        lin = [unbatch(x, 0) for x in lin_avals]
        return [jax.ShapeDtypeStruct((self.size,) + x.shape, x.dtype) for x in self.fn.out_avals(res, lin)]


def _batch(args, dims, *, fn, num_res):
    """Batch axes to the front; unbatched linear inputs broadcast (so that their
    transposes, sums over the batch, are JAX's), residuals left unbatched."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    moved = []
    for i, (x, d) in enumerate(zip(args, dims)):
        if d is not None:
            x = jnp.moveaxis(x, d, 0)
        elif i >= num_res:
            x = jnp.broadcast_to(x, (size,) + x.shape)
        moved.append(x)
    res_axes = tuple(None if d is None else 0 for d in dims[:num_res])
    out = linear_p.bind(*moved, fn=Vmapped(fn, res_axes, size), num_res=num_res)
    return out, [0] * len(out)


linear_p.def_impl(_impl)
linear_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[linear_p] = _jvp
ad.primitive_transposes[linear_p] = _transpose
batching.primitive_batchers[linear_p] = _batch
mlir.register_lowering(linear_p, mlir.lower_fun(_impl, multiple_results=True))
