"""One attention path as an object: its name, where it runs, what it takes, and its
`refusal`, derived from what it takes.

A call is read as a set of *parts* (`jax_mha._masking.parts`): the optional pieces of
the description and of the call that a path may or may not express, declared beside
them (`_masking.PARTS`). A path declares the parts it `takes`; its refusal names
the first part present that it does not take, then asks the path's own `limits`
(dtype, head dim, device, layout: what no part says). So adding a part is one entry in
`PARTS` and, in the paths that express it, one word in their `takes` (or none, for a
path that takes every part but a few).

The registry of every path, in `"auto"`'s order, is `jax_mha._dispatch.REGISTRY`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jax_mha import _masking
from jax_mha._masking import EVERY_PART, PARTS, parts


@dataclasses.dataclass(frozen=True, eq=False)
class Path:
    """One way to compute attention.

    Attributes:
      name: what `implementation=` names it by.
      run: `run(q, k, v, bad_kv, vis, call, *, scale, dropout_rate, dropout_rng,
        blocks) -> (out, weights or None, lse or None, empty, touched)` on finite
        inputs (`jax_mha._dispatch` sanitizes before and finishes after): out
        `(B…, H, N, Dv)`, weights `(B…, H, N, S)` when the call asks for them, lse
        `(B…, H, N)` float32 when it asks for it (-inf on rows with nothing to see),
        `empty` and `touched` bool `(B…, H, N)`: rows that see no key, rows that may
        see a key in `bad_kv`.
      takes: the `PARTS` it expresses; any other part present refuses the call.
      platforms: where it runs compiled (`"gpu"`, `"tpu"`); empty for the pure-JAX
        paths, which run everywhere and are never staged per platform.
      interprets: a kernel that also runs on a CPU, in Pallas interpret mode.
      limits: `limits(vis, call) -> str | None`, what the path cannot take beyond its
        parts (dtype, head dim, the device, a layout), one line; or None.
      auto: `"auto"` tries it on its platforms, in the registry's order.
      auto_limits: like `limits`, read by `"auto"` alone: what the path would give up
        silently (precision), which an explicit choice accepts.
      statistics: how `attention_statistics` computes on it: `"whole"` (the whole
        scores as one block) or `"blocks"`; None: it does not.
      decode: a path of the same name for one-query decoding steps (a traced query
        offset), taking each call it does not refuse; or None.
      lowers: `lowers(lowering) -> bool`, whether this host can lower it for a
        lowering platform of its own (`"cuda"`, `"rocm"`, `"tpu"`), or None: always.
    """

    name: str
    run: Callable
    takes: frozenset = EVERY_PART
    platforms: tuple = ()
    interprets: bool = False
    limits: Callable | None = None
    auto: bool = True
    auto_limits: Callable | None = None
    statistics: str | None = None
    decode: Path | None = None
    lowers: Callable | None = None

    @property
    def label(self) -> str:
        return f"implementation={self.name!r}"

    def pick(self, vis: _masking.Visibility, call: _masking.Call) -> Path:
        """The path that runs this call: `decode` when it takes it, else this one."""
        if self.decode is not None and self.decode.refusal(vis, call) is None:
            return self.decode
        return self

    def refusal(self, vis: _masking.Visibility, call: _masking.Call) -> str | None:
        """Why this path cannot run the call (one line naming the part, and the paths
        that take it), or None: the platform, then the first part it does not take,
        then its `limits`. With a `decode` path, None when either takes the call; when
        both refuse, the reason of the one the call was for: the decode kernel's when
        this path refuses a one-query step only for a part the decode kernel takes
        (a traced offset)."""
        decode_why = None if self.decode is None else self.decode.refusal(vis, call)
        if self.decode is not None and decode_why is None:
            return None
        part, why = self._own_refusal(vis, call)
        if decode_why is not None and vis.n == 1 and part is not None and part in self.decode.takes:
            return decode_why  # a one-query step refused only for what the decode kernel takes
        return why

    def _own_refusal(self, vis, call) -> tuple[str | None, str | None]:
        """`(the part refused or None, the reason or None)`, ignoring `decode`."""
        if self.platforms and call.platform not in self.platforms and not (self.interprets and call.platform == "cpu"):
            where = " or ".join(p.upper() for p in self.platforms)
            head = f"runs on a {where} (or interpreted on a CPU)" if self.interprets else f"needs a {where}"
            return None, f"{self.label} {head}, this call runs on {call.platform!r}; {fallback()}"
        for part in parts(vis, call):
            if part not in self.takes:
                why = f"{self.label} cannot express {PARTS[part].describe(vis)}; {takers(part, call.platform, self.name)}"
                return part, why
        return None, None if self.limits is None else self.limits(vis, call)

    def auto_refusal(self, vis: _masking.Visibility, call: _masking.Call) -> str | None:
        """`refusal`, then what `"auto"` alone refuses (`auto_limits`)."""
        why = self.refusal(vis, call)
        path = self.pick(vis, call)
        if why is None and path.auto_limits is not None:
            why = path.auto_limits(vis, call)
        return why


# Every path, in `"auto"`'s order (`register`; `jax_mha._dispatch` registers them all).
REGISTRY: dict[str, Path] = {}


def register(path: Path) -> Path:
    """Adds `path` to `REGISTRY`, after those registered before it."""
    if path.name in REGISTRY or path.name == "auto":
        raise ValueError(f"a path named {path.name!r} is registered already")
    REGISTRY[path.name] = path
    return path


def takers(part: str, platform: str, refusing: str) -> str:
    """`"PART needs implementation='xla' or 'blockwise'"`: the registered paths other
    than `refusing` that take `part` and run on `platform`."""
    names = [p.name for p in REGISTRY.values()
             if p.name != refusing and part in p.takes and (not p.platforms or platform in p.platforms)]
    return f"{PARTS[part].name} needs implementation=" + _either(names) if names else fallback()


def fallback() -> str:
    """`"use implementation='xla' or 'blockwise'"`: the pure-JAX paths."""
    return "use implementation=" + _either([p.name for p in REGISTRY.values() if not p.platforms])


def _either(names) -> str:
    """`'a', 'b' or 'c'`."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
