"""mri_mtf: 3D MRI reconstruction with the image split over the process grid.

A proof of concept (issue 29) that the Horovod backend serves a Mesh TF model whose
*image* is split over the ranks: a 3D Shepp-Logan phantom, undersampled Cartesian
k-space through the distributed FFT of :mod:`flowpm_mtf.mesh.fft`, a model-parallel 3D
convolution, and zero-filled / total-variation reconstructions with PSNR and SSIM
computed by reductions. The package imports nothing here; see ``docs/design.md``.
"""
