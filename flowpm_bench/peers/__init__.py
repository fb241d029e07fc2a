"""Programs run by ``scripts/bench_peers.py`` in a peer's own environment, by path.

They import neither :mod:`flowpm_bench` nor ``flowpm_mtf`` nor TensorFlow: e.g.
:mod:`flowpm_bench.peers.jaxpm_force` runs in JaxPM's virtualenv
(``results/tmp/venv-jaxpm``), whose numpy our TensorFlow stack cannot use.
"""
import os

#: Folder of the peer programs (``bench_peers`` runs ``os.path.join(HERE, name)``).
HERE = os.path.dirname(os.path.abspath(__file__))
