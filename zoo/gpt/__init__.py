"""cuboid.zoo.gpt."""
