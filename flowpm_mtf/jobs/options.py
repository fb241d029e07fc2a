"""Command-line options and ``--config`` keys generated from the jobs' config dataclasses.

Every field of every :class:`~flowpm_mtf.jobs.base.ConfigSection` of a job
becomes an option ``--field-name`` (underscores become dashes; the fields of
the nested ``SimConfig.cosmology`` become ``--cosmo-<field>``), with

* its help text taken from the dataclass's numpydoc ``Parameters`` section
  (written once, in the dataclass), followed by the job's default;
* its parser from the field's type: ``int``/``float``/``str``, ``bool``
  (``--x``/``--no-x``), 3-tuples (``N`` or ``NX,NY,NZ``), the process grid
  (``PxQ``), and variable-length tuples (``0.5,1.0``);
* extra flags (``metadata={"flags": ("--steps",)}``) and choices
  (``metadata={"choices": ...}``) from the field's metadata.

A ``--config`` JSON file sets the same fields by name: flat keys
(``{"nc": 32, "z_source": [1.0], "iterations": 50}``) or per section, with the
section names of ``summary.json`` (``{"config": {...}, "lensing": {...}}``);
``cosmology`` takes a dict of Cosmology fields. Precedence: the job's
defaults, then ``--config``, then the flags.
"""
import argparse
import dataclasses
import json
import re
import typing

from ..backend import default_grid

__all__ = ["parse_grid", "parse_nc", "parse_floats", "field_docs", "add_job_arguments",
           "job_values", "make_configs"]

COSMO_PREFIX = "cosmo-"
"""Flags of the nested cosmology fields: ``--cosmo-<field>``."""
_NESTED = "cosmology"


# ----------------------------------------------------------------------------- parsers
def parse_grid(text):
    """``"2x2"`` -> (2, 2)."""
    try:
        p, q = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError("--grid takes PxQ, e.g. 2x1, got %r" % text)
    return (p, q)


def _numbers(kind, what, counts):
    def parse(text):
        try:
            parts = [kind(v) for v in text.split(",")]
        except ValueError:
            parts = None
        if parts is None or (counts and len(parts) not in counts):
            raise argparse.ArgumentTypeError("%s, got %r" % (what, text))
        return parts[0] if counts == (1, 3) and len(parts) == 1 else tuple(parts)
    return parse


parse_nc = _numbers(int, "expected N or NX,NY,NZ (integers)", (1, 3))
"""``"64"`` -> 64, ``"64,32,32"`` -> (64, 32, 32)."""
parse_box = _numbers(float, "expected L or LX,LY,LZ [Mpc/h]", (1, 3))
"""``"200"`` -> 200.0, ``"100,100,150"`` -> (100.0, 100.0, 150.0)."""
parse_floats = _numbers(float, "expected comma-separated numbers", None)
"""``"0.5,1.0"`` -> (0.5, 1.0)."""


def _parser(f):
    """(argparse keyword arguments, metavar) for a dataclass field."""
    t = f.type
    origin, args = typing.get_origin(t), typing.get_args(t)
    kw = {}
    if "choices" in f.metadata:
        kw["choices"] = f.metadata["choices"]
    if t is bool:
        kw["action"] = argparse.BooleanOptionalAction
        return kw
    if origin is tuple:
        if f.name == "grid":
            kw["type"], kw["metavar"] = parse_grid, "PxQ"
        elif args and args[-1] is Ellipsis:
            kw["type"], kw["metavar"] = parse_floats, "A[,B...]"
        elif args and args[0] is int:
            kw["type"], kw["metavar"] = parse_nc, "N[,N,N]"
        else:
            kw["type"], kw["metavar"] = parse_box, "X[,Y,Z]"
        return kw
    kw["type"] = {int: int, float: float, str: str}.get(t, str)
    if "choices" not in kw:
        kw["metavar"] = f.name.upper()
    return kw


# ----------------------------------------------------------------------------- help texts
def field_docs(cls):
    """Field name -> description, from the numpydoc ``Parameters`` section of ``cls``."""
    doc = cls.__doc__ or ""
    m = re.search(r"\n\s*Parameters\n\s*-+\n(.*?)(\n\s*\n\s*[A-Z][a-z]+\n\s*-+\n|\Z)", doc, re.S)
    if not m:
        return {}
    out, names, text = {}, None, []
    lines = m.group(1).split("\n")
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())

    def flush():
        if names:
            desc = " ".join(" ".join(text).split())
            desc = re.sub(r":[a-z]+:", "", desc).replace("``", "").replace("`", "")
            for n in names:
                out[n] = desc

    for line in lines:
        if line.strip() and len(line) - len(line.lstrip()) == indent:
            flush()
            names = [n.strip() for n in line.split(":")[0].split(",")]
            text = []
        elif line.strip():
            text.append(line.strip())
    flush()
    return out


