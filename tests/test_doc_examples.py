"""Every public name carries an example, and every example runs.

The public names are the exports of ``rollpipe`` and every public method and property
of the classes users drive (``DRIVEN_CLASSES``). An example is a ``>>>`` block in the
docstring (an ``Examples:`` section). The doctests of every module that defines a public
name run here, as tensordict's and TorchRL's do, with the session's shared fixtures
predefined so that no example starts an engine of its own:

* ``model_path``: the built-in tiny model's directory (a ``str``);
* ``tokenizer``: its Hugging Face tokenizer;
* ``engine``: the session's shared in-process ``VLLMEngine`` on that model.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import pytest

import rollpipe

DRIVEN_CLASSES = (
    "DataProto",
    "RolloutPipeline",
    "EnginePool",
    "FrontDoor",
    "ToolEnv",
    "VLLMEngine",
    "HFEngine",
    "ScriptedEngine",
)
"""Classes whose every public method and property carries an example."""


def _own_members(cls: type) -> Iterator[tuple[str, Any]]:
    """``cls``'s public methods and properties defined in rollpipe (not ``object``'s,
    attrs' or a third-party base's)."""
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        raw = inspect.getattr_static(cls, name)
        value = raw.fget if isinstance(raw, property) else getattr(cls, name)
        if isinstance(raw, (staticmethod, classmethod)):
            value = raw.__func__
        if not (inspect.isfunction(value) or isinstance(raw, property)):
            continue
        if not getattr(value, "__module__", "").startswith("rollpipe"):
            continue
        yield name, value


def public_callables() -> dict[str, Any]:
    """Every exported name and every public member of ``DRIVEN_CLASSES``, by its name."""
    out = {name: getattr(rollpipe, name) for name in rollpipe.__all__}
    for cls_name in DRIVEN_CLASSES:
        for name, member in _own_members(getattr(rollpipe, cls_name)):
            out[f"{cls_name}.{name}"] = member
    return out


def _has_example(value: Any) -> bool:
    return ">>>" in (inspect.getdoc(value) or "")


def test_every_public_name_has_an_example() -> None:
    names = public_callables()
    assert len(names) > len(rollpipe.__all__)  # the classes' members are counted too
    missing = sorted(name for name, value in names.items() if not _has_example(value))
    assert not missing, (
        f"{len(missing)} of {len(names)} public names have no '>>>' example in their "
        f"docstring: {missing}"
    )


def _documented_modules() -> list[str]:
    modules = {rollpipe._EXPORTS[name] for name in rollpipe.__all__}
    for value in public_callables().values():
        module = getattr(value, "__module__", None)
        if module and module.startswith("rollpipe"):
            modules.add(module)
    return sorted(modules)


@pytest.fixture(scope="module")
def doctest_globals(tiny_model_path: Any, tokenizer: Any, vllm_engine: Any) -> dict[str, Any]:
    return {"model_path": str(tiny_model_path), "tokenizer": tokenizer, "engine": vllm_engine}


@pytest.mark.parametrize("module_name", _documented_modules())
def test_the_examples_run(module_name: str, doctest_globals: dict[str, Any]) -> None:
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = doctest.DocTestRunner(optionflags=flags)
    tests = finder.find(module, module_name, globs={**vars(module), **doctest_globals})
    report: list[str] = []
    for test in sorted(tests, key=lambda t: t.name):
        runner.run(test, out=report.append)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, "".join(report)
