import pathlib
import re

import jax.numpy as jnp


def test_readme_quickstart_runs():
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert jnp.isfinite(scope["loss"])
    assert [
        li.kind
        for li in scope["ef"]
        .find_layers(scope["loss_fn"], scope["model"], (scope["x"], scope["y"]))
        .layers
    ] == ["dense"] * 3
