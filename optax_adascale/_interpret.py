"""Re-evaluate a traced loss equation by equation, rewriting some equations: the base of two rewrites.

``value_and_grad(data_axes=...)`` evaluates ``loss_fn`` on one sample's rows at a time. Two things in a
loss written for the global batch do not survive that as they are, and both are fixed on the loss's
jaxpr (``jax.make_jaxpr``), re-evaluated here under the sample's ``vmap`` / ``scan``:

- random draws shaped by the rows (``_global_draws``): each sample must get its rows of the global draw;
- sharding annotations (``_explicit_loss``): specs naming the data axes, which the sample's computation
  cannot honour (the vmapped dimension carries them), and on an Explicit mesh any ``out_sharding=``.

:class:`Interpreter` binds every equation as traced, except those :meth:`~Interpreter.rewrites` selects:
a first-order one goes to :meth:`~Interpreter.leaf`; a ``jit`` is inlined, and ``scan``, ``while``,
``cond`` and ``checkpoint`` are re-made with ``lax.scan`` / ``lax.while_loop`` / ``lax.switch`` /
``jax.checkpoint`` around the re-evaluated body. Reads ``jax.extend.core`` and primitive names.
"""

import jax
from jax import lax


def subjaxprs(eqn):
    """The sub-jaxprs of an equation (``jit``, ``scan``, ``cond`` branches, ...), in a fixed order."""
    out = []
    for key in sorted(eqn.params):
        value = eqn.params[key]
        for v in value if isinstance(value, tuple) else (value,):
            if hasattr(v, "eqns"):
                out.append(v)
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                out.append(v.jaxpr)
    return out


def weak(x):
    """Whether ``x`` is weakly typed (a Python scalar's type), for tracing the loss with its arguments' avals."""
    try:
        return bool(jax.typeof(x).weak_type)
    except (AttributeError, TypeError):
        return False


class Interpreter:
    """``jax.core.eval_jaxpr`` that hands the equations :meth:`rewrites` selects to :meth:`leaf` / :meth:`call`."""

    def rewrites(self, eqn):
        raise NotImplementedError

    def leaf(self, eqn, invals):
        raise NotImplementedError

    def opaque(self, eqn, invals):
        """A selected higher-order equation other than those :meth:`call` re-makes (``custom_jvp``, ...)."""
        raise NotImplementedError

    def eval(self, jaxpr, consts, args):
        from jax.extend.core import Literal

        env = {}

        def read(v):
            return v.val if isinstance(v, Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts, strict=True):
            env[v] = x
        for v, x in zip(jaxpr.invars, args, strict=True):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            if not self.rewrites(eqn):
                ans = self.bind(eqn, invals)
            elif subjaxprs(eqn):
                ans = self.call(eqn, invals)
            else:
                ans = self.leaf(eqn, invals)
            if eqn.primitive.multiple_results:
                for v, x in zip(eqn.outvars, ans, strict=True):
                    env[v] = x
            else:
                env[eqn.outvars[0]] = ans
        return [read(v) for v in jaxpr.outvars]

    def bind(self, eqn, invals, params=None):
        """The equation as traced (``params`` replacing its own), under its trace-time context."""
        params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
        with eqn.ctx.manager:
            return eqn.primitive.bind(*invals, **params)

    def call(self, eqn, invals):
        name, params = eqn.primitive.name, eqn.params
        if name in ("jit", "pjit"):
            return self.eval(params["jaxpr"].jaxpr, params["jaxpr"].consts, invals)
        if name.startswith("remat") or name == "checkpoint":
            body = lambda *args: self.eval(params["jaxpr"], (), list(args))  # noqa: E731
            remat = jax.checkpoint(body, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy"))
            return remat(*invals)
        if name == "scan":
            return self._scan(params, invals)
        if name == "while":
            return self._while(params, invals)
        if name == "cond":
            branches = [lambda *ops, b=b: self.eval(b.jaxpr, b.consts, list(ops)) for b in params["branches"]]
            return lax.switch(invals[0], branches, *invals[1:])
        return self.opaque(eqn, invals)

    def _scan(self, params, invals):
        nc, ncarry, body = params["num_consts"], params["num_carry"], params["jaxpr"]
        consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]

        def step(carry, x):
            out = self.eval(body.jaxpr, body.consts, [*consts, *carry, *x])
            return out[:ncarry], out[ncarry:]

        carry, ys = lax.scan(
            step, list(init), list(xs), length=params["length"], reverse=params["reverse"], unroll=params["unroll"]
        )
        return [*carry, *ys]

    def _while(self, params, invals):
        cn, bn = params["cond_nconsts"], params["body_nconsts"]
        cond, body = params["cond_jaxpr"], params["body_jaxpr"]
        cond_consts, body_consts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
        return lax.while_loop(
            lambda c: self.eval(cond.jaxpr, cond.consts, [*cond_consts, *c])[0],
            lambda c: self.eval(body.jaxpr, body.consts, [*body_consts, *c]),
            list(init),
        )
