"""Files and run state: checks before a run (preflight, the memory model), distributed HDF5 and every file format, digests, checkpoints and resume, run directories."""
