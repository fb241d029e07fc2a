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
defaults, then ``--config``, then the flags. A file sets each key once: the
same key twice (in one object, or flat and in its section) is an error, not
the last value silently.
"""
import argparse
import dataclasses
import json
import re
import typing

from ..backend import default_grid

__all__ = ["parse_grid", "parse_nc", "parse_floats", "field_docs", "add_job_arguments",
           "read_config_file", "check_file_value", "job_values", "make_configs"]

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
    if origin is typing.Union and type(None) in args:     # Optional[X]: None = automatic
        t = next(a for a in args if a is not type(None))
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


# ----------------------------------------------------------------------------- --config
def read_config_file(path):
    """The JSON object of a ``--config`` file.

    Parameters
    ----------
    path : str

    Returns
    -------
    dict

    Raises
    ------
    ConfigError
        One line naming the file: missing, a directory, unreadable, not UTF-8,
        invalid JSON (with line and column), a key twice in one object (``json``
        alone keeps the last value) or not a JSON object.
    """
    from ..errors import ConfigError

    where = "--config %s" % path
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError("%s: no such file" % where) from None
    except IsADirectoryError:
        raise ConfigError("%s: is a directory, expected a JSON file" % where) from None
    except PermissionError:
        raise ConfigError("%s: cannot be read (permission denied)" % where) from None
    except UnicodeDecodeError as e:
        raise ConfigError("%s: not UTF-8 text (byte %d), expected a JSON file"
                          % (where, e.start)) from None
    except OSError as e:
        raise ConfigError("%s: cannot be read: %s" % (where, e.strerror or e)) from None
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise ConfigError("%s: invalid JSON at line %d, column %d: %s"
                          % (where, e.lineno, e.colno, e.msg)) from None
    except _DuplicateKey as e:
        line = _second_key_line(text, e.key)
        raise ConfigError("%s: key %s appears twice in one object%s; JSON would keep only "
                          "the last value: give it once"
                          % (where, repr(e.key), " (again at line %d)" % line if line else "")
                          ) from None
    if not isinstance(data, dict):
        raise ConfigError("%s: expected a JSON object {\"key\": value, ...}, got %s"
                          % (where, _shown(data)))
    return data


class _DuplicateKey(ValueError):
    """A key twice in one JSON object."""

    def __init__(self, key):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs):
    """``object_pairs_hook`` of :func:`json.loads`: a dict, or :class:`_DuplicateKey`
    (``json.loads`` alone keeps the last of two equal keys without a word)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _second_key_line(text, key):
    """The line (1-based) of the second ``"key":`` of ``text`` when it holds exactly two,
    else ``None`` (written with escapes, or also used in another object: ambiguous)."""
    hits = [m.start() for m in re.finditer(
        re.escape(json.dumps(key, ensure_ascii=False)) + r"\s*:", text)]
    return text.count("\n", 0, hits[1]) + 1 if len(hits) == 2 else None


