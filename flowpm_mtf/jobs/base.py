"""The Job protocol: what a job supplies to the runner (:mod:`flowpm_mtf.jobs.runner`).

A job is one module of :mod:`flowpm_mtf.jobs` with a :class:`Job` subclass
registered by :func:`flowpm_mtf.jobs.register`. The runner calls, in order:

1. :meth:`Job.preflight` -- cheap checks of the configs before any graph is
   built (identical on every rank, so every rank raises the same error);
2. :meth:`Job.build` -- the Mesh TF graph on a fresh ``mtf.Mesh``;
3. :meth:`Job.lower` -- TF ops and fetches from the ``mtf.Lowering``;
4. :meth:`Job.execute` -- runs them in the session the runner opened
   (variables initialised, masters copied to slices); returns numpy results;
5. :meth:`Job.finish` -- numpy post-processing; returns the job's own
   summary fields;
6. :meth:`Job.write_all` (every rank, collective) -- the distributed files
   (each rank its slices, :mod:`flowpm_mtf.runs.h5dist`); then
   :meth:`Job.write` (rank 0 only) -- writes the products through
   :mod:`flowpm_mtf.runs.io` into the run directory; the runner then writes
   ``summary.json``;
7. :meth:`Job.check` (every rank) -- raise if the results are wrong (the
   outputs are kept for inspection).

The job's configuration is a set of frozen dataclasses, one per
:class:`ConfigSection` (e.g. ``SimConfig`` under ``"config"``, a
``LensingConfig`` under ``"lensing"``). The command-line options and the keys
of ``--config`` are generated from their fields (:mod:`flowpm_mtf.jobs.options`);
a job's own defaults are the ``defaults`` of its sections, defined once.
"""
import dataclasses

__all__ = ["ConfigSection", "Job"]


@dataclasses.dataclass(frozen=True)
class ConfigSection:
    """One configuration dataclass of a job.

    Attributes
    ----------
    key : str
        Name of the section in ``summary.json`` and in a ``--config`` file
        (``"config"`` is the ``SimConfig``).
    cls : type
        A frozen dataclass whose fields become options.
    defaults : dict
        The job's defaults where they differ from the dataclass's (the one
        place they are defined).
    """

    key: str
    cls: type
    defaults: dict = dataclasses.field(default_factory=dict)

    def default(self, name):
        """This job's default of field ``name``."""
        if name in self.defaults:
            return self.defaults[name]
        f = {f.name: f for f in dataclasses.fields(self.cls)}[name]
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return None

    def make(self, values):
        """An instance of :attr:`cls` from a dict of field values (unknown keys raise).

        Raises
        ------
        ValueError
            For unknown fields or invalid values (from the dataclass).
        """
        values = dict(values)
        names = {f.name for f in dataclasses.fields(self.cls)}
        unknown = set(values) - names
        if unknown:
            raise ValueError("unknown %s fields: %s" % (self.cls.__name__, sorted(unknown)))
        if hasattr(self.cls, "from_dict"):
            return self.cls.from_dict(values)
        return self.cls(**values)


class Job:
    """Base class of the jobs (see the module docstring for the protocol).

    Class attributes
    ----------------
    name : str
        Sub-command name (``flowpm-mtf NAME``).
    help : str
        One line for ``flowpm-mtf --help``.
    sections : tuple of ConfigSection
        The job's configuration; the first is the ``SimConfig`` (key
        ``"config"``).
    default_out : str
        Default run directory.
    checkpoints : bool
        The job's loop checkpoints and resumes (``--checkpoint-every``,
        ``--resume``; :mod:`flowpm_mtf.runs.checkpoint`).
    loop_unit : str
        What one pass of the job's loop is called (``"step"``, ``"iteration"``):
        the unit of ``--checkpoint-every`` and of the stop messages.
    state_sections : dict
        The job's own config sections (besides ``"config"``) whose fields
        change its state, section key -> tuple of its output-only fields: they
        are part of the checkpoint's config hash
        (:func:`flowpm_mtf.runs.checkpoint.state_config`), so a resume with another
        value is refused.
    """

    checkpoints = False
    loop_unit = "step"
    state_sections = {}
    name = None
    help = ""
    sections = ()
    default_out = "out"

    def preflight(self, ctx):
        """Checks before anything is built (raise ``ValueError`` with a one-line message)."""

    def build(self, ctx, mesh):
        """Build the Mesh TF graph on ``mesh``; returns an object handed to :meth:`lower`."""
        raise NotImplementedError

    def describe(self, ctx, graph):
        """Text logged after the graph is built, e.g. ``"10 steps, mesh 64x64x64"``."""
        return ""

    def lower(self, ctx, graph, lowering):
        """TF ops and fetches of the lowered graph (any object; handed to :meth:`execute`)."""
        raise NotImplementedError

    def execute(self, ctx, sess, graph, plan):
        """Run the job in the open session; returns its (numpy) results."""
        raise NotImplementedError

    def finish(self, ctx, results):
        """Post-process the results (numpy); returns the job's summary fields (dict)."""
        return {}

    def write_all(self, ctx, results):
        """Write the distributed products on every rank (collective); ``ctx.file(name)``
        gives each file's path on every rank."""

    def write(self, ctx, out, results, summary):
        """Write the products on rank 0: ``out.path(name)`` gives each file's path."""

    def plot(self, ctx, out, results, summary):
        """Write the job's figure on rank 0 (skipped with ``--no-plot``)."""

    def check(self, ctx, summary):
        """Verify the results on every rank after the outputs are written (raise if wrong)."""

    def report(self, ctx, summary):
        """Text of the final log line after the outputs are written."""
        return ""
