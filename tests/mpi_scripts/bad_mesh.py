"""Every rank builds a mesh of the wrong size: each must raise a clear error and exit."""
import sys

from hvd_mesh_impl import HvdSimdMeshImpl, runtime

runtime.install_abort_on_exception()
wanted = int(sys.argv[1])
HvdSimdMeshImpl([("x", wanted)], [])
