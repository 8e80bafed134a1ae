"""Loading models: presets and folders (model), the builder, the planner and its calibration."""
