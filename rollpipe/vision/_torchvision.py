"""torchvision beside a CPU torch: skip its two operator registrations when its ops fail.

Every vLLM VLM and transformers' Qwen2-VL processor import torchvision. The registry's
torchvision wheels are CUDA builds: next to the CPU torch their ``_C`` ops library does
not load, and ``import torchvision`` then dies in ``torchvision._meta_registrations``
(``operator torchvision::nms does not exist``). Its image transforms do not need those
ops: they run in pure torch.

``install()`` puts a finder at the front of ``sys.meta_path`` that answers for exactly
two modules, ``torchvision._meta_registrations`` and ``torchvision._autograd_registrations``,
and only when torchvision's own check says its ops did not load (``torchvision.extension``
runs before both and records it in ``_has_ops()``): it hands out empty stand-ins, so the
import goes on. Where the ops load (a CUDA torch on a GPU machine, a CPU torchvision
build) it answers None and the real modules register as usual.

This module imports only the standard library, so a ``.pth`` line can install the finder
in every interpreter of a virtualenv, vLLM's engine-core processes included:
``rollpipe.vision.write_torchvision_pth()`` writes that line (``rollpipe_torchvision.pth``)
into the running interpreter's site-packages (``nox -s vision`` does).
"""

from __future__ import annotations

import importlib.machinery
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["PTH_LINE", "PTH_NAME", "REGISTRATIONS", "install", "skipped", "write_pth"]

REGISTRATIONS = ("torchvision._meta_registrations", "torchvision._autograd_registrations")
"""The two torchvision modules that register ops on the ``_C`` library's operators."""

PTH_NAME = "rollpipe_torchvision.pth"
PTH_LINE = (
    "import importlib.util as _u, os as _o, sys as _s; _r = _u.find_spec('rollpipe'); "
    "_m = _r and _r.submodule_search_locations and _u.spec_from_file_location("
    "'rollpipe_torchvision_guard', _o.path.join(list(_r.submodule_search_locations)[0], "
    "'vision', '_torchvision.py')); _g = _m and _u.module_from_spec(_m); "
    "_g and (_s.modules.setdefault(_m.name, _g), _m.loader.exec_module(_g), _g.install())\n"
)
"""One line a virtualenv's ``site`` runs at every start (skipped if rollpipe is gone). It
loads this file alone, as ``STARTUP_NAME``, without running ``rollpipe/vision/__init__.py``
(which imports the image conversation, torch with it): start-up stays at milliseconds;
``rollpipe.vision._torchvision`` shares its record of what it skipped."""
STARTUP_NAME = "rollpipe_torchvision_guard"

# the copy the .pth line loaded (when this is not it): one record of what was skipped
_started = sys.modules.get(STARTUP_NAME) if __name__ != STARTUP_NAME else None
_skipped: list[str] = getattr(_started, "_skipped", [])


def skipped() -> tuple[str, ...]:
    """The registration modules replaced by stand-ins in this process (empty where
    torchvision's ops loaded, or torchvision was not imported)."""
    return tuple(_skipped)


def _ops_loaded() -> bool:
    extension = sys.modules.get("torchvision.extension")
    has_ops = getattr(extension, "_has_ops", None)
    return bool(has_ops()) if callable(has_ops) else True  # unknown layout: stay out


class _StandIn:  # an importlib loader (importlib.abc would cost ms at every start)
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = ModuleType(spec.name)
        module.__doc__ = (
            "Stand-in from rollpipe.vision._torchvision: torchvision's ops library did not "
            "load beside this torch, so its operator registrations are skipped."
        )
        return module

    def exec_module(self, module: ModuleType) -> None:
        _skipped.append(module.__name__)


class _RegistrationFinder:  # a meta path finder
    rollpipe_torchvision_guard = True

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in REGISTRATIONS or _ops_loaded():
            return None
        return importlib.machinery.ModuleSpec(fullname, _StandIn())  # type: ignore[arg-type]


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once per process; cheap: it looks at
    two module names and nothing else)."""
    if not any(getattr(f, "rollpipe_torchvision_guard", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegistrationFinder())


def write_pth(site_packages: str | Path | None = None) -> Path:
    """Write ``PTH_NAME`` into ``site_packages`` (default: this interpreter's purelib),
    so every interpreter of that environment installs the finder at start-up."""
    import sysconfig
    from pathlib import Path

    target = Path(site_packages or sysconfig.get_paths()["purelib"]) / PTH_NAME
    target.write_text(PTH_LINE)
    return target