def _shown(value):
    """A value as written in JSON (``null``, ``"text"``, ``[1, 2]``), shortened."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _number(v):
    return not isinstance(v, bool) and isinstance(v, (int, float))


def _integer(v):
    return _number(v) and (isinstance(v, int) or (v == v and abs(v) != float("inf")
                                                  and float(v).is_integer()))


def _beyond_64_bits(value):
    """The first integer of ``value`` (a JSON value: lists and objects walked) outside
    ``[-2**63, 2**63)``, or ``None``."""
    from ..config import INT64_LIMIT

    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return next((h for h in map(_beyond_64_bits, value) if h is not None), None)
    if _number(value) and isinstance(value, int) and not -INT64_LIMIT <= value < INT64_LIMIT:
        return value
    return None


def _kind(f, default):
    """(check, description, optional) of the values a ``--config`` key of field ``f`` takes."""
    t = f.type
    origin, args = typing.get_origin(t), typing.get_args(t)
    optional = default is None
    if origin is typing.Union and type(None) in args:
        optional = True
        t = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(t), typing.get_args(t)
    if "choices" in f.metadata:
        choices = tuple(f.metadata["choices"])
        return ((lambda v: (not isinstance(v, bool)) and v in choices),
                "one of %s" % ", ".join(_shown(c) for c in choices), optional)
    if t is bool:
        return (lambda v: isinstance(v, bool)), "true or false", optional
    if t is int:
        return _integer, "an integer", optional
    if t is float:
        return _number, "a number", optional
    if t is str:
        return (lambda v: isinstance(v, str)), "a string", optional
    if origin is tuple:
        if f.name == "grid":
            return ((lambda v: isinstance(v, list) and len(v) == 2 and all(map(_integer, v))),
                    "[P, Q] (two integers) or \"PxQ\"", True)
        if args and args[-1] is Ellipsis:
            return ((lambda v: _number(v) or (isinstance(v, list) and all(map(_number, v)))),
                    "a number or a list of numbers", optional)
        ok = _integer if args and args[0] is int else _number
        what = "an integer or a list of 3 integers" if ok is _integer else \
            "a number or a list of 3 numbers"
        return ((lambda v: ok(v) or (isinstance(v, list) and len(v) == 3 and all(map(ok, v)))),
                what, optional)
    return None, None, True


def check_file_value(section, name, value, path):
    """Check the type of ``--config`` key ``name`` against its field; returns the value.

    The value's range (positive, below a limit, ...) is the dataclass's to
    check; this checks what JSON can get wrong: a string, ``null`` or a list
    where a number is expected, or the reverse, an integer beyond 64 bits (JSON
    has no limit), and the keys of the nested cosmology. ``"grid": "PxQ"`` becomes ``[P, Q]``.

    Parameters
    ----------
    section : ConfigSection
        The section that owns field ``name``.
    name : str
    value : object
        As read from the JSON file.
    path : str
        The file (for the message).

    Returns
    -------
    object

    Raises
    ------
    ConfigError
        Naming the file, the key, the value and what is expected.
    """
    from ..config import did_you_mean
    from ..errors import ConfigError

    f = {g.name: g for g in dataclasses.fields(section.cls)}[name]
    default = section.default(name)
    where = "--config %s: %s" % (path, repr(name))
    huge = _beyond_64_bits(value)
    if huge is not None:   # JSON integers have no limit; every field's number has
        raise ConfigError("%s: %d does not fit in 64 bits (integers lie in -2**63 to 2**63 - 1)"
                          % (where, huge))
    if dataclasses.is_dataclass(default):          # the nested cosmology: a dict of numbers
        names = [g.name for g in dataclasses.fields(default)]
        if not isinstance(value, dict):
            raise ConfigError("%s: expected an object of %s fields {%s}, got %s"
                              % (where, name, ", ".join('"%s": number' % n for n in names[:3])
                                 + ", ...", _shown(value)))
        for key, v in value.items():
            if key not in names:
                raise ConfigError("--config %s: unknown %s key %s%s; the keys are %s"
                                  % (path, name, repr(key), did_you_mean(key, names),
                                     ", ".join(names)))
            if not _number(v):
                raise ConfigError("--config %s: %s: expected a number, got %s"
                                  % (path, repr("%s.%s" % (name, key)), _shown(v)))
        return value
    if f.name == "grid" and isinstance(value, str):
        try:
            return list(parse_grid(value))
        except argparse.ArgumentTypeError:
            raise ConfigError("%s: expected [P, Q] (two integers) or \"PxQ\", got %s"
                              % (where, _shown(value))) from None
    ok, what, optional = _kind(f, default)
    if value is None:
        if optional:
            return value
        raise ConfigError("%s: expected %s, got null (the key has no automatic value; leave "
                          "it out for the default %s)" % (where, what, _show(default)))
    if ok is not None and not ok(value):
        raise ConfigError("%s: expected %s%s, got %s"
                          % (where, what, ", or null for automatic" if optional else "",
                             _shown(value)))
    return value


def _unknown_key(job, key, owner, sections, path, inside=None):
    """The ConfigError of an unknown ``--config`` key, with the closest valid key."""
    from ..config import did_you_mean
    from ..errors import ConfigError

    flags = {}
    for sec in job.sections:
        for f in dataclasses.fields(sec.cls):
            for flag in ["--" + f.name.replace("_", "-")] + list(f.metadata.get("flags", ())):
                flags[flag.lstrip("-").replace("-", "_")] = f.name
            default = sec.default(f.name)
            if dataclasses.is_dataclass(default):
                for g in dataclasses.fields(default):
                    flags[(COSMO_PREFIX + g.name).replace("-", "_")] = "%s.%s" % (f.name,
                                                                                    g.name)
                    flags[g.name] = "%s.%s" % (f.name, g.name)
    norm = str(key).lstrip("-").replace("-", "_")
    if norm in flags and norm != flags[norm]:
        full = flags[norm]
        hint = (" (the flag --%s is the key %s)" % (str(key).lstrip("-").replace("_", "-"),
                                                     repr(full)) if "." not in full else
                " (a cosmology parameter: {\"%s\": {\"%s\": ...}})" % tuple(full.split(".")))
    else:
        hint = did_you_mean(key, list(owner) + ([] if inside else list(sections)))
    return ConfigError("--config %s: unknown key %s%s%s; the %s job takes the keys %s (or "
                       "sections %s)" % (path, repr(key), " in section %s" % repr(inside)
                                         if inside else "", hint, job.name,
                                         ", ".join(sorted(owner)), ", ".join(sorted(sections))))


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
    ConfigError
        (a ``ValueError``) For a file that cannot be read, is no JSON object, has
        an unknown key, a key set twice (in one object, or flat and in its
        section) or a value of the wrong type (:func:`check_file_value`).
    """
    from ..errors import ConfigError

    sections = _sections(job)
    by_key = {sec.key: sec for sec in sections}
    values = {sec.key: dict(sec.defaults) for sec in sections}
    owner = {f.name: sec.key for sec in sections for f in dataclasses.fields(sec.cls)}
    if config_file:
        data = read_config_file(config_file)
        given = {}   # key ("cosmology.h" for the nested ones) -> where the file sets it
        for key, value in data.items():
            if key in values and key not in owner:
                if not isinstance(value, dict):
                    raise ConfigError("--config %s: section %s: expected an object of its "
                                      "fields {\"name\": value, ...}, got %s"
                                      % (config_file, repr(key), _shown(value)))
                items, inside = value.items(), key
            elif key in owner:
                items, inside = [(key, value)], None
            else:
                raise _unknown_key(job, key, owner, values, config_file)
            for name, v in items:
                if owner.get(name) is None:
                    raise _unknown_key(job, name, owner, values, config_file, inside)
                v = check_file_value(by_key[owner[name]], name, v, config_file)
                _set_once(given, name, v, "in section %s" % repr(inside) if inside
                          else "at the top level", config_file)
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


def _set_once(given, name, value, where, path):
    """Record that the ``--config`` file sets ``name`` (``where``); a key set twice, flat and
    in its section (or a cosmology parameter at both places), is a ConfigError."""
    from ..errors import ConfigError

    keys = (["%s.%s" % (name, k) for k in value] if name == _NESTED and isinstance(value, dict)
            else [name])
    for key in keys:
        if key in given:
            raise ConfigError("--config %s: %s is set twice, %s and %s; give it once"
                              % (path, repr(key), given[key], where))
        given[key] = where


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
        # ranks over further mesh axes (the imaging job's coil split) leave fewer to the grid
        split = sim.get("coil_split") or 1
        n_grid = (n_ranks // split if isinstance(split, int) and split >= 1
                  and n_ranks % split == 0 else n_ranks)   # else the config's own error
        sim["grid"] = default_grid(n_grid) if backend == "hvd" else (1, 1)
    return {sec.key: sec.make(values[sec.key]) for sec in job.sections}
