"""cuboid.zoo."""