def _show(value):
    if isinstance(value, (tuple, list)):
        if len(value) == 3 and len(set(value)) == 1:
            return _show(value[0])
        return ",".join(_show(v) for v in value) if value else "none"
    if isinstance(value, float):
        return "%g" % value
    return str(value)


# ----------------------------------------------------------------------------- parser
def _sections(job):
    """The job's sections, checking that no field name appears twice."""
    seen = {}
    for sec in job.sections:
        for f in dataclasses.fields(sec.cls):
            if f.name in seen:
                raise ValueError("job %s: field %r in sections %s and %s"
                                 % (job.name, f.name, seen[f.name], sec.key))
            seen[f.name] = sec.key
    return job.sections


def add_job_arguments(parser, job):
    """Add one option per config field of ``job`` to ``parser`` (see the module docstring)."""
    for sec in _sections(job):
        group = parser.add_argument_group("%s options (%s)" % (sec.key, sec.cls.__name__))
        docs = field_docs(sec.cls)
        for f in dataclasses.fields(sec.cls):
            if dataclasses.is_dataclass(sec.default(f.name)):
                _add_nested(parser, sec, f)
                continue
            default = sec.default(f.name)
            if f.name == "grid":
                shown = "from the number of MPI ranks (placement: 1x1)"
            else:
                shown = _show(default)
            flags = ["--" + f.name.replace("_", "-")] + list(f.metadata.get("flags", ()))
            group.add_argument(*flags, dest="%s:%s" % (sec.key, f.name),
                               default=argparse.SUPPRESS,
                               help="%s (default: %s)" % (docs.get(f.name, f.name), shown),
                               **_parser(f))


def _add_nested(parser, sec, f):
    """Options ``--cosmo-<field>`` of a nested dataclass field (the cosmology)."""
    value = sec.default(f.name)
    group = parser.add_argument_group("%s options (%s.%s)" % (f.name, sec.cls.__name__,
                                                              f.name))
    docs = field_docs(type(value))
    for g in dataclasses.fields(value):
        group.add_argument("--" + COSMO_PREFIX + g.name.replace("_", "-"),
                           dest="%s:%s.%s" % (sec.key, f.name, g.name),
                           default=argparse.SUPPRESS,
                           help="%s (default: %s)" % (docs.get(g.name, g.name),
                                                      _show(getattr(value, g.name))),
                           **_parser(g))


# ----------------------------------------------------------------------------- values
def job_values(job, args, config_file=None):
    """Field values per section: the job's defaults, then ``config_file``, then ``args``.

    Parameters
    ----------
    job : Job
    args : argparse.Namespace
        Parsed by a parser set up with :func:`add_job_arguments`.
    config_file : str, optional
        JSON file (see the module docstring).

    Returns
    -------
    dict
        Section key -> {field: value}.

    Raises
    ------
    ValueError
        For an unknown key in the file.
    """
    sections = _sections(job)
    values = {sec.key: dict(sec.defaults) for sec in sections}
    owner = {f.name: sec.key for sec in sections for f in dataclasses.fields(sec.cls)}
    if config_file:
        with open(config_file) as fh:
            data = json.load(fh)
        if not isinstance(data, dict):
            raise ValueError("--config %s: expected a JSON object" % config_file)
        for key, value in data.items():
            if key in values and isinstance(value, dict) and key not in owner:
                items = value.items()
            elif key in owner:
                items = [(key, value)]
            else:
                raise ValueError("--config %s: unknown key %r; the %s job takes the fields %s "
                                 "(or sections %s)" % (config_file, key, job.name,
                                                       ", ".join(sorted(owner)),
                                                       ", ".join(sorted(values))))
            for name, v in items:
                if owner.get(name) is None:
                    raise ValueError("--config %s: unknown field %r" % (config_file, name))
                _merge(values[owner[name]], name, v)
    for dest, value in sorted(vars(args).items()):
        if ":" not in dest:
            continue
        key, name = dest.split(":", 1)
        if "." in name:
            outer, inner = name.split(".", 1)
            _merge(values[key], outer, {inner: value})
        else:
            values[key][name] = value
    return values


def _merge(section_values, name, value):
    if name == _NESTED and isinstance(value, dict):
        old = section_values.get(name)
        merged = dict(old.to_dict() if hasattr(old, "to_dict") else (old or {}))
        merged.update(value)
        section_values[name] = merged
    else:
        section_values[name] = value


def make_configs(job, args, config_file=None, n_ranks=1, backend="hvd"):
    """The config instances of ``job``: section key -> dataclass instance.

    The process grid, when not given, is :func:`flowpm_mtf.backend.default_grid`
    of ``n_ranks`` for the hvd backend and (1, 1) for placement.

    Raises
    ------
    ValueError
        For invalid values (the dataclass names them) or unknown keys.
    """
    values = job_values(job, args, config_file)
    sim = values["config"]
    if sim.get("grid") is None:
        sim["grid"] = default_grid(n_ranks) if backend == "hvd" else (1, 1)
    return {sec.key: sec.make(values[sec.key]) for sec in job.sections}
