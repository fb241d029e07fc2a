"""Where a result came from: the commit of the code and the machine (no host name)."""
import os
import platform
import subprocess

from . import REPO


def git(*args):
    """Output of ``git -C REPO *args`` (stripped), ``""`` if git fails or is missing.

    Parameters
    ----------
    *args : str

    Returns
    -------
    str
    """
    try:
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def code_dirty(*paths, untracked=False):
    """Whether files under ``paths`` differ from the commit.

    Parameters
    ----------
    *paths : str
        Git pathspecs (default: the whole tree but ``results/``, which the
        benchmarks themselves rewrite).
    untracked : bool
        Count untracked (not ignored) files too; default: tracked files only, as
        ``git describe --dirty``.

    Returns
    -------
    bool
    """
    spec = list(paths) or [".", ":(exclude)results"]
    return bool(git("status", "--porcelain", "--untracked-files=%s" % ("normal" if untracked
                                                                        else "no"),
                    "--", *spec))


def commit_label():
    """``git rev-parse --short HEAD``, with ``-dirty`` when :func:`code_dirty`.

    Returns
    -------
    str
        ``"unknown"`` outside a git checkout.
    """
    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown"
    return commit + ("-dirty" if code_dirty() else "")


def memory_gb():
    """Total memory of the machine [GB] (``/proc/meminfo``), None if unknown.

    Returns
    -------
    float or None
    """
    try:
        with open("/proc/meminfo") as f:
            return round(int(f.readline().split()[1]) / 1024.0 ** 2, 1)
    except (OSError, ValueError, IndexError):
        return None


DEFAULT_STACK = "tf2.21"
"""The stack ``scripts/setup_env.sh`` installs when ``FLOWPM_MTF_STACK`` is unset."""

PREVIOUS_STACK = "tf2.12"
"""The stack every record without a ``stack`` field was measured on (before 2026-11-25)."""


def tensorflow_version():
    """The installed TensorFlow's version, read from its metadata (TF is not imported).

    Returns
    -------
    str or None
        e.g. ``"2.21.0"``; None when neither ``tensorflow-cpu`` nor ``tensorflow`` is
        installed in this interpreter's environment.
    """
    from importlib import metadata
    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def stack():
    """The software stack of this interpreter, as ``FLOWPM_MTF_STACK`` names it.

    The benchmarks launch their sub-runs with ``sys.executable``, so a benchmark run
    with ``.venv-tf2.12/bin/python`` measures the TF 2.12 stack and one run with
    ``.venv/bin/python`` the default one; the records carry this label and the
    tables put the stacks side by side.

    Returns
    -------
    str
        ``"tf<major>.<minor>"`` of the installed TensorFlow (``"tf2.21"``,
        ``"tf2.12"``), ``"unknown"`` without TensorFlow.
    """
    version = tensorflow_version()
    if not version:
        return "unknown"
    return "tf" + ".".join(version.split(".")[:2])


def stack_of(record):
    """The stack a benchmark record was measured on (:data:`PREVIOUS_STACK` if unrecorded).

    Parameters
    ----------
    record : dict

    Returns
    -------
    str
    """
    return record.get("stack") or PREVIOUS_STACK


def with_stack(text, stack):
    """``text`` labelled with ``stack`` when it is not the default one (``"current tf2.12"``).

    Parameters
    ----------
    text : str
    stack : str
        A :func:`stack` label.

    Returns
    -------
    str
    """
    return text if stack == DEFAULT_STACK else "%s %s" % (text, stack)


def machine():
    """The machine, without its host name.

    Returns
    -------
    dict
        ``cpus`` (cores), ``memory_gb``, ``platform`` (OS and kernel), ``python``,
        ``tensorflow`` (version), ``loadavg`` (1, 5 and 15-minute load averages,
        :func:`os.getloadavg`).
    """
    return {"cpus": os.cpu_count(), "memory_gb": memory_gb(), "platform": platform.platform(),
            "python": platform.python_version(), "tensorflow": tensorflow_version(),
            "loadavg": list(os.getloadavg())}


def table_note(script=None, rendered_from=None):
    """One Markdown line: the commit and machine a table was written at.

    Parameters
    ----------
    script : str, optional
        The script that writes the table (e.g. ``"scripts/bench_fft.py"``).
    rendered_from : str, optional
        The raw JSON the table was rendered from without running anything: the
        commit and machine are then those of the rendering, the measurements'
        own are in the table and the JSON.

    Returns
    -------
    str
    """
    m = machine()
    what = "Written" if rendered_from is None else "Rendered from `%s`" % rendered_from
    return ("_%s%s at commit %s on a machine with %s cores, %s GB, load average %s._"
            % (what, " by `%s`" % script if script else "", commit_label(), m["cpus"],
               m["memory_gb"] if m["memory_gb"] is not None else "?",
               " ".join("%.2f" % v for v in m["loadavg"])))
