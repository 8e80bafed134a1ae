"""cuboid.zoo.vit."""
