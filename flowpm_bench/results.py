"""Where benchmark results go, and the writers every script uses.

Human-readable tables (``.md``) and figures stay in ``results/`` and are
versioned. The raw per-run JSON that benchmark runs rewrite goes to
``results/raw/`` (same sub-folder), which git ignores: :func:`raw_dir`. For an
output folder outside ``results/`` (e.g. ``--out /tmp/x``) the JSON stays next to
the table. Every table written through :func:`write_table` ends with a line
recording the commit and the machine (:func:`flowpm_bench.provenance.table_note`).
"""
import json
import logging
import os

from . import RAW, RESULTS, provenance

log = logging.getLogger(__name__)


def raw_dir(out):
    """The folder of the raw JSON that goes with the tables in ``out``.

    Parameters
    ----------
    out : str
        Folder of the tables.

    Returns
    -------
    str
        ``results/raw/<sub>`` for ``out = results/<sub>``; ``out`` itself otherwise
        (also for a folder already under ``results/raw/``).
    """
    out = os.path.abspath(out)
    rel = os.path.relpath(out, RESULTS)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        return out
    if rel.split(os.sep)[0] == os.path.basename(RAW):
        return out
    return os.path.normpath(os.path.join(RAW, rel))


def json_path(out, name):
    """``raw_dir(out)/name.json``.

    Parameters
    ----------
    out : str
    name : str

    Returns
    -------
    str
    """
    return os.path.join(raw_dir(out), name + ".json")


def read_json(path, default=None):
    """The JSON document at ``path``; ``default`` if the file does not exist.

    Parameters
    ----------
    path : str
    default : object, optional

    Returns
    -------
    object
    """
    if default is not None and not os.path.exists(path):
        return default
    with open(path) as f:
        return json.load(f)


def read_raw(path):
    """The raw results a table is rendered from; a clear exit when they are missing.

    The raw JSON is not versioned: a fresh clone has the tables but not their JSON,
    which only a benchmark run (or a copy from the machine that ran it) provides.
    Rendering must then stop, not overwrite a table with an empty one.

    Parameters
    ----------
    path : str

    Returns
    -------
    object

    Raises
    ------
    SystemExit
        If ``path`` does not exist.
    """
    if not os.path.exists(path):
        raise SystemExit("no raw results at %s: they are not versioned (results/raw/ is "
                         "ignored); run the benchmark first, or copy them from the machine "
                         "that ran it" % path)
    return read_json(path)


def write_json(path, data, sort_keys=False):
    """Write ``data`` to ``path`` (indent 1) through a temporary file, atomically.

    An interrupted run leaves the previous file, never a truncated one; the folder
    is created.

    Parameters
    ----------
    path : str
    data : object
    sort_keys : bool
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=sort_keys)
    os.replace(tmp, path)


def write_table(path, text, script=None, rendered_from=None):
    """Write a Markdown table ``text``, ending with its provenance line.

    Parameters
    ----------
    path : str
    text : str
        The Markdown document.
    script : str, optional
        The script writing it (named in the provenance line).
    rendered_from : str, optional
        The JSON it was rendered from, when nothing was run
        (see :func:`flowpm_bench.provenance.table_note`).

    Returns
    -------
    str
        The document as written.
    """
    repo = os.path.dirname(RESULTS)
    if rendered_from is not None and os.path.abspath(rendered_from).startswith(repo + os.sep):
        rendered_from = os.path.relpath(os.path.abspath(rendered_from), repo)
    doc = text.rstrip("\n") + "\n\n" + provenance.table_note(script, rendered_from) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(doc)
    log.info("wrote %s", path)
    return doc


def write_result(out, name, data, markdown, script=None):
    """Write the raw JSON ``json_path(out, name)`` and the table ``out/name.md``.

    Parameters
    ----------
    out : str
        Folder of the table.
    name : str
        Stem of both files.
    data : object
        The JSON document.
    markdown : str
        The table.
    script : str, optional
        See :func:`write_table`.

    Returns
    -------
    str
        The table as written.
    """
    write_json(json_path(out, name), data)
    return write_table(os.path.join(out, name + ".md"), markdown, script)
