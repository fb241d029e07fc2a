"""Distributed FlowPM on Mesh TensorFlow."""
