"""The scripts of ``scripts/`` as modules (the tests call their functions)."""
import importlib.util
import os
import sys

from . import REPO

#: The folder of the scripts.
SCRIPTS = os.path.join(REPO, "scripts")


def script_path(name):
    """Path of ``scripts/<name>.py``.

    Parameters
    ----------
    name : str

    Returns
    -------
    str
    """
    return os.path.join(SCRIPTS, name + ".py")


def load_script(name):
    """Import ``scripts/<name>.py`` as the module ``name`` (once; later calls reuse it).

    Parameters
    ----------
    name : str
        E.g. ``"bench_scaling"``.

    Returns
    -------
    module
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, script_path(name))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def split_passthrough(argv):
    """A script's own arguments and those after ``--``, which it passes on to a command.

    Parameters
    ----------
    argv : list of str

    Returns
    -------
    (list of str, list of str)
        The arguments before the first ``--`` and those after it (empty without one).
    """
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]
