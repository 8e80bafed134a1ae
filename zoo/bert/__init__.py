"""cuboid.zoo.bert."""
