"""``FERROVOD_AS_HOROVOD=1``: ``import horovod.X.Y`` gives the module ``ferrovod.X.Y`` itself.

For code that imports Horovod and cannot be edited (a library, a vendored training script,
Horovod's own tests). ``ferrovod_as_horovod.pth``, shipped at the root of site-packages beside
this module, calls :func:`install` at interpreter start-up when the variable is set (to
anything but empty, ``0`` or ``false``); ``ferrovodrun --as-horovod`` sets it for every
worker. This module lives outside the ``ferrovod`` package so that start-up never runs
ferrovod's ``__init__`` (which loads the engine): ferrovod is imported only when code imports
``horovod``.

The alias hands back the very module object (``horovod.torch is ferrovod.torch``), whose
``__name__`` and ``__spec__`` stay ferrovod's, so pickles, ``importlib.reload`` and log
records keep naming ``ferrovod.*``. A real Horovod that ``import horovod`` would find is left
alone, with one line on stderr saying so.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys

# Neither importlib.abc nor typing is imported, and importlib.util only once code imports
# horovod: this module loads at every start-up of a process with the variable set, and
# importlib.abc alone pulls in importlib.resources (tempfile, typing, ...), some 50 ms of a
# cold start. The finder and loader implement the
# protocols of importlib.abc.MetaPathFinder and importlib.abc.Loader without subclassing them,
# which is all sys.meta_path asks.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from types import ModuleType

__all__ = ["VARIABLE", "enabled", "install", "uninstall", "HorovodAlias"]

#: The variable that turns the alias on.
VARIABLE = "FERROVOD_AS_HOROVOD"

_ALIAS = "horovod"
_TARGET = "ferrovod"


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``FERROVOD_AS_HOROVOD`` asks for the alias: set to anything but empty, ``0`` or
    ``false`` (any case). The .pth line repeats this test inline, so that start-up without the
    variable never imports this module."""
    value = (os.environ if environ is None else environ).get(VARIABLE, "")
    return value.strip().lower() not in ("", "0", "false")


def _target_name(fullname: str) -> str | None:
    """``ferrovod.X.Y`` for ``horovod.X.Y``; None for any other name (``horovodx`` too)."""
    if fullname == _ALIAS or fullname.startswith(_ALIAS + "."):
        return _TARGET + fullname[len(_ALIAS):]
    return None


def _real_horovod() -> str | None:
    """Where ``import horovod`` would find a Horovod of its own on sys.path, or None.

    Asks the path finder directly (this finder stands before it on ``sys.meta_path``). A
    namespace package (a bare ``horovod`` folder without ``__init__.py``, such as a data
    directory in the working directory) is not Horovod and does not count.
    """
    spec = importlib.machinery.PathFinder.find_spec(_ALIAS)
    if spec is None or spec.origin is None or not spec.has_location:
        return None
    if spec.submodule_search_locations:
        return str(list(spec.submodule_search_locations)[0])
    return spec.origin


class _AliasLoader:
    """Hands the import system the already imported ``ferrovod.X`` as ``horovod.X``."""

    def __init__(self, target: importlib.machinery.ModuleSpec) -> None:
        self.target = target.name
        self._target_spec = target
        self._original_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """Imports ``ferrovod.X`` (a no-op when it already is) and returns that module, so that
        ``sys.modules['horovod.X']`` becomes the same object."""
        module = importlib.import_module(self.target)
        self._original_spec = getattr(module, "__spec__", None)
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Runs nothing (ferrovod's import ran the module); puts back ferrovod's ``__spec__``,
        which the import system overwrites with the alias's on any module it creates."""
        if self._original_spec is not None:
            module.__spec__ = self._original_spec

    def get_code(self, fullname: str) -> object:
        """``ferrovod.X``'s code, for ``python -m horovod.X`` (runpy runs it as ``__main__``
        without importing the module)."""
        loader = self._target_spec.loader
        get_code = getattr(loader, "get_code", None)
        if get_code is None:
            raise ImportError(f"cannot run {fullname} as a script: {self.target} has no code",
                              name=fullname)
        return get_code(self.target)


class HorovodAlias:
    """A meta-path finder mapping ``horovod`` and every ``horovod.*`` to ``ferrovod.*``.

    Decides once, at the first ``horovod`` name it is asked for, whether a real Horovod is on
    sys.path; if so it finds nothing from then on (and says why, once), so the path finder
    after it imports that Horovod.
    """

    #: Lets install() recognise an instance even across reloads of this module.
    _ferrovod_as_horovod = True

    def __init__(self) -> None:
        self._real: str | None = None
        self._decided = False

    def _stand_aside(self) -> bool:
        if not self._decided:
            self._decided = True
            self._real = _real_horovod()
            if self._real is not None:
                sys.stderr.write(
                    f"ferrovod: {VARIABLE} is set but Horovod itself is installed at "
                    f"{self._real}; leaving `import horovod` to it\n"
                )
        return self._real is not None

    def invalidate_caches(self) -> None:
        """Looks for a real Horovod again at the next ``horovod`` import (called by
        ``importlib.invalidate_caches()``, as after installing packages at run time)."""
        self._decided = False

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        """The alias's spec for ``horovod[.X...]``; None for every other name.

        Raises ``ModuleNotFoundError`` (naming both modules) for a ``horovod.X`` whose
        ``ferrovod.X`` does not exist: returning None would give the bare "No module named"
        with no hint that the alias was involved.
        """
        name = _target_name(fullname)
        if name is None or self._stand_aside():
            return None
        import importlib.util

        try:
            # Finds without executing; importing a submodule's parents first, as any import.
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError as exc:
            missing = exc.name or name
            if missing != _TARGET and not missing.startswith(_TARGET + "."):
                raise  # a framework ferrovod's parent module needs: its own error says so
            raise _missing(fullname, missing) from None
        if found is None:
            raise _missing(fullname, name)
        spec = importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(found), is_package=found.submodule_search_locations is not None
        )
        if found.submodule_search_locations is not None:
            spec.submodule_search_locations = list(found.submodule_search_locations)
        return spec


def _missing(fullname: str, missing: str) -> ModuleNotFoundError:
    """The error for ``horovod.X`` when ``ferrovod``'s module ``missing`` does not exist."""
    if missing == _TARGET:
        return ModuleNotFoundError(
            f"No module named {fullname!r}: {VARIABLE} maps horovod.* to ferrovod.*, but "
            "ferrovod itself cannot be found", name=fullname)
    if missing.startswith(_TARGET + "."):
        # Name the first module that is missing (horovod.foo for horovod.foo.bar).
        fullname = _ALIAS + missing[len(_TARGET):]
    return ModuleNotFoundError(
        f"No module named {fullname!r}: {VARIABLE} maps horovod.* to ferrovod.*, and ferrovod "
        f"has no {missing!r}", name=fullname)


def install() -> HorovodAlias:
    """Puts the alias first on ``sys.meta_path`` (once; returns the finder in place). Called by
    the .pth at start-up; callable by hand where no .pth runs (``python -S``, embedded
    interpreters)."""
    for finder in sys.meta_path:
        if getattr(finder, "_ferrovod_as_horovod", False):
            return finder  # type: ignore[return-value]
    finder = HorovodAlias()
    sys.meta_path.insert(0, finder)
    return finder


def uninstall() -> None:
    """Takes the alias off ``sys.meta_path``; modules already imported as ``horovod.*`` stay
    in ``sys.modules``."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "_ferrovod_as_horovod", False)]
