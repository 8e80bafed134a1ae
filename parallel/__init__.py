"""cuboid.parallel."""
