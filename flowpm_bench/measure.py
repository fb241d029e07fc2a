"""Memory of a benchmark process."""
import resource


def peak_mb():
    """Peak resident memory of this process [MB] (``ru_maxrss``, KiB on Linux).

    Benchmark processes never reset the kernel's peak counter (only a job's
    ``RunContext.mark`` does, see ``flowpm_mtf.jobs.runner.peak_memory_mb``), so
    ``ru_maxrss`` is the peak since the process started.

    Returns
    -------
    float
    """
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def private_mb():
    """Memory private to this process now [MB].

    From ``/proc/self/smaps_rollup``: what N processes need together, unlike the
    RSS, which counts the shared libraries in each.

    Returns
    -------
    float
    """
    total = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1])
    return total / 1024.0
