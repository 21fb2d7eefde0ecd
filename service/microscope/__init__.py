"""The microscope's face: inspect, compare, patch, attribute, stored vectors, the viewer."""
