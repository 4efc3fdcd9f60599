"""eqx.internal.while_loop(kind="checkpointed") is reverse-differentiable in plain JAX
(eqx.filter_grad works), but every eqfisher curvature raises JAX's
'Reverse-mode differentiation does not work for lax.while_loop' error."""
import jax
jax.config.update("jax_enable_x64", True)
import equinox as eqx, equinox.internal as eqxi, jax.numpy as jnp
import eqfisher as ef


class M(eqx.Module):
    a: eqx.nn.Linear
    b: eqx.nn.Linear

    def __call__(self, x):
        def body(c):
            i, h = c
            return i + 1, jnp.tanh(self.b(h))
        _, h = eqxi.while_loop(lambda c: c[0] < 2, body, (0, self.a(x)), max_steps=4,
                               kind="checkpointed")
        return h


m = M(eqx.nn.Linear(3, 3, key=jax.random.key(0)), eqx.nn.Linear(3, 3, key=jax.random.key(1)))
x, t = jax.random.normal(jax.random.key(2), (4, 3)), jnp.zeros((4, 3))
loss_fn = lambda m, b: ef.squared_error(jax.vmap(m)(b[0]), b[1])
print("plain grad ok:", jax.tree.leaves(eqx.filter_grad(loss_fn)(m, (x, t)))[0].shape)
print(ef.find_layers(loss_fn, m, (x, t)))
for st in [ef.Diagonal(), ef.KFAC()]:
    try:
        ef.curvature(loss_fn, m, (x, t), estimator=ef.GGN(), structure=st)
        print(type(st).__name__, "ok")
    except Exception as e:
        print(type(st).__name__, "raised", type(e).__name__, str(e)[:200])
for op in [ef.ggn_operator, ef.hessian_operator]:
    try:
        op(loss_fn, m, (x, t)).as_matrix(); print(op.__name__, "ok")
    except Exception as e:
        print(op.__name__, "raised", type(e).__name__, str(e)[:150])
