"""Post-processing of particles outside the graph (numpy, scipy and the comm object): halo finding."""
