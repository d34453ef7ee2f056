"""The README's Python blocks against the package: every call they show names something the package
exports and passes arguments its signature accepts.

The blocks are API sketches over inputs they do not build (``x``, ``indices``, ...), so they are not
run; their calls are bound with ``inspect.Signature.bind``. A call with a literal ``...`` argument
("the arguments above") is bound partially. Calls reached through a variable are checked when the
variable was assigned from one of our classes (``sae = TopKSAE(...).cuda()``, ``vq(x)``).
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pytest

import sparsefuse

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks() -> list[tuple[int, str]]:
    text = README.read_text()
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def _sparsefuse_object(node: ast.expr, imported: dict[str, object]):
    """What ``node`` names in the package (``sparsefuse.X`` or a name imported from it), else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "sparsefuse":
        return getattr(sparsefuse, node.attr)  # AttributeError: the README names something we lack
    if isinstance(node, ast.Name):
        return imported.get(node.id)
    return None


def _constructed_class(value: ast.expr, imported: dict[str, object]):
    """The class an assignment's value builds: ``Cls(...)``, ``Cls(...).cuda()``, ``Cls.load(...)``."""
    while isinstance(value, ast.Call):
        func = value.func
        obj = _sparsefuse_object(func, imported)
        if inspect.isclass(obj):
            return obj
        if isinstance(func, ast.Attribute):
            owner = _sparsefuse_object(func.value, imported)
            if inspect.isclass(owner) and isinstance(inspect.getattr_static(owner, func.attr), classmethod):
                return owner
            value = func.value
        else:
            return None
    return None


def _signature(owner, attr: str | None) -> tuple[inspect.Signature, bool]:
    """The signature a call binds to, and whether it takes ``self`` first (an instance method read
    off the class). ``attr`` None calls ``owner`` itself: a function, or a class's constructor;
    "__call__" calls an instance, that is its module's ``forward``."""
    if attr is None:
        return inspect.signature(owner), False
    if attr == "__call__":
        return inspect.signature(owner.forward), True
    static = inspect.getattr_static(owner, attr)
    if isinstance(static, (classmethod, staticmethod)):
        return inspect.signature(getattr(owner, attr)), False
    return inspect.signature(static), True


def _checked_calls(source: str) -> list[str]:
    """Bind every resolvable call in ``source``; returns their descriptions. Raises on a mismatch."""
    tree = ast.parse(source)
    imported: dict[str, object] = {}
    instances: dict[str, type] = {}
    checked = []
    for node in ast.walk(tree):  # imports and assignments first: the blocks use names after binding them
        if isinstance(node, ast.ImportFrom) and node.module == "sparsefuse":
            for alias in node.names:
                imported[alias.asname or alias.name] = getattr(sparsefuse, alias.name)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            cls = _constructed_class(node.value, imported)
            if cls is not None:
                instances[node.targets[0].id] = cls
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        obj = _sparsefuse_object(func, imported)
        if obj is not None:
            owner, attr, name = obj, None, ast.unparse(func)
        elif isinstance(func, ast.Name) and func.id in instances:
            owner, attr, name = instances[func.id], "__call__", f"{func.id} ({instances[func.id].__name__}.forward)"
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = instances.get(func.value.id) or _sparsefuse_object(func.value, imported)
            if owner is None:
                continue  # torch's or a user's object: not ours to check
            attr, name = func.attr, ast.unparse(func)
            assert hasattr(owner, attr), f"README calls {name}, but {owner.__name__} has no {attr!r}"
        else:
            continue
        sig, takes_self = _signature(owner, attr)
        args = [None] * (takes_self + len(node.args))
        kwargs = {kw.arg: None for kw in node.keywords if kw.arg is not None}
        partial = any(isinstance(a, ast.Constant) and a.value is Ellipsis for a in node.args)
        try:
            (sig.bind_partial if partial else sig.bind)(*args, **kwargs)
        except TypeError as err:
            raise AssertionError(f"README call {ast.unparse(node)!r} does not fit {name}{sig}: {err}") from None
        checked.append(name)
    return checked


@pytest.mark.parametrize("line,source", [pytest.param(*block, id=f"line{block[0]}") for block in _python_blocks()])
def test_readme_block_calls_fit_the_api(line, source):
    assert _checked_calls(source), f"the README block at line {line} has no call this test can check"


def test_readme_has_the_api_blocks():
    blocks = _python_blocks()
    assert len(blocks) >= 5
    called = {name for _, source in blocks for name in _checked_calls(source)}
    for public in ("sparsefuse.sae_decode", "sparsefuse.topk_sae_loss", "sparsefuse.hierarchical_sae_loss",
                   "sparsefuse.topk", "sparsefuse.sparse_linear", "sparsefuse.topk_kd_loss",
                   "sparsefuse.topk_kd_loss_from_logits", "sparsefuse.topk_kd_loss_from_hidden",
                   "sparsefuse.nearest_code", "sparsefuse.vq_ema_update"):
        assert public in called, public


@pytest.mark.parametrize("bad, message", [
    ("import sparsefuse\nsparsefuse.topk_sae_loss(a, b, c, d, e, f, g)", "does not fit"),
    ("import sparsefuse\nsparsefuse.nearest_code(x, c, cosine=True, precison='fast')", "does not fit"),
    ("import sparsefuse\nsparsefuse.no_such_op(x)", "no_such_op"),
    ("from sparsefuse import TopKSAE\nsae = TopKSAE(d_model=8, n_latents=16, k=2).cuda()\nsae.no_such()",
     "has no 'no_such'"),
    ("from sparsefuse import TopKSAE\nsae = TopKSAE.load('f')\nsae.fvu_curve(x, y, z, w)", "does not fit"),
    ("import sparsefuse\nvq = sparsefuse.VectorQuantizer(dim=8, codebook_size=4)\nvq(x, y, z)", "does not fit"),
])
def test_the_check_catches_a_call_that_does_not_fit(bad, message):
    with pytest.raises((AssertionError, AttributeError), match=message):
        _checked_calls(bad)


def test_readme_names_every_public_name():
    text = README.read_text()
    assert not [name for name in sparsefuse.__all__ if name not in text]
