"""The fine-tune loop and its step: loop, step, config, schedule, resume, callbacks, curves."""
