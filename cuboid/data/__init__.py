"""Data: dataset formats into rows, chat templates, SFT rows, packing, streaming."""
